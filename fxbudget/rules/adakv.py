"""`AdaKV`: any rule's scores with the budget spread over the KV heads of a layer (head-adaptive allocation).

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference", 2024
(arXiv:2407.11550), as kvpress's `AdaKVPress` implements it: each head first keeps its top `int(alpha x B)`
candidates (the safeguard, `alpha_safeguard` = 0.2), then the rest of the layer's `kv_heads x B` entries go by one
top-k over the scores of all the layer's heads. The wrapped rule's score is used unchanged (kvpress does not
renormalize scores across heads either). The layer's total comes from the wrapped rule's schedule (`pyramidkv`),
its spread over heads from AdaKV. It needs the head-pooled cache layout (`BudgetCache(head_pool=True)`, chosen by
`fxbudget.compile` for a head-adaptive rule): the kernel's allocation step reads `floor` (docs/DESIGN.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from .base import Rule
from .registry import register_wrapper
from .snapkv import SnapKV
from .wrapper import Wrapper

PREFIX = "adakv:"


@dataclass
class AdaKV(Wrapper):
    """Any rule's scores, the layer's budget spread over its KV heads (safeguard `alpha`, then a global top-k)."""

    rule: Rule = field(default_factory=SnapKV)
    alpha: float = 0.2
    head_adaptive: ClassVar[bool] = True

    def __post_init__(self):
        self._check_wrapped()
        self.name = PREFIX + (self.rule.name or type(self.rule).__name__)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or math.isnan(self.alpha) \
                or not 0 <= self.alpha <= 1:
            raise ValueError(f"rule {self.name!r}: alpha must be a number in [0, 1], got {self.alpha!r}")
        if self.rule.never_evicts:
            raise ValueError(f"rule {self.name!r}: {self.rule.name!r} never evicts, so there is no budget to "
                             "allocate over heads")
        if self.rule.head_adaptive:
            raise ValueError(f"rule {self.name!r}: the wrapped rule is already head-adaptive")

    def head_floor(self, budget: int) -> int:
        """Entries each head keeps whatever the other heads score: `int(alpha * budget)` (kvpress's `n_safe`)."""
        return int(self.alpha * budget)

    def check_budget(self, budgets: list[int]) -> None:
        """Refuse layer budgets below the tokens the wrapped rule protects in every head (the global top-k would
        then have to drop protected tokens, tied at +inf, of some heads); then the wrapped rule's own check.

        Raises:
            ValueError: naming the rule and the budget.
        """
        for b in budgets:
            need = self.rule.protected_per_head(b)
            if b < need:
                raise ValueError(f"rule {self.name!r}: budget {b} is below the {need} tokens {self.rule.name!r} "
                                 "protects in every head (its window/sinks); raise the budget or shrink the window")
        self.rule.check_budget(budgets)

    def params(self) -> dict:
        return {"alpha": self.alpha, **self.rule.params()}


register_wrapper(PREFIX, AdaKV, ("alpha",))
