"""`tova`: keep the tokens the last query attends to most.

Oren et al., "Transformers are Multi-State RNNs" (TOVA), 2024 (arXiv:2401.06104). score = attention from the last
query of the call, averaged over the query heads of the KV group (ranking by the sum is the same). With
`share_heads=True` the score is also averaged over the KV heads of the layer, so every head keeps the same positions,
as in the paper (summed by position, not by slot, so the head-pooled layout keeps the same sets).
Eviction happens on every call that overflows the budget (per step in decode).
"""

from dataclasses import dataclass

from torch import Tensor

from .registry import register
from .base import Rule, Signals
from .segments import head_sum_by_position


@register("tova")
@dataclass
class TOVA(Rule):
    share_heads: bool = False

    def score(self, s: Signals) -> Tensor:
        if self.share_heads:  # matched by position, not slot: right on the head-pooled layout too
            return head_sum_by_position(s.pos, s.last_attn) / s.pos.shape[1]
        return s.last_attn
