"""`cur`: approximate leverage of the keys times that of the values (CurDKV).

Sengupta et al., "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition" (CurDKV), 2025
(arXiv:2509.15038), as kvpress's `CURPress`: per candidate `k2 = |k|^2`, `v2 = |v|^2` (post-RoPE keys: RoPE keeps
the norm); with `use_local_approximation`, each divided by its sum over a local window of `local_window_size`
positions (windows `[0, w)`, `[w, 2w)`, ... as kvpress's padded reshape of the prompt); the score is `k2`, `v2`,
`(k2 + v2) / 2` or `k2 * v2` (`leverage_type`), normalized to sum 1 per head; the first `num_sinks` positions score
1.0. Departures: `use_random_leverage` projects keys and values on a fixed pseudo-random Gaussian sketch (20
columns, from a hash of `seed` and the indices, the same in every layer and call) where kvpress draws a new unseeded
`torch.randn` sketch per call; with chunked prefill the windows hold the candidates still cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals
from .random import gaussian_sketch
from .segments import Segments

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")


@register("cur")
@dataclass
class CUR(Rule):
    num_sinks: int = 4
    leverage_type: str = "kv_product"
    use_random_leverage: bool = False
    use_local_approximation: bool = True
    local_window_size: int = 16
    seed: int = 0

    def __post_init__(self):
        check_int("cur num_sinks", self.num_sinks, 0)
        check_int("cur local_window_size", self.local_window_size)
        check_int("cur seed", self.seed, 0)
        if self.leverage_type not in LEVERAGE_TYPES:
            raise ValueError(f"cur leverage_type must be one of {', '.join(LEVERAGE_TYPES)}, "
                             f"got {self.leverage_type!r}")
        for name in ("use_random_leverage", "use_local_approximation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"cur {name} must be a bool, got {getattr(self, name)!r}")

    def score(self, s: Signals) -> Tensor:
        dt = s.dtype
        if self.use_random_leverage:
            g = gaussian_sketch(s.k_slots.shape[-1], 20, self.seed, s.pos.device, dt) / math.sqrt(20)
            k2 = (s.keys.to(dt) @ g).square().sum(-1)
            v2 = (s.values.to(dt) @ g).square().sum(-1)
        else:
            k2, v2 = s.key_norm.square(), s.value_norm.square()
        valid = s.pos >= 0
        k2, v2 = (torch.where(valid, x, 0.0) for x in (k2, v2))
        if self.use_local_approximation:
            seg = Segments(s, torch.where(valid, s.pos // self.local_window_size, -1))
            k2, v2 = (s.from_sequence_order(x / seg.spread(seg.sum(x)))
                      for x in (s.in_sequence_order(k2), s.in_sequence_order(v2)))
        score = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[self.leverage_type]
        score = torch.where(valid, score, 0.0)
        score = score / score.sum(-1, keepdim=True)
        return score.masked_fill(valid & (s.pos < self.num_sinks), 1.0)
