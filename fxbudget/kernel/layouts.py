"""The cache layouts behind one small protocol (`Layout`): how a layer's slots are handed to `measure` (`view`),
what the rule region's allocation step is (`floor`), and how `evict` writes back (`evict`).

- `PerHead`: each KV head has its own `S` slots (`LayerSlots` as they are); every head keeps exactly `keep`.
- `HeadPool` (docs/DESIGN.md, "Head-pooled layout"; head-adaptive rules such as AdaKV): the unpooled tensors and
  shapes (keys/values `[b, h, S, d]`) read as one pool of `P = h x S` slots per batch row (a view: the tensors are
  contiguous), plus `owner`: the KV head whose entry a slot holds. A slot belongs to head `j` iff its position is
  >= 0 and its owner is `j`.
  - `view`: the pool `[b, 1, P, d]` as every head's slots (the attention blocks fold the heads into the query rows:
    one matmul over the pool, no copy of it) and the slots' positions, state and norms as each head sees them
    (`head_view`: another head's slot looks empty, position -1). Each head so has `P + n` candidates, and the rule
    scores them exactly as on the unpooled layout.
  - `floor`: the allocation step (`rule_region(..., floor=f)`): each head's top `f` real candidates are raised
    above every unprotected score, so the pool's one top-k keeps them; `f = B` is uniform allocation (a uniform
    rule keeps the unpooled sets), `f = int(alpha x B)` AdaKV's (`Rule.head_floor`).
  - `evict`: the unchanged `evict` on one row per batch element: the `P` pooled slots (each scored from its owner's
    row) and the `h x n` new tokens, keeping `h x keep`; kept new tokens go into freed slots of the pool, with their
    head as owner. A decode step writes `h` rows, as unpooled.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..rules.base import Rule
from .evict import EVICT_READS, evict
from .state import LayerSlots, NewTokens


class Layout(Protocol):
    name: str

    def view(self, slots: LayerSlots) -> LayerSlots:
        """The slots as `measure` reads them (and as the rule sees them)."""

    def floor(self, rule: Rule, budget: int) -> int | None:
        """The rule region's allocation step (None: none)."""

    def evict(self, score: Tensor, signals: dict[str, Tensor], totals: Tensor, slots: LayerSlots, new: NewTokens, *,
              keep: int) -> None:
        """`evict` on this layout: `keep` entries per head, in place."""


class PerHead:
    name = "per-head slots"

    def view(self, slots: LayerSlots) -> LayerSlots:
        return slots

    def floor(self, rule: Rule, budget: int) -> None:
        return None

    def evict(self, score, signals, totals, slots, new, *, keep):
        evict(score, signals, totals, slots, new, keep=keep)


def head_view(x: Tensor, owner: Tensor, empty: float | int) -> Tensor:
    """The pooled slots' `x` (`[b, h, S]` or `[b, h, S, k]`) as each head sees them: `[b, h, h*S(, k)]`, its own
    slots' values and `empty` elsewhere (small tensors: positions and floats, never keys or values)."""
    b, h, S = owner.shape
    heads = torch.arange(h, device=owner.device, dtype=owner.dtype).view(1, h, 1)
    mine = owner.reshape(b, 1, h * S) == heads  # [b, h, P]
    flat = x.reshape(b, 1, h * S, *x.shape[3:])
    if x.dim() == 4:
        mine = mine.unsqueeze(-1)
    return torch.where(mine, flat, empty)


class HeadPool:
    name = "head pool"

    def view(self, slots: LayerSlots) -> LayerSlots:
        b, h, S, d = slots.keys.shape
        P = h * S
        return LayerSlots(slots.keys.view(b, 1, P, d), slots.values.view(b, 1, P, slots.values.shape[-1]),
                          head_view(slots.pos, slots.owner, -1), head_view(slots.state, slots.owner, 0.0),
                          head_view(slots.norms, slots.owner, 0.0), slots.totals, slots.owner)

    def floor(self, rule: Rule, budget: int) -> int:
        return rule.head_floor(budget)

    def evict(self, score, signals, totals, slots, new, *, keep):
        """Keep the best `h x keep` of the layer's pooled slots and new tokens. Per-candidate inputs are per head,
        `[b, h, h*S + n]` (from `measure` on `view`, and the rule region)."""
        b, h, S, d = slots.keys.shape
        n = new.keys.shape[2]
        P = h * S
        own = slots.owner.view(b, 1, P)
        row = own.clamp(min=0).long()  # each slot scored in its owner's row (a free slot is empty in every row)

        def flat(x: Tensor) -> Tensor:  # [b, h, P + n] -> [b, 1, P + h*n]: the pool, then head 0's tokens, ...
            return torch.cat([x[..., :P].gather(1, row), x[..., P:].reshape(b, 1, h * n)], dim=-1)

        pos_f = flat(signals["pos"])
        heads = torch.cat([own, torch.arange(h, device=own.device, dtype=own.dtype).repeat_interleave(n)
                           .view(1, 1, -1).expand(b, 1, h * n)], dim=-1)
        # Ties (equal score and position: the same token in two heads) go to the higher head: the order is total.
        tie = torch.where(pos_f >= 0, pos_f * h + heads, -1)
        score_f = flat(score)
        flat_signals = {"pos": pos_f, **{name: flat(signals[name]) for name in EVICT_READS if name != "pos"}}
        pool = LayerSlots(slots.keys.view(b, 1, P, d), slots.values.view(b, 1, P, slots.values.shape[-1]),
                          slots.pos.view(b, 1, P), slots.state.view(b, 1, P),
                          slots.norms.view(b, 1, P, slots.norms.shape[-1]), slots.totals, own)
        evict(score_f, flat_signals, totals, pool,
              NewTokens(new.keys.reshape(b, 1, h * n, new.keys.shape[-1]),
                        new.values.reshape(b, 1, h * n, new.values.shape[-1]),
                        new.pos), keep=h * keep, owner=True, cand_owner=heads, tie_pos=tie)


PER_HEAD, HEAD_POOL = PerHead(), HeadPool()


def layout(pooled: bool) -> Layout:
    return HEAD_POOL if pooled else PER_HEAD
