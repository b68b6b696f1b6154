"""`criticalkv`: kvpress's snapkv score, half the budget by it, the rest by it rescaled by the W_o-projected value norm.

Feng et al., "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective" (CriticalKV), 2025
(arXiv:2502.03805), as kvpress's `CriticalKVPress(SnapKVPress())`. Stage 1: the `int(first_stage_ratio x budget)`
candidates with the highest base score are kept first (kvpress: scored `finfo.max`). Stage 2: every other candidate
scores `(base + epsilon) x ||W_o v||`, the value under the layer's output projection, averaged over the KV group's
query heads. The base score is kvpress's snapkv (`chunkkv.kvpress_snapkv`: the mean attention from the last `window`
queries, average-pooled over `kernel` positions of the context before the window; the window's tokens score the
layer's highest + 1, so they lead stage 1). Needs the model's output projections (`needs_wo`).

Departures: the weight is the kernel's `wov_norm`, `||W_o v||_2` (kvpress and the paper: `||W_o v||_1`, which needs all
of W_o on every call; the kernel holds W_o's per-head R factors, exact for the L2 norm: `defensivekv` and
`fxbudget.kernel.signals` say why); the base score is snapkv's only (kvpress wraps any ScorerPress; another base here
would be a wrapper prefix, one more matrix form per rule); ties in stage 1 go to the older position (stable sort;
kvpress: `torch.topk`'s order). `adakv:criticalkv` composes as AdaKV over these scores: each head's stage 1 is
`first_stage_ratio` of the uniform budget and the safeguard/global top-k then spread the rest; kvpress's
`CriticalAdaKVPress` instead fixes the head budgets from the base scores first and runs both stages inside each
head's own budget. With chunked prefill every call is scored by its own window (as `snapkv`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..checks import check_int
from .base import Rule, Signals
from .chunkkv import kvpress_snapkv
from .registry import register


def top_by(score: Tensor, valid: Tensor, k: int) -> Tensor:
    """Mask of each row's `k` highest-scoring valid candidates (`[b, h, C]`), ties to the older slot order: a stable
    descending sort, the same in eager and compiled runs (`k` a Python int, fixed at compile time)."""
    if k <= 0:
        return torch.zeros_like(valid)
    ranked = torch.argsort(torch.where(valid, score, float("-inf")), dim=-1, descending=True, stable=True)
    first = torch.zeros_like(valid).scatter(-1, ranked[..., :min(k, ranked.shape[-1])], True)
    return first & valid


@register("criticalkv")
@dataclass
class CriticalKV(Rule):
    needs_wo: ClassVar[bool] = True
    window: int = 64
    kernel: int = 5
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __post_init__(self):
        check_int("criticalkv window", self.window)
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"criticalkv kernel must be a positive odd int, got {self.kernel!r}")
        for name, low in (("epsilon", 0.0), ("first_stage_ratio", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < low \
                    or (name == "first_stage_ratio" and v > 1):
                bound = "in [0, 1]" if name == "first_stage_ratio" else ">= 0"
                raise ValueError(f"criticalkv {name} must be a number {bound}, got {v!r}")

    def score(self, s: Signals) -> Tensor:
        valid = s.pos >= 0
        base = kvpress_snapkv(s, self.kernel)
        first = top_by(base, valid, int(self.first_stage_ratio * s.budget))
        wov = torch.where(valid, s.wov_norm, 0.0)
        second = (base + self.epsilon) * wov
        return torch.where(first, torch.finfo(second.dtype).max, second)
