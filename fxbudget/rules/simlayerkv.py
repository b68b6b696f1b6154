"""`simlayerkv`: a "lazy" layer keeps its first and most recent tokens; any other layer, kvpress's snapkv choice.

Zhang et al., "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction", 2024 (arXiv:2410.13846), as kvpress's
`SimLayerKVPress`. A layer is lazy in a call when its last query, averaged over all the layer's query heads, pays
more than `lazy_threshold` of its attention to the first `n_initial` positions and the `n_recent` positions before
it; a lazy layer keeps the first `n_initial` positions (protected) and the most recent ones.

Departures: every layer holds the same `budget` (the fairness contract: every rule the same memory), so a lazy layer
keeps `n_initial` + the `budget - n_initial` most recent positions (kvpress: `n_initial + n_recent - 1`; the default
`n_recent=None` is `budget - n_initial + 1`, which makes the two equal), and a layer that is not lazy, which kvpress
keeps whole (more memory than the budget), ranks by kvpress's snapkv score (`chunkkv.kvpress_snapkv`, `window`,
`kernel`); kvpress's saving is a lazy layer's smaller cache, which a fixed budget turns into a different choice
instead. Laziness is decided per call and per batch row (kvpress: once, at the prefill, over the batch); with chunked
prefill each chunk decides anew. `n_last` is 1 (kvpress's default: the last query only, the kernel's `last_attn`).
kvpress's default `lazy_threshold=1.0` makes no layer lazy (this rule would then be snapkv's kvpress form): the
default here is 0.9, kvpress's recommendation for Llama 3 (Qwen: 0.85, Mistral: 0.8, Llama 2: 0.65).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import check_int
from .base import Rule, Signals
from .chunkkv import kvpress_snapkv
from .registry import register


@register("simlayerkv")
@dataclass
class SimLayerKV(Rule):
    lazy_threshold: float = 0.9
    n_initial: int = 4
    n_recent: int | None = None
    window: int = 64
    kernel: int = 5

    def __post_init__(self):
        t = self.lazy_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or not 0 <= t <= 1:
            raise ValueError(f"simlayerkv lazy_threshold must be a number in [0, 1], got {t!r}")
        check_int("simlayerkv n_initial", self.n_initial, 0)
        if self.n_recent is not None:
            check_int("simlayerkv n_recent", self.n_recent)
        check_int("simlayerkv window", self.window)
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"simlayerkv kernel must be a positive odd int, got {self.kernel!r}")

    def check_budget(self, budgets: list[int]) -> None:
        """A lazy layer's sinks must fit: refuse a layer budget not above `n_initial`."""
        for b in budgets:
            if b <= self.n_initial:
                raise ValueError(f"rule 'simlayerkv': budget {b} does not exceed n_initial={self.n_initial} "
                                 "(a lazy layer keeps its first n_initial tokens and recent ones)")

    def lazy(self, s: Signals) -> Tensor:
        """Per batch row `[b, 1, 1]`: the last query's attention (mean over the layer's query heads) on the first
        `n_initial` positions and the `n_recent` before it exceeds `lazy_threshold`."""
        n_recent = self.n_recent if self.n_recent is not None else s.budget - self.n_initial + 1
        g = s.queries.shape[2] // s.new_pos.shape[-1]
        last = s.step - 1
        held = (s.pos >= 0) & ((s.pos < self.n_initial) | ((s.pos >= last - n_recent) & (s.pos < last)))
        mass = torch.where(held, s.last_attn, 0.0).sum(dim=-1, keepdim=True) / g  # [b, h, 1]
        return mass.mean(dim=1, keepdim=True) > self.lazy_threshold

    def score(self, s: Signals) -> Tensor:
        return torch.where(self.lazy(s), s.pos.to(s.dtype), kvpress_snapkv(s, self.kernel))

    def protect(self, s: Signals) -> Tensor:
        return self.lazy(s) & (s.pos >= 0) & (s.pos < self.n_initial)

    def protected_per_head(self, budget: int) -> int:
        return self.n_initial  # a lazy layer's first tokens
