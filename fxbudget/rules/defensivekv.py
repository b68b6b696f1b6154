"""`defensivekv`: the max of pooled window attention, clamped below by its mean, times the W_o-projected value norm.

Feng et al., "Taming the Fragility of KV Cache Eviction in LLM Inference" (DefensiveKV), ICLR 2026 (arXiv:2510.13334),
as its code (github.com/FFY0/DefensiveKV, `EfficientDefensiveKVPress`, window 32, kernel 5): over the context before the
observation window, each candidate's attention from the window is average-pooled over `kernel` positions (zero padded),
its max over the window's queries and the KV group's query heads is clamped below by its mean over the context (the
"defensive" aggregation), and multiplied by `||W_o v||_1` (CriticalKV's weight: the value under the layer's output
projection, averaged over the group's query heads; here the L2 norm, see below) divided by that norm's sum over the
layer's KV heads for the same position. First stage (CriticalKV's): the context tokens with the highest mean window
attention are kept first, as many as reach `threshold` minus the window's attention on its own tokens (at most `budget -
window`); the window is always kept.

Departures: the reference pools each window query's row before the max and rescales each row to its unpooled mass;
the kernel measures the max over the window's queries and the group (`window_max_attn`, for every rule) and this rule
pools that max (max and pooling do not commute; they agree where one query dominates a neighbourhood). The weight
is the kernel's `wov_norm`, `||W_o v||_2` (exact from W_o's per-head R factors, which the kernel holds instead of
W_o: an L1 norm needs all of W_o on every call, 1.6-1.8x the kernel's decode time). The reference
selects over all KV heads of a layer at once (AdaKV's head budgets): `adakv:defensivekv`; plain `defensivekv` keeps
`budget` entries per KV head. The
window's attention on its own tokens is averaged over the KV heads of each batch row (reference: also over the
batch). Slots are unordered per head: the sum over KV heads of a position's W_o-v norm counts the heads that still
hold it (all of them in a one-call prefill, the paper's setting). Needs the model's output projections (`needs_wo`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals, recent
from .segments import head_sum_by_position


@register("defensivekv")
@dataclass
class DefensiveKV(Rule):
    needs_wo: ClassVar[bool] = True
    window: int = 32
    kernel: int = 5
    threshold: float = 0.9

    def __post_init__(self):
        check_int("defensivekv window", self.window)
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"defensivekv kernel must be a positive odd int, got {self.kernel!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0 < self.threshold <= 1:
            raise ValueError(f"defensivekv threshold must be a number in (0, 1], got {self.threshold!r}")

    def score(self, s: Signals) -> Tensor:
        in_window = s.pos >= s.step - s.window
        ctx = (s.pos >= 0) & ~in_window
        b, h, c = s.pos.shape
        x = torch.where(ctx, s.window_max_attn, 0.0)
        pooled = F.avg_pool1d(s.in_sequence_order(x).reshape(b * h, 1, c), self.kernel, stride=1,
                              padding=self.kernel // 2)
        pooled = s.from_sequence_order(pooled.view(b, h, c))
        n_ctx = ctx.sum(dim=-1, keepdim=True).clamp(min=1)
        mean = torch.where(ctx, pooled, 0.0).sum(dim=-1, keepdim=True) / n_ctx
        defended = torch.maximum(pooled, mean)
        wov = torch.where(s.pos >= 0, s.wov_norm, 0.0)
        score = defended * wov / head_sum_by_position(s.pos, wov).clamp(min=torch.finfo(wov.dtype).tiny)
        return torch.where(self._first_stage(s, ctx, in_window), float("inf"), score)

    def _first_stage(self, s: Signals, ctx: Tensor, in_window: Tensor) -> Tensor:
        """CriticalKV's first stage: the context tokens with the highest mean window attention, as many as reach
        `threshold` minus the window's attention on its own tokens (at most `budget - window`)."""
        g = s.queries.shape[2] // s.new_pos.shape[-1]
        share = s.window * g  # the window's queries x the group: each distributes a mass of 1
        own = torch.where(in_window, s.window_attn, 0.0).sum(dim=-1, keepdim=True) / share  # [b, h, 1]
        bias = own.mean(dim=1, keepdim=True)
        ave = torch.where(ctx, s.window_attn, 0.0)
        norm = ave / ave.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(ave.dtype).tiny)
        ranked, order = torch.sort(norm, dim=-1, descending=True, stable=True)
        reached = ranked.cumsum(dim=-1) >= self.threshold - bias
        count = reached.to(torch.int32).argmax(dim=-1, keepdim=True)  # the first rank that reaches it (0: none)
        count = torch.minimum(count, (s.budget - s.window).clamp(min=0))
        rank = torch.empty_like(order).scatter(-1, order, torch.arange(order.shape[-1], device=order.device)
                                               .expand_as(order))
        return ctx & (rank < count)

    def protect(self, s: Signals) -> Tensor:
        return recent(s, s.window)

    def protected_per_head(self, budget: int) -> int:
        return self.window  # the observation window
