"""`full`: keep everything (the reference row of a comparison).

Evicting nothing needs a budget of at least the sequence: `fxbudget` raises before a call that would overflow it,
instead of silently evicting. score = position (never used).
"""

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from .registry import register
from .base import Rule, Signals


@register("full")
@dataclass
class Full(Rule):
    never_evicts: ClassVar[bool] = True

    def score(self, s: Signals) -> Tensor:
        return s.pos.float()
