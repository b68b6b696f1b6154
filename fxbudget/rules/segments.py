"""Reductions over runs of candidates that share a segment id (chunks, partitions, local windows of positions).

Slots are unordered, so the rules that work on groups of neighbouring positions (`lagkv`, `cur`, `chunkkv`,
`compactor`) sort the candidates by position (`Signals.order`) and find the runs of equal ids there. The ids must not
decrease with the position (e.g. `pos // size`); every shape stays `[batch, kv_heads, C]` (at most `C` segments),
so the compiled graph does not depend on the data.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Signals


class Segments:
    """Runs of equal `ids` (`[batch, kv_heads, C]`, non-decreasing with position) among the candidates of `s`.

    Tensors handed to the methods are in sequence order (`s.in_sequence_order`), `[b, h, C]` or `[b, h, C, d]`.
    Per-segment results are `[b, h, C(, d)]`, segment `j` (the `j`-th run, oldest first) at index `j`.
    """

    def __init__(self, s: Signals, ids: Tensor):
        sid = s.in_sequence_order(ids)
        first = torch.ones_like(sid[..., :1], dtype=torch.bool)
        start = torch.cat([first, sid[..., 1:] != sid[..., :-1]], dim=-1)
        self.index = start.long().cumsum(-1) - 1  # each candidate's segment, in sequence order
        self.count = self.sum(torch.ones_like(sid, dtype=torch.float32))

    def _idx(self, x: Tensor) -> Tensor:
        return self.index if x.dim() == 3 else self.index.unsqueeze(-1).expand_as(x)

    def sum(self, x: Tensor) -> Tensor:
        """Per-segment sums of `x`."""
        return torch.zeros_like(x).scatter_add(2, self._idx(x), x)

    def reduce(self, x: Tensor, op: str) -> Tensor:
        """Per-segment `op` of `x` (`"amax"`, `"amin"`); segments that do not exist hold 0."""
        return torch.zeros_like(x).scatter_reduce(2, self._idx(x), x, op, include_self=False)

    def spread(self, per_segment: Tensor) -> Tensor:
        """Each candidate's value of its segment (the inverse of a reduction), in sequence order."""
        return per_segment.gather(2, self._idx(per_segment))

    def next(self, per_segment: Tensor) -> Tensor:
        """Per-segment values of the next segment (the last one gets its own)."""
        return torch.cat([per_segment[:, :, 1:], per_segment[:, :, -1:]], dim=2)

    def softmax(self, x: Tensor) -> Tensor:
        """Softmax of `x` within each segment."""
        e = (x - self.spread(self.reduce(x, "amax"))).exp()
        return e / self.spread(self.sum(e))

    def rank(self, x: Tensor) -> Tensor:
        """Each candidate's rank by `x` within its segment, 0 = lowest (`x.argsort().argsort()` per segment)."""
        by_x = torch.argsort(x, dim=-1, stable=True)
        grouped = by_x.gather(-1, torch.argsort(self.index.gather(-1, by_x), dim=-1, stable=True))
        place = torch.arange(x.shape[-1], device=x.device).expand_as(x)
        start = (self.count.cumsum(-1) - self.count).long()  # each segment's first place
        ranks = place - self.spread(start).gather(-1, grouped)
        return torch.empty_like(ranks).scatter(-1, grouped, ranks)


def head_sum_by_position(pos: Tensor, x: Tensor) -> Tensor:
    """For each candidate, the sum of `x` over the KV heads holding the same position, `[b, h, C]`; empty slots
    (-1) get 0. Slots are unordered per head, and on the head-pooled layout a head's candidates are the whole pool
    (its own entries valid, the rest -1): matching by position (sorted search, one KV head at a time) is right on
    both layouts, where comparing slot by slot would add other tokens (a rule that sums or averages over heads
    uses this)."""
    order = torch.argsort(pos, dim=-1)
    sorted_pos, sorted_x = pos.gather(-1, order), x.gather(-1, order)
    total = torch.zeros_like(x)
    for j in range(pos.shape[1]):
        other = sorted_pos[:, j:j + 1].expand_as(pos).contiguous()
        idx = torch.searchsorted(other, pos.contiguous()).clamp(max=pos.shape[-1] - 1)
        match = (other.gather(-1, idx) == pos) & (pos >= 0)
        total = total + torch.where(match, sorted_x[:, j:j + 1].expand_as(x).gather(-1, idx), 0.0)
    return total
