"""`tova`: keep the tokens the last query attends to most.

Oren et al., "Transformers are Multi-State RNNs" (TOVA), 2024 (arXiv:2401.06104). score = attention from the last
query of the call, averaged over the query heads of the KV group (ranking by the sum is the same). With
`share_heads=True` the score is also averaged over the KV heads of the layer, so every head keeps the same positions,
as in the paper (heads start from the same empty layout and take identical decisions, so their slots stay aligned).
Eviction happens on every call that overflows the budget (per step in decode).
"""

from dataclasses import dataclass

from torch import Tensor

from . import register
from .base import Rule, Signals


@register("tova")
@dataclass
class TOVA(Rule):
    share_heads: bool = False

    def score(self, s: Signals) -> Tensor:
        if self.share_heads:
            return s.last_attn.mean(dim=1, keepdim=True).expand_as(s.last_attn)
        return s.last_attn
