"""`chunkkv`: snapkv's scores, kept by whole chunks of neighbouring positions.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference", 2025
(arXiv:2502.00299), as kvpress's `ChunkKVPress(SnapKVPress())`: kvpress's snapkv score (the mean attention from the last
`window` queries, average-pooled over `kernel` positions of the context before the window; the window's tokens score the
layer's highest score + 1), summed over the KV heads of the layer and averaged over chunks of `chunk_length` positions
(`[0, c)`, `[c, 2c)`, ...; the last may be shorter): every token scores its chunk's mean, so the best chunks are kept
whole and every KV head keeps the same positions. Departures: the budget is filled exactly (kvpress keeps `int(chunks x
(1 - ratio))` whole chunks, up to a chunk fewer entries; fxbudget's last, partly kept chunk keeps its newest tokens);
the sum over heads matches candidates by position, not by slot (`segments.head_sum_by_position`, as `tova`'s
`share_heads`), so it holds on the head-pooled layout too; the highest score is per batch row (kvpress: over the batch);
with chunked prefill every call is scored by its own window and a chunk holds what is still cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals
from .segments import Segments, head_sum_by_position


def kvpress_snapkv(s: Signals, kernel: int) -> Tensor:
    """kvpress's `SnapKVPress.score` on the kernel's signals: the window's mean attention (over window queries and
    the KV group), average-pooled over the context before the window (zero padded), the window at the max + 1."""
    g = s.queries.shape[2] // s.new_pos.shape[-1]
    in_window = s.pos >= s.step - s.window
    x = torch.where(in_window | (s.pos < 0), 0.0, s.window_attn / (s.window * g))
    b, h, c = x.shape
    x = F.avg_pool1d(s.in_sequence_order(x).reshape(b * h, 1, c), kernel, stride=1, padding=kernel // 2)
    x = s.from_sequence_order(x.view(b, h, c))
    top = torch.where(in_window | (s.pos < 0), float("-inf"), x).amax(dim=(1, 2), keepdim=True)
    return torch.where(in_window, top + 1, x)


@register("chunkkv")
@dataclass
class ChunkKV(Rule):
    window: int = 64
    kernel: int = 5
    chunk_length: int = 20

    def __post_init__(self):
        check_int("chunkkv window", self.window)
        check_int("chunkkv chunk_length", self.chunk_length)
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"chunkkv kernel must be a positive odd int, got {self.kernel!r}")

    def score(self, s: Signals) -> Tensor:
        # Summed over the heads holding each position (matched by position, so the head-pooled layout's heads,
        # whose candidates are the whole pool, add only their own entries), then averaged per chunk in each head.
        total = head_sum_by_position(s.pos, kvpress_snapkv(s, self.kernel))
        seg = Segments(s, torch.where(s.pos >= 0, s.pos // self.chunk_length, -1))
        return s.from_sequence_order(seg.spread(seg.sum(s.in_sequence_order(total)) / seg.count))
