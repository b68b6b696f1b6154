"""`snapkv`: attention from an observation window of the latest queries, pooled over neighbouring positions.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024 (arXiv:2404.14469).
score = pool_k(sum of attention from the last `window` queries), pooled over positions in sequence order with a
`kernel`-wide max (paper's LongBench setting) or average pool (kvpress: window 64, avgpool 5); the window's own tokens
are always kept. Departures: attention is summed over the query heads of a KV group (the paper repeats K/V per query
head); the window is the last `window` queries of each call, so with chunked prefill every chunk is scored by its own
tail (the paper compresses once, after the whole prompt).
"""

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals, recent


@register("snapkv")
@dataclass
class SnapKV(Rule):
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        check_int(f"{self.name} window", self.window)
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"snapkv kernel must be a positive odd int, got {self.kernel}")

    def score(self, s: Signals) -> Tensor:
        x = s.in_sequence_order(s.window_attn)
        b, h, c = x.shape
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        pooled = pool(x.reshape(b * h, 1, c), self.kernel, stride=1, padding=self.kernel // 2).view(b, h, c)
        return s.from_sequence_order(pooled)

    def protect(self, s: Signals) -> Tensor:
        return recent(s, s.window)

    def protected_per_head(self, budget: int) -> int:
        return self.window  # the observation window
