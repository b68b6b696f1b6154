"""`ProtectOnly` (`protectonly:<rule>`): a rule's protected set kept, the rest chosen at random, the second half of
the protection decomposition (`noprotect:<rule>` is the first; `fxbudget compare --decompose`).

The score is `random`'s (`fxbudget.rules.random`: a hash of position, KV head and `random_seed`, a pure function of
the signals, so eager and compiled runs keep the same tokens); `protect`, the window, the layer schedule and the
allocation are the wrapped rule's. With the default `random_seed=0` the draw is the `random` rule's own, so
`protectonly:<rule>` minus `random` is the protection alone, on the same draw. A rule that protects nothing, and
`full` (it never evicts), are refused: the wrapper would be `random` under another name; so is a replay-only rule
(`kvzip`), whose score is what keeps the replay's own tokens out of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from ..checks import check_int
from .base import Rule, Signals
from .noprotect import refuse_unprotected
from .random import Random
from .registry import register_wrapper
from .snapkv import SnapKV
from .wrapper import Wrapper

PREFIX = "protectonly:"


@dataclass
class ProtectOnly(Wrapper):
    """The wrapped rule's protected tokens, the rest ranked by a seeded random score."""

    rule: Rule = field(default_factory=SnapKV)
    random_seed: int = 0

    def __post_init__(self):
        self._check_wrapped()
        refuse_unprotected(PREFIX, self.rule)
        if self.rule.replay_only:  # kvzip: its score (-inf on the replay's own tokens) is what keeps them out
            name = self.rule.name or type(self.rule).__name__
            raise ValueError(f"rule {PREFIX + name!r}: {name!r} keeps its replay tokens out by its score (they score "
                             "-inf in the replay call); a random score would keep them, breaking its protocol")
        self.name = PREFIX + (self.rule.name or type(self.rule).__name__)
        check_int(f"{self.name} random_seed", self.random_seed, 0)
        self._random = Random(seed=self.random_seed)

    def score(self, s: Signals) -> Tensor:
        return self._random.score(s)

    def params(self) -> dict:
        return {"random_seed": self.random_seed, **self.rule.params()}


register_wrapper(PREFIX, ProtectOnly, ("random_seed",))
