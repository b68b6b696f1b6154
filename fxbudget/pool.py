"""The head-pooled layout's kernel phases: `measure` and `evict` of `fxbudget.kernel`, on a pool of slots the KV
heads of a layer share (docs/DESIGN.md, "Head-pooled layout").

A pooled layer has the unpooled layer's tensors and shapes (keys/values `[b, h, S, d]`), read as one pool of
`P = h x S` slots per batch row (a view: the tensors are contiguous), plus `owner [b, h, S]`: the KV head whose entry
a slot holds. A slot belongs to head `j` iff its position is >= 0 and its owner is `j`.

- `measure_pooled` runs the unchanged `measure` with the pool `[b, 1, P, d]` as every head's slots (the attention
  blocks fold the heads into the query rows: one matmul over the pool, no copy of it) and the slots' positions,
  state and norms as each head sees them (`head_view`: another head's slot looks empty, position -1). Each head so
  has `P + n` candidates, and the rule scores them exactly as on the unpooled layout.
- `rule_region(..., floor=f)` (kernel) is the allocation step: each head's top `f` real candidates are raised above
  every unprotected score, so `evict_pooled`'s one top-k over all the heads keeps them; `f = B` is uniform
  allocation, `f = int(alpha x B)` AdaKV's.
- `evict_pooled` is the unchanged `evict` on one row per batch element: the `P` pooled slots (each scored from its
  owner's row) and the `h x n` new tokens, keeping `h x keep`; kept new tokens go into freed slots of the pool,
  with their head as owner. A decode step writes `h` rows, as unpooled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel import SIGNAL_NAMES, evict, measure, rule_region
from .rules.base import Rule


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


def measure_pooled(q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor,
                   k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor, wo: Tensor, owner: Tensor,
                   **kwargs) -> tuple[Tensor, ...]:
    """`kernel.measure` on the pooled layer (same outputs; the slot signals are `[b, h, h*S]`, `k_slots` and
    `v_slots` the pool `[b, 1, h*S, d]`, which `rule_region` hands the rule expanded to every head, a view: in the
    rule region, so a rule that does not read keys leaves no trace of it). `kwargs`: `measure`'s keyword
    arguments."""
    b, h, S, d = k_slots.shape
    P = h * S
    k_pool, v_pool = k_slots.view(b, 1, P, d), v_slots.view(b, 1, P, v_slots.shape[-1])
    return measure(q, k_pool, v_pool, head_view(pos_slots, owner, -1), head_view(state, owner, 0.0),
                   head_view(norms, owner, 0.0), k_new, v_new, new_pos, inv_freq, wo, **kwargs)


def evict_pooled(score: Tensor, pos: Tensor, acc_attn: Tensor, key_norm: Tensor, value_norm: Tensor,
                 wov_norm: Tensor, totals: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor,
                 state: Tensor, norms: Tensor, totals_buf: Tensor, k_new: Tensor, v_new: Tensor, owner: Tensor, *,
                 keep: int) -> None:
    """`kernel.evict` on the pool: keep the best `h x keep` of the layer's pooled slots and new tokens, in place.

    Per-candidate inputs are per head, `[b, h, h*S + n]` (from `measure_pooled` and the rule region).
    """
    b, h, S, d = k_slots.shape
    n = k_new.shape[2]
    P = h * S
    own = owner.view(b, 1, P)
    row = own.clamp(min=0).long()  # each slot scored in its owner's row (a free slot is empty in every row)

    def flat(x: Tensor) -> Tensor:  # [b, h, P + n] -> [b, 1, P + h*n]: the pool, then head 0's tokens, head 1's...
        return torch.cat([x[..., :P].gather(1, row), x[..., P:].reshape(b, 1, h * n)], dim=-1)

    pos_f = flat(pos)
    heads = torch.cat([own, torch.arange(h, device=own.device, dtype=own.dtype).repeat_interleave(n).view(1, 1, -1)
                       .expand(b, 1, h * n)], dim=-1)
    # Ties (equal score and position: the same token in two heads) go to the higher head, so the order is total.
    tie = torch.where(pos_f >= 0, pos_f * h + heads, -1)
    evict(flat(score), pos_f, flat(acc_attn), flat(key_norm), flat(value_norm), flat(wov_norm), totals,
          k_slots.view(b, 1, P, d), v_slots.view(b, 1, P, v_slots.shape[-1]), pos_slots.view(b, 1, P),
          state.view(b, 1, P), norms.view(b, 1, P, norms.shape[-1]), totals_buf,
          k_new.reshape(b, 1, h * n, d), v_new.reshape(b, 1, h * n, v_new.shape[-1]),
          keep=h * keep, owner=own, cand_owner=heads, tie_pos=tie)


def attend_pooled(q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor,
                  totals: Tensor, k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor, wo: Tensor,
                  owner: Tensor | None, *, rule: Rule, budget: int, keep: int, sliding: int, window: int,
                  scale: float | None, block: int | None) -> Tensor:
    """`budget_attention(pooled=True)` (`fxbudget.budget_attention`): the three pooled phases in order (arguments as there)."""
    if owner is None:
        raise ValueError("budget_attention(pooled=True) needs the slots' owner tensor")
    out, new_totals, *signals = measure_pooled(q, k_slots, v_slots, pos_slots, state, norms, k_new, v_new, new_pos,
                                               inv_freq, wo, owner, window=window, sliding=sliding, scale=scale,
                                               block=block)
    score = rule_region(rule, budget, min(window, k_new.shape[2]), *signals, floor=rule.head_floor(budget))
    sig = dict(zip(SIGNAL_NAMES, signals))
    evict_pooled(score, sig["pos"], sig["acc_attn"], sig["key_norm"], sig["value_norm"], sig["wov_norm"], new_totals,
                 k_slots, v_slots, pos_slots, state, norms, totals, k_new, v_new, owner, keep=keep)
    return out
