"""`h2o`: heavy hitters by accumulated attention, plus a recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023
(arXiv:2306.14048). score = attention mass accumulated over every query so far (summed over the query heads of the
KV group, where the paper scores per head); the `recent_ratio * budget` most recent tokens are protected.
Eviction happens on every call that overflows the budget (per step in decode).
"""

from dataclasses import dataclass

from torch import Tensor

from .registry import register
from .base import Rule, Signals, recent


@register("h2o")
@dataclass
class H2O(Rule):
    recent_ratio: float = 0.5

    def score(self, s: Signals) -> Tensor:
        return s.acc_attn

    def protect(self, s: Signals) -> Tensor:
        return recent(s, int(s.budget * self.recent_ratio))

    def protected_per_head(self, budget: int) -> int:
        return int(budget * self.recent_ratio)  # the recent share
