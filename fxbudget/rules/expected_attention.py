"""`expected_attention`: the attention that future queries are expected to pay, from query statistics.

kvpress's ExpectedAttentionPress (Devoto et al., "Expected Attention", 2025, arXiv:2510.00636). For each query head:
the mean `mu` and covariance `S` of the pre-RoPE queries (sink positions excluded), rotated by the RoPE rotation
averaged over the next `n_future_positions` positions (`R`); then for each key `k`
    z = (R mu) . k / sqrt(d) + k^T (R S R^T) k / (2 d),   score = softmax_k(z), averaged over the KV group,
multiplied by `||v|| (+ epsilon)` when `use_vnorm`; the first `n_sink` tokens are always kept.
Departures: the statistics come from this call's queries, un-rotated with the layer's RoPE frequencies (kvpress
projects the prompt's hidden states through `W_q` and omits its bias; with chunked prefill, each chunk has its own
statistics); the softmax runs over the candidates (cached entries and the call's tokens). Needs default RoPE: a model
without it is refused when compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from . import register
from .base import Rule, Signals


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


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
        n = s.new_pos.shape[0]
        g = gn // n
        q = s.queries.float().view(b, h, g, n, d)
        # Undo RoPE: the queries were rotated by their own positions.
        theta = s.new_pos.float().unsqueeze(-1) * s.inv_freq.float()
        cos, sin = torch.cat([theta.cos()] * 2, dim=-1), torch.cat([theta.sin()] * 2, dim=-1)
        q = q * cos - _rotate_half(q) * sin
        use = (s.new_pos >= self.n_sink).float()
        use = torch.where(use.sum() > 0, use, torch.ones_like(use)).view(1, 1, 1, n, 1)  # all sinks: use them all
        mu = (q * use).sum(dim=3) / use.sum()  # [b, h, g, d]
        # The RoPE rotation averaged over the next positions: R = diag(cos) + diag(sin) P, with P x = rotate_half(x).
        future = s.step + torch.arange(self.n_future_positions, device=q.device)
        phi = future.float().unsqueeze(-1) * s.inv_freq.float()
        c, sn = torch.cat([phi.cos().mean(0)] * 2), torch.cat([phi.sin().mean(0)] * 2)
        eye = torch.eye(d, device=q.device)
        R = c.unsqueeze(1) * eye + sn.unsqueeze(1) * _rotate_half(eye).T
        mu = mu @ R.T
        keys = s.keys.float()  # [b, h, C, d]
        z = torch.einsum("bhgd,bhcd->bhgc", mu, keys) / math.sqrt(d)
        if self.use_covariance:
            centred = (q - (q * use).sum(dim=3, keepdim=True) / use.sum()) * use
            if n < d:  # k^T (R S R^T) k = |centred R^T k|^2 / N: rank n, cheaper than the d x d form (decode: n = 1)
                proj = torch.einsum("bhgnd,bhcd->bhgnc", centred, keys @ R)
                z = z + proj.square().sum(dim=3) / use.sum() / (2 * d)
            else:
                cov = torch.einsum("bhgnd,bhgne->bhgde", centred, centred) / use.sum()
                cov = R @ cov @ R.T
                z = z + torch.einsum("bhcd,bhgde,bhce->bhgc", keys, cov, keys) / (2 * d)
        scoreable = (s.pos >= self.n_sink).unsqueeze(2)
        p = torch.softmax(z.masked_fill(~scoreable, float("-inf")), dim=-1).nan_to_num(0.0).mean(dim=2)
        if self.use_vnorm:
            p = (p + self.epsilon) * s.value_norm
        return p

    def protect(self, s: Signals) -> Tensor:
        return (s.pos >= 0) & (s.pos < self.n_sink)
