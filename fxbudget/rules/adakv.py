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

from torch import Tensor

from .base import Rule, Signals
from .snapkv import SnapKV

PREFIX = "adakv:"


def protected_per_head(rule: Rule, budget: int) -> int:
    """The candidates `rule.protect` marks in a full head, as far as its fields say: a recent window (snapkv and its
    subclasses), `n_sink` sink tokens, `n_recent` recent tokens; h2o's recent share is a fraction of the budget."""
    n = rule.window if isinstance(rule, SnapKV) else 0
    for name in ("n_sink", "n_recent"):
        value = getattr(rule, name, 0)
        n += value if isinstance(value, int) and not isinstance(value, bool) else 0
    ratio = getattr(rule, "recent_ratio", None)
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        n += int(budget * ratio)
    return n


@dataclass
class AdaKV(Rule):
    """Any rule's scores, the layer's budget spread over its KV heads (safeguard `alpha`, then a global top-k)."""

    rule: Rule = field(default_factory=SnapKV)
    alpha: float = 0.2
    head_adaptive: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.rule, Rule):
            raise TypeError(f"AdaKV wraps a fxbudget.rules.Rule, got {type(self.rule).__name__}")
        self.name = PREFIX + (self.rule.name or type(self.rule).__name__)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or math.isnan(self.alpha) \
                or not 0 <= self.alpha <= 1:
            raise ValueError(f"rule {self.name!r}: alpha must be a number in [0, 1], got {self.alpha!r}")
        if self.rule.never_evicts:
            raise ValueError(f"rule {self.name!r}: {self.rule.name!r} never evicts, so there is no budget to "
                             "allocate over heads")
        if getattr(self.rule, "head_adaptive", False):
            raise ValueError(f"rule {self.name!r}: the wrapped rule is already head-adaptive")
        self.window = getattr(self.rule, "window", None)
        self.needs_rope = self.rule.needs_rope
        self.needs_wo = self.rule.needs_wo

    def floor(self, budget: int) -> int:
        """Entries each head keeps whatever the other heads score: `int(alpha * budget)` (kvpress's `n_safe`)."""
        return int(self.alpha * budget)

    def check_budget(self, budgets: list[int]) -> None:
        """Refuse layer budgets below the tokens the wrapped rule protects in every head (the global top-k would
        then have to drop protected tokens, tied at +inf, of some heads).

        Raises:
            ValueError: naming the rule and the budget.
        """
        for b in budgets:
            need = protected_per_head(self.rule, b)
            if b < need:
                raise ValueError(f"rule {self.name!r}: budget {b} is below the {need} tokens {self.rule.name!r} "
                                 "protects in every head (its window/sinks); raise the budget or shrink the window")

    def score(self, s: Signals) -> Tensor:
        return self.rule.score(s)

    def protect(self, s: Signals) -> Tensor | None:
        return self.rule.protect(s)

    def layer_budgets(self, budget: int, n_layers: int, prompt: int | None = None) -> list[int] | None:
        return self.rule.layer_budgets(budget, n_layers, prompt=prompt)

    def params(self) -> dict:
        return {"alpha": self.alpha, **self.rule.params()}


def allocation_floor(rule: Rule, budget: int) -> int:
    """The per-head floor of the pooled layout's allocation step: `rule.floor(budget)` for a head-adaptive rule, the
    whole `budget` for a uniform one (every head keeps its own top `budget`: uniform allocation, exactly)."""
    return rule.floor(budget) if getattr(rule, "head_adaptive", False) else budget
