"""`lagkv`: each partition's keys and values scored against the min/max of the next partition (lag-relative).

Liang et al., "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important", 2025
(arXiv:2504.04704), as kvpress's `LagKVPress`. After the first `n_sink` positions, positions are cut into partitions
of `lag_size`. With `L` positions seen: below `n_sink + 2 lag_size` nothing is scored (sinks 1.0, the rest by recency,
`(p - n_sink) / (L - n_sink)`); otherwise the sinks, the last complete partition and the incomplete one after it
score 1.0, and each earlier partition is scored token by token: its keys (and values) min-max normalized per channel
by the next partition's, the std over channels, softmax over the partition; key and value scores averaged, then
(unless `cross_scoring`) replaced by the token's rank within its partition over `lag_size`, so every partition keeps
about as many tokens. Departures: partitions are by position over the call's candidates (cached entries and new
tokens); with chunked prefill a partition holds what is still cached, and its reference is the next partition that
has a candidate; ties (equal ranks across partitions) go to the newer position (kvpress: `torch.topk`'s order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals
from .segments import Segments


@register("lagkv")
@dataclass
class LagKV(Rule):
    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    def __post_init__(self):
        check_int("lagkv n_sink", self.n_sink, 0)
        check_int("lagkv lag_size", self.lag_size)
        if not isinstance(self.cross_scoring, bool):
            raise ValueError(f"lagkv cross_scoring must be a bool, got {self.cross_scoring!r}")

    def score(self, s: Signals) -> Tensor:
        dt = s.dtype
        valid = s.pos >= 0
        seen = s.step  # [b, 1, 1]
        scored = valid & (s.pos >= self.n_sink)
        seg = Segments(s, torch.where(scored, (s.pos - self.n_sink) // self.lag_size, -1))

        def states(x: Tensor) -> Tensor:  # [b, h, C, d] candidates -> softmaxed lag-relative std, sequence order
            x = s.in_sequence_order_rows(x.to(dt))
            lo, hi = (seg.spread(seg.next(seg.reduce(x, op))) for op in ("amin", "amax"))
            return seg.softmax(((x - lo) / (hi - lo)).std(dim=-1))

        score = (states(s.keys) + states(s.values)) / 2
        if not self.cross_scoring:
            score = seg.rank(score).to(dt) / self.lag_size
        score = s.from_sequence_order(score)
        end = self.n_sink + (seen - self.n_sink) // self.lag_size * self.lag_size
        keep = ~scored | (s.pos >= end - self.lag_size)
        score = score.masked_fill(keep, 1.0)
        # Too short to partition: sinks 1.0, the rest by recency (kvpress keeps the sliding part).
        short = (s.pos - self.n_sink).to(dt) / (seen - self.n_sink).clamp(min=1).to(dt)
        short = short.masked_fill(~scored, 1.0)
        return torch.where(seen < self.n_sink + 2 * self.lag_size, short, score)
