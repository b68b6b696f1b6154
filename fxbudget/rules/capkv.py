"""`capkv`: query-relevance weight x the value's leverage under the relevance-weighted value capacity matrix.

"CAPKV" (arXiv:2604.25975), as kvpress's `CapPress`. Per query head: the anchor `mu` is the mean of the call's pre-RoPE
queries (the first `n_sink` positions left out) rotated by the RoPE rotation averaged over the next
`n_future_positions` positions; each key `k` (the first `n_sink` left out) gets the relevance weight
`w = exp(tau x (cos(mu, k) - max))` (keys and anchor L2-normalized, kvpress's numerical choice); with
`A = I + sum (w + epsilon) v v^T` over those keys, a token scores `w x v^T A^-1 v` (the value as the output-direction
proxy), averaged over the KV group; the first `n_sink` positions are always kept (kvpress: scored above the rest).

Departures: the queries are the call's own (kvpress projects the prompt's hidden states through `W_q`), un-rotated
with the layer's RoPE frequencies, and the sums run over the call's candidates (cached entries and new tokens): with
chunked prefill or decode each call has its own anchor and matrix (kvpress compresses once, after the prompt); the
matrix is solved in the kernel's accumulation dtype (kvpress: float32). Needs the model's RoPE frequencies
(`needs_rope`, as `expected_attention`: default, llama3, YaRN, linear; partial rotary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_int
from .base import Rule, Signals, rope_cos_sin, rotate_half, unrotate
from .registry import register


def future_rotation(s: Signals, n_future: int, d: int, dtype: torch.dtype) -> Tensor:
    """The RoPE rotation averaged over positions `step .. step + n_future - 1`, `[b, 1, d, d]` (unrotated dims: I)."""
    future = s.step.view(-1, 1) + torch.arange(n_future, device=s.pos.device)
    c, sn = (t.mean(1) for t in rope_cos_sin(future.to(dtype).unsqueeze(-1) * s.inv_freq.to(dtype), d))
    eye = torch.eye(d, device=s.pos.device, dtype=dtype)
    return (c.unsqueeze(-1) * eye + sn.unsqueeze(-1) * rotate_half(eye, 2 * s.inv_freq.shape[-1]).T).unsqueeze(1)


@register("capkv")
@dataclass
class CAPKV(Rule):
    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int = 4
    epsilon: float = 1e-6
    needs_rope: ClassVar[bool] = True

    def __post_init__(self):
        for name in ("tau", "epsilon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ValueError(f"capkv {name} must be a number >= 0, got {v!r}")
        check_int("capkv n_future_positions", self.n_future_positions)
        check_int("capkv n_sink", self.n_sink, 0)

    def score(self, s: Signals) -> Tensor:
        dt = s.dtype
        b, h, gn, d = s.queries.shape
        n = s.new_pos.shape[-1]
        g = gn // n
        q = unrotate(s.queries.to(dt).view(b, h, g, n, d), s.new_pos.view(b, 1, 1, n), s.inv_freq)
        use = (s.new_pos >= self.n_sink).to(dt)  # pads (-1) and sinks left out
        use = torch.where(use.sum(-1, keepdim=True) > 0, use, (s.new_pos >= 0).to(dt))  # only sinks: use them
        mu = (q * use.view(b, 1, 1, n, 1)).sum(3) / use.sum(-1).clamp(min=1).view(b, 1, 1, 1)  # [b, h, g, d]
        anchor = F.normalize(mu @ future_rotation(s, self.n_future_positions, d, dt).transpose(-1, -2), dim=-1)
        keys = F.normalize(s.keys.to(dt), dim=-1)
        stat = torch.einsum("bhgd,bhcd->bhgc", anchor, keys).clamp(-1.0, 1.0)
        scored = ((s.pos >= 0) & (s.pos >= self.n_sink)).unsqueeze(2)  # [b, h, 1, C]
        logits = torch.where(scored, self.tau * stat, float("-inf"))
        w = (logits - logits.amax(-1, keepdim=True).clamp(min=-1e30)).exp()  # 0 where not scored
        v = torch.where(scored.squeeze(2).unsqueeze(-1), s.values.to(dt), 0.0)  # [b, h, C, d]
        cap = torch.einsum("bhgc,bhcd,bhce->bhgde", torch.where(scored, w + self.epsilon, 0.0), v, v)
        cap = cap + torch.eye(d, dtype=dt, device=cap.device)
        sol = torch.linalg.solve(cap, v.transpose(-1, -2).unsqueeze(2).expand(b, h, g, d, v.shape[2]))
        leverage = (v.transpose(-1, -2).unsqueeze(2) * sol).sum(dim=-2)  # [b, h, g, C]
        return (w * leverage).mean(dim=2)

    def protect(self, s: Signals) -> Tensor:
        return (s.pos >= 0) & (s.pos < self.n_sink)

    def protected_per_head(self, budget: int) -> int:
        return self.n_sink  # the sinks
