"""`Wrapper`: a rule that changes how another rule's scores are spent (over heads: `AdaKV`; over layers:
`Pyramid`) and is that rule in every other respect.

Every capability the wrapper does not change is the wrapped rule's, read through, never copied: a flag added to
`Rule` later reaches every wrapper without touching it (a copied flag list once missed `replay_only`).
"""

from __future__ import annotations

from torch import Tensor

from .base import Rule, Signals


class Wrapper(Rule):
    """Base of rule wrappers: subclasses are dataclasses with a `rule: Rule` field (the wrapped rule)."""

    rule: Rule

    def __getattr__(self, name: str):
        """Anything else the wrapped rule has (its hyperparameters: kvzip's `chunk_size`, read by its protocol), so
        code that reads a rule's field sees the same value through the wrapper."""
        if name.startswith("__") or name == "rule":  # copying and pickling probe dunders; `rule` not set yet
            raise AttributeError(name)
        return getattr(self.rule, name)

    def _check_wrapped(self) -> None:
        if not isinstance(self.rule, Rule):
            raise TypeError(f"{type(self).__name__} wraps a fxbudget.rules.Rule, got {type(self.rule).__name__}")

    # Capabilities: the wrapped rule's (properties shadow `Rule`'s class-level defaults).
    window = property(lambda self: self.rule.window)
    never_evicts = property(lambda self: self.rule.never_evicts)
    needs_rope = property(lambda self: self.rule.needs_rope)
    needs_wo = property(lambda self: self.rule.needs_wo)
    head_adaptive = property(lambda self: self.rule.head_adaptive)
    replay_only = property(lambda self: self.rule.replay_only)

    def protected_per_head(self, budget: int) -> int:
        return self.rule.protected_per_head(budget)

    def head_floor(self, budget: int) -> int:
        return self.rule.head_floor(budget)

    def check_budget(self, budgets: list[int]) -> None:
        self.rule.check_budget(budgets)

    def layer_budgets(self, budget: int, n_layers: int, prompt: int | None = None) -> list[int] | None:
        return self.rule.layer_budgets(budget, n_layers, prompt=prompt)

    def score(self, s: Signals) -> Tensor:
        return self.rule.score(s)

    def protect(self, s: Signals) -> Tensor | None:
        return self.rule.protect(s)
