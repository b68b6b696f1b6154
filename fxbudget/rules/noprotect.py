"""`NoProtect` (`noprotect:<rule>`): a rule's score alone, nothing force-kept, the first half of the protection
decomposition (`protectonly:<rule>` is the other half; `fxbudget compare --decompose`).

Most rules force-keep tokens (sinks, a recent or observation window: `protect`) and score only the rest, so a rule's
gain over `random` mixes what its score finds with what its protection keeps ("Protection Is (Nearly) All You Need",
arXiv:2605.18053, finds the protection carries most of it at small budgets). `noprotect:<rule>` keeps the rule's
`score` and everything else (window, schedule, allocation) and drops its `protect`: every candidate competes on the
score. A rule that protects nothing is refused: the wrapper would change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from .base import Rule, Signals
from .registry import register_wrapper
from .snapkv import SnapKV
from .wrapper import Wrapper

PREFIX = "noprotect:"
_LARGE_BUDGET = 1 << 20  # a budget no protected set is cut by (`protected_per_head` of a rule that scales with it)


def protects_tokens(rule: Rule) -> bool:
    """Whether `rule` force-keeps any token: its `protect` (read through wrappers that delegate it) is its own and
    marks a non-empty set (`protected_per_head` above 0 where the rule declares it; h2o with `recent_ratio=0`,
    weighted without sinks or recent window protect nothing)."""
    while isinstance(rule, Wrapper) and type(rule).protect is Wrapper.protect:
        rule = rule.rule
    if isinstance(rule, NoProtect) or type(rule).protect is Rule.protect:
        return False
    if type(rule).protected_per_head is Rule.protected_per_head:  # a protect without its count: assume it marks some
        return True
    return rule.protected_per_head(_LARGE_BUDGET) > 0


def refuse_unprotected(wrapper: str, rule: Rule) -> None:
    """One line for a protection wrapper around a rule that protects nothing (or never evicts).

    Raises:
        ValueError: naming the wrapper form and why it would be meaningless.
    """
    name = rule.name or type(rule).__name__
    if rule.never_evicts:
        raise ValueError(f"rule {wrapper + name!r}: {name!r} never evicts, so it has no protected set to separate "
                         "from a score")
    if not protects_tokens(rule):
        what = "would change nothing" if wrapper == PREFIX else "would be `random` under another name"
        raise ValueError(f"rule {wrapper + name!r}: {name!r} protects no tokens, so {wrapper} {what}; its gain over "
                         "random is all score (decompose a rule that keeps sinks or a window: snapkv, h2o, "
                         "streamingllm, expected_attention)")


@dataclass
class NoProtect(Wrapper):
    """The wrapped rule's score with no protected tokens."""

    rule: Rule = field(default_factory=SnapKV)

    def __post_init__(self):
        self._check_wrapped()
        refuse_unprotected(PREFIX, self.rule)
        self.name = PREFIX + (self.rule.name or type(self.rule).__name__)

    def protect(self, s: Signals) -> Tensor | None:
        return None

    def protected_per_head(self, budget: int) -> int:
        return 0

    def params(self) -> dict:
        return self.rule.params()


register_wrapper(PREFIX, NoProtect, ())
