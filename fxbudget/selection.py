"""The kernel's selection: the one total order of candidates (`_order_key`) and `evict`, its third phase (see
`fxbudget.kernel`: the fairness contract). Its own module so the kernel module stays readable."""

from __future__ import annotations

import torch
from torch import Tensor


def _top_indices(x: Tensor, k: int, *, largest: bool) -> Tensor:
    """`torch.topk(x, k, dim=-1, largest=largest).indices`. For k = 1 (every decode step) an arg-reduction instead,
    which Inductor fuses into its own loops rather than calling ATen's top-k: the keys ranked for dropping are unique,
    and where `dst`/`src` tie (no free slot / nothing to write) the write of that row is a no-op either way."""
    if k == 1:
        return (x.argmax if largest else x.argmin)(dim=-1, keepdim=True)
    return torch.topk(x, k, dim=-1, largest=largest).indices


def evict(
    score: Tensor, pos: Tensor, acc_attn: Tensor, key_norm: Tensor, value_norm: Tensor, wov_norm: Tensor,
    totals: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor,
    totals_buf: Tensor, k_new: Tensor, v_new: Tensor, *, keep: int, owner: Tensor | None = None,
    cand_owner: Tensor | None = None, tie_pos: Tensor | None = None,
) -> None:
    """Keep the best `keep` candidates and write the surviving new tokens into freed slots, in place.

    The head-pooled layout (`fxbudget.pool.evict_pooled`) also passes the slots' `owner` (refilled like the
    positions, from `cand_owner`) and `tie_pos`, the candidates' tie-breaking order in place of their positions."""
    b, h, S, _ = k_slots.shape
    n = k_new.shape[2]
    C = S + n
    dev = pos.device

    # One exact total order: score, then the newer position; among invalid candidates (empty slots, pads) the highest
    # index goes first, so a call's pads are dropped before any empty slot and are never written.
    # Scores map to order-preserving int32 (flip the magnitude bits of negatives) and share an int64 with the
    # tie-breaker, so one top-k finds the `C - keep` candidates to drop: linear time, deterministic.
    # -0.0 is mapped to +0.0 first: the two compare equal, so they must tie (the newer wins), not rank by sign bit.
    key, idx = _order_key(score, pos, C, tie_pos)
    dropped = _top_indices(key, C - keep, largest=False)
    is_dropped = torch.zeros_like(pos, dtype=torch.bool).scatter(-1, dropped, True)
    free, new_kept = is_dropped[..., :S], ~is_dropped[..., S:]

    # Pair freed slots (lowest index first) with kept new tokens (in order). There are at least as many freed slots
    # as kept new tokens; the remaining rows of the fixed-size write hit distinct slots and write them unchanged.
    t = min(n, S)
    dst = _top_indices(torch.where(free, S - idx[:S], 0), t, largest=True)
    src = _top_indices(torch.where(new_kept, n - idx[:n], 0), t, largest=True)
    write = torch.arange(t, device=dev) < new_kept.sum(dim=-1, keepdim=True)
    bi = torch.arange(b, device=dev).view(b, 1, 1)
    hi = torch.arange(h, device=dev).view(1, h, 1)

    def put(slots: Tensor, new: Tensor) -> None:
        rows = torch.where(write.unsqueeze(-1), new[bi, hi, src], slots[bi, hi, dst])
        slots.index_put_((bi, hi, dst), rows)

    put(k_slots, k_new)
    put(v_slots, v_new)

    def refill(old: Tensor, cand: Tensor, empty: float | int) -> Tensor:
        kept = old.masked_fill(free, empty)
        return kept.scatter(-1, dst, torch.where(write, cand[..., S:].gather(-1, src), kept.gather(-1, dst)))

    pos_slots.copy_(refill(pos_slots, pos, -1))
    if owner is not None:
        owner.copy_(refill(owner, cand_owner, -1))
    state.copy_(refill(acc_attn[..., :S], acc_attn, 0.0))
    norms.copy_(torch.stack([refill(x[..., :S], x, 0.0) for x in (key_norm, value_norm, wov_norm)], dim=-1))
    totals_buf.copy_(totals)


def _order_key(score: Tensor, pos: Tensor, C: int, tie_pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`evict`'s total order of the `C` candidates as one int64 (larger = kept first): the score in float32, then
    the newer position (`tie_pos` in its place if given); invalid candidates last, the highest index first.
    Returns the key and the candidates' indices `arange(C)`."""
    score = score.float()
    bits = torch.where(score == 0, 0.0, score).view(torch.int32)
    order_key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    idx = torch.arange(C, device=pos.device)
    tie = torch.where(pos >= 0, (pos if tie_pos is None else tie_pos) + C, C - 1 - idx)
    return order_key * 2**32 + tie, idx
