"""`window`: keep the most recent tokens only (a sliding window).

score = position. Also the rule of sliding-window layers, whose cache is bounded by the model, not by the budget.
"""

from dataclasses import dataclass

from torch import Tensor

from .registry import register
from .base import Rule, Signals


@register("window")
@dataclass
class Window(Rule):
    def score(self, s: Signals) -> Tensor:
        return s.pos.float()
