"""`expected_attention`: the attention that future queries are expected to pay, from query statistics.

kvpress's ExpectedAttentionPress (Devoto et al., "Expected Attention", 2025, arXiv:2510.00636). For each query head:
the mean `mu` and covariance `S` of the pre-RoPE queries (sink positions excluded), rotated by the RoPE rotation
averaged over the next `n_future_positions` positions (`R`); then for each key `k`
    z = (R mu) . k / sqrt(d) + k^T (R S R^T) k / (2 d),   score = softmax_k(z), averaged over the KV group,
multiplied by `||v|| (+ epsilon)` when `use_vnorm`; the first `n_sink` tokens are always kept.
Departures: the statistics come from this call's queries, un-rotated with the layer's RoPE frequencies (kvpress
projects the prompt's hidden states through `W_q` and omits its bias; with chunked prefill, each chunk has its own
statistics); the softmax runs over the candidates (cached entries and the call's tokens). Needs the model's RoPE
frequencies, read off its rotary embedding (`fxbudget.cache.rope`: default, llama3, YaRN, linear; partial rotary
included: only the first `r` dims are un-rotated, `r = 2 * len(inv_freq)`); dynamic or LongRoPE scaling, and dims
paired otherwise (interleaved, GLM), are refused when compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .registry import register
from .base import Rule, Signals, rope_cos_sin, rotate_half, unrotate


@register("expected_attention")
@dataclass
class ExpectedAttention(Rule):
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    needs_rope: ClassVar[bool] = True

    def score(self, s: Signals) -> Tensor:
        b, h, gn, d = s.queries.shape
        n = s.new_pos.shape[-1]
        g = gn // n
        q = s.queries.float().view(b, h, g, n, d)
        # Undo RoPE: the queries were rotated by their own positions (per row: rows may be padded differently). The
        # frequencies cover the rotated dims only: `[r/2]`, r < d under partial rotary (GLM, StableLM, GPT-NeoX).
        rot = 2 * s.inv_freq.shape[-1]
        q = unrotate(q, s.new_pos.view(b, 1, 1, n), s.inv_freq)
        use = (s.new_pos >= self.n_sink).float()  # pads (-1) and sinks excluded
        use = torch.where(use.sum(-1, keepdim=True) > 0, use, (s.new_pos >= 0).float())  # all sinks: use them all
        count = use.sum(-1).clamp(min=1).view(b, 1, 1, 1)
        use = use.view(b, 1, 1, n, 1)
        mu = (q * use).sum(dim=3) / count  # [b, h, g, d]
        # The RoPE rotation averaged over the next positions: R = diag(cos) + diag(sin) P, with P x = rotate_half(x).
        future = s.step.view(b, 1) + torch.arange(self.n_future_positions, device=q.device)
        phi = future.float().unsqueeze(-1) * s.inv_freq.float()  # [b, future, r/2]
        c, sn = (t.mean(1) for t in rope_cos_sin(phi, d))  # [b, d]; unrotated dims: cos 1, sin 0
        eye = torch.eye(d, device=q.device)
        R = (c.unsqueeze(-1) * eye + sn.unsqueeze(-1) * rotate_half(eye, rot).T).unsqueeze(1)  # [b, 1, d, d]
        mu = mu @ R.transpose(-1, -2)
        keys = s.keys.float()  # [b, h, C, d]
        z = torch.einsum("bhgd,bhcd->bhgc", mu, keys) / math.sqrt(d)
        if self.use_covariance:
            centred = (q - (q * use).sum(dim=3, keepdim=True) / count.unsqueeze(-1)) * use
            if n < d:  # k^T (R S R^T) k = |centred R^T k|^2 / N: rank n, cheaper than the d x d form (decode: n = 1)
                proj = torch.einsum("bhgnd,bhcd->bhgnc", centred, keys @ R)
                z = z + proj.square().sum(dim=3) / count / (2 * d)
            else:
                cov = torch.einsum("bhgnd,bhgne->bhgde", centred, centred) / count.unsqueeze(-1)
                cov = R.unsqueeze(1) @ cov @ R.transpose(-1, -2).unsqueeze(1)
                z = z + torch.einsum("bhcd,bhgde,bhce->bhgc", keys, cov, keys) / (2 * d)
        scoreable = (s.pos >= self.n_sink).unsqueeze(2)
        p = torch.softmax(z.masked_fill(~scoreable, float("-inf")), dim=-1).nan_to_num(0.0).mean(dim=2)
        if self.use_vnorm:
            p = (p + self.epsilon) * s.value_norm
        return p

    def protect(self, s: Signals) -> Tensor:
        return (s.pos >= 0) & (s.pos < self.n_sink)

    def protected_per_head(self, budget: int) -> int:
        return self.n_sink  # the sinks
