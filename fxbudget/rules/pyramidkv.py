"""`pyramidkv`: snapkv scores with per-layer budgets falling linearly with depth; `Pyramid` wraps any rule.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024
(arXiv:2406.02069). With `B` the uniform budget and `w` the observation window, the lowest layer keeps
`w + 2(B - w) - (B - w) // beta` and the highest `w + (B - w) // beta`, linearly in between (the reference code's
schedule); rounding is spread over the lowest layers so the budgets sum to exactly `num_layers × B`: the same memory
as the uniform budget.

The schedule follows the prompt length `n` when it is known as the cache is sized, as the reference code
(KVCache-Factory's `PyramidKVCluster`) does: a prompt shorter than `max(B, 2(B - w))` gets the uniform budget `B`
in every layer (so a prompt within the budget is kept whole, and a budget covering the sequence reproduces the
unmodified model), and the lowest layer gets no more than the prompt, `n` (up to rounding), the highest layer taking
what it gives up. The length is known for the cache the compiled forward creates on a call without one (that call's
length) and in `compare` (the prefill); `model.forward.new_cache(prompt=n)` asks for it. Departure: a cache built
without a length (`new_cache()`, or an explicit `BudgetCache(..., layer_budgets=...)`) keeps the fixed schedule
above whatever prompt it then sees, since its slots are allocated before the prompt arrives; with a short prompt
its lower-budget layers may then evict where the reference code would not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from .registry import register
from .base import Rule
from .snapkv import SnapKV
from .wrapper import Wrapper


def pyramid_budgets(budget: int, n_layers: int, beta: int, window: int, prompt: int | None = None) -> list[int]:
    """Per-layer budgets, highest first at layer 0, summing to exactly `n_layers * budget`.

    Args:
        budget: the uniform budget `B`; window: the observation window `w` every layer keeps; beta: the slope
            (the highest layer keeps `w + (B - w) // beta`).
        prompt: the prefill length when known: the schedule then adapts to it (module docstring); None = fixed.
    Returns:
        `n_layers` budgets.
    """
    base = budget - window
    if base < 1 or beta < 1:
        raise ValueError(f"pyramid budgets need budget > window ({budget} <= {window}) and beta >= 1 (got {beta})")
    if n_layers == 1 or (prompt is not None and prompt < max(budget, 2 * base)):
        return [budget] * n_layers
    low = base // beta
    high = 2 * base - low
    if prompt is not None and window + high > prompt:  # the lowest layer needs no more than the whole prompt
        high = prompt - window
        low = 2 * base - high
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
class Pyramid(Wrapper):
    """Any rule with PyramidKV's per-layer budget schedule (`beta` sets how steeply budgets fall)."""

    rule: Rule = field(default_factory=SnapKV)
    beta: int = 20

    def __post_init__(self):
        self._check_wrapped()
        self.name = f"pyramid({self.rule.name})"

    def layer_budgets(self, budget: int, n_layers: int, prompt: int | None = None) -> list[int]:
        try:
            return pyramid_budgets(budget, n_layers, self.beta, self.window or 0, prompt)
        except ValueError as e:
            raise ValueError(f"rule {self.name!r}: {e}") from None


@register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    beta: int = 20

    def layer_budgets(self, budget: int, n_layers: int, prompt: int | None = None) -> list[int]:
        return pyramid_budgets(budget, n_layers, self.beta, self.window, prompt)
