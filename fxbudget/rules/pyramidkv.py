"""`pyramidkv`: snapkv scores with per-layer budgets falling linearly with depth; `Pyramid` wraps any rule.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024
(arXiv:2406.02069). With `B` the uniform budget and `w` the observation window, the lowest layer keeps
`w + 2(B - w) - (B - w) // beta` and the highest `w + (B - w) // beta`, linearly in between (the reference code's
schedule); rounding is spread over the lowest layers so the budgets sum to exactly `num_layers × B`: the same memory
as the uniform budget. Departure: the reference code also shrinks the schedule when the prompt is shorter than the
largest budget; here budgets are fixed per model, since the cache is allocated before the prompt is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from . import register
from .base import Rule, Signals
from .snapkv import SnapKV


def pyramid_budgets(budget: int, n_layers: int, beta: int, window: int) -> list[int]:
    """Per-layer budgets, highest first at layer 0, summing to exactly `n_layers * budget`."""
    base = budget - window
    if base < 1 or beta < 1:
        raise ValueError(f"pyramid budgets need budget > window ({budget} <= {window}) and beta >= 1 (got {beta})")
    if n_layers == 1:
        return [budget]
    low = base // beta
    high = 2 * base - low
    step = (high - low) // (n_layers - 1)
    budgets = [window + high - i * step for i in range(n_layers)]
    # Integer steps leave the sum off by less than a step per layer: spread the difference from the lowest layer up.
    short = n_layers * budget - sum(budgets)
    for i in range(abs(short)):
        budgets[i % n_layers] += 1 if short > 0 else -1
    if min(budgets) < 1:
        raise ValueError(f"budget {budget} is too small for a pyramid over {n_layers} layers")
    return budgets


@dataclass
class Pyramid(Rule):
    """Any rule with PyramidKV's per-layer budget schedule (`beta` sets how steeply budgets fall)."""

    rule: Rule = field(default_factory=SnapKV)
    beta: int = 20

    def __post_init__(self):
        self.name = f"pyramid({self.rule.name})"
        self.window = getattr(self.rule, "window", None)

    def score(self, s: Signals) -> Tensor:
        return self.rule.score(s)

    def protect(self, s: Signals) -> Tensor | None:
        return self.rule.protect(s)

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        return pyramid_budgets(budget, n_layers, self.beta, self.window or 0)


@register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    beta: int = 20

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        return pyramid_budgets(budget, n_layers, self.beta, self.window)
