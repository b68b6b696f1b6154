"""`evict`, the kernel's third phase: the one total order of candidates (`_order_key`), the top `keep` kept, the
surviving new tokens written into freed slots (a decode step writes one row per head, not the cache), the slots'
positions, carried state and per-token signals refilled."""

from __future__ import annotations

import torch
from torch import Tensor

from .signals import TOKEN_SIGNALS
from .slot_storage import encode
from .state import LayerSlots, NewTokens

# The signals `evict` reads (besides the score): positions, the carried state, the per-token signals it caches.
EVICT_READS = ("pos", "acc_attn", *TOKEN_SIGNALS)


def _top_indices(x: Tensor, k: int, *, largest: bool) -> Tensor:
    """`torch.topk(x, k, dim=-1, largest=largest).indices`. For k = 1 (every decode step) an arg-reduction instead,
    which Inductor fuses into its own loops rather than calling ATen's top-k: the keys ranked for dropping are unique,
    and where `dst`/`src` tie (no free slot / nothing to write) the write of that row is a no-op either way."""
    if k == 1:
        return (x.argmax if largest else x.argmin)(dim=-1, keepdim=True)
    return torch.topk(x, k, dim=-1, largest=largest).indices


def evict(
    score: Tensor, signals: dict[str, Tensor], totals: Tensor, slots: LayerSlots, new: NewTokens, *, keep: int,
    owner: bool = False, cand_owner: Tensor | None = None, tie_pos: Tensor | None = None,
) -> None:
    """Keep the best `keep` candidates and write the surviving new tokens into freed `slots`, in place.

    `signals` are `measure`'s (per candidate: `pos`, `acc_attn` and the `TOKEN_SIGNALS` are read), `totals` its
    totals. The head-pooled layout (`layouts.HeadPool`) also refills the slots' `owner` (from `cand_owner`, with
    `owner=True`) and passes `tie_pos`, the candidates' tie-breaking order in place of their positions."""
    pos = signals["pos"]
    k_slots, v_slots, k_new, v_new = slots.keys, slots.values, new.keys, new.values
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
    if n == 1 and C - keep == 1 and not owner:
        _replace_one(key, signals, totals, slots, new)
        return
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

    def put(cached: Tensor, cand: Tensor) -> None:
        rows = torch.where(write.unsqueeze(-1), cand[bi, hi, src], cached[bi, hi, dst])
        cached.index_put_((bi, hi, dst), rows)

    put(k_slots, encode(k_new, k_slots))  # quantized slots: the new tokens' codes and scales (`slot_storage`)
    put(v_slots, encode(v_new, v_slots))

    # An indexed write (`index_put`, distinct `dst` per row), not `scatter`: Inductor lowers a scatter of int64
    # values (the positions) to ATen on CUDA (its atomic-add limits), an index_put of any dtype to Triton.
    def refill(old: Tensor, cand: Tensor, empty: float | int) -> Tensor:
        kept = old.masked_fill(free, empty)
        return kept.index_put((bi, hi, dst), torch.where(write, cand[..., S:].gather(-1, src), kept.gather(-1, dst)))

    slots.pos.copy_(refill(slots.pos, pos, -1))
    if owner:
        slots.owner.copy_(refill(slots.owner, cand_owner, -1))
    slots.state.copy_(refill(signals["acc_attn"][..., :S], signals["acc_attn"], 0.0))
    slots.norms.copy_(torch.stack([refill(signals[name][..., :S], signals[name], 0.0) for name in TOKEN_SIGNALS],
                                  dim=-1))
    slots.totals.copy_(totals)


def _replace_one(key: Tensor, signals: dict[str, Tensor], totals: Tensor, slots: LayerSlots, new: NewTokens) -> None:
    """`evict` of one token dropping one candidate (a decode step, evicting or appending into head-room): the
    argmin of the order key is the one dropped, exactly `evict`'s kept set. If it is a slot, the new token replaces
    it (one row of K, V, position and norms written per head); if it is the new token itself, nothing is written
    (the row is rewritten unchanged). The carried state changes for every slot (this call's attention adds to it):
    one pointwise pass over the `S` slots, the freed slot taking the new token's."""
    b, h, S = slots.pos.shape
    bi = torch.arange(b, device=key.device).view(b, 1, 1)
    hi = torch.arange(h, device=key.device).view(1, h, 1)
    d = key.argmin(dim=-1, keepdim=True)  # [b, h, 1]
    write = d < S
    dst = d.clamp(max=S - 1)

    def row(old: Tensor, cand: Tensor) -> Tensor:  # [b, h, 1(, k)]: the new token's row, or the slot's unchanged
        return torch.where(write.view(*write.shape, *(1,) * (old.dim() - 3)), cand, old[bi, hi, dst])

    slots.keys.index_put_((bi, hi, dst), row(slots.keys, encode(new.keys, slots.keys)))
    slots.values.index_put_((bi, hi, dst), row(slots.values, encode(new.values, slots.values)))
    pos = signals["pos"]
    slots.pos.index_put_((bi, hi, dst), row(pos[..., :S, None], pos[..., S:, None]).squeeze(-1))
    norms = torch.stack([signals[name] for name in TOKEN_SIGNALS], dim=-1)  # [b, h, S + 1, 3]
    slots.norms.index_put_((bi, hi, dst), row(norms[:, :, :S], norms[:, :, S:]).to(slots.norms.dtype))
    acc = signals["acc_attn"]
    freed = torch.arange(S, device=d.device) == torch.where(write, d, S)
    slots.state.copy_(torch.where(freed, acc[..., S:], acc[..., :S]))
    slots.totals.copy_(totals)


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
