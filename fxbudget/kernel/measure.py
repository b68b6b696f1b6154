"""`measure`, the kernel's first phase: exact attention of the call's queries over the visible candidates, and the
run's signal set (`settings.MeasureSpec`: what the run's rules read, or every signal) for every candidate, the same
for every rule of the run (`Signals`; DESIGN §4). A signal outside the set is left out of the signals returned.

Candidates are a layer's slots (as the layout hands them: `Layout.view`) followed by the call's new tokens; visible
are valid slots and new tokens at positions <= the query's (within `sliding` for sliding-window layers). Query heads
are grouped per KV head; K/V are never copied per query head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import Block, loop_blocks
from .block_scan import scan_blocks
from .flex_measure import flex_attend
from .settings import DEFAULT_BLOCK, DEFAULT_MEASURE, MEASURED_SIGNALS, MeasureSpec, auto_block, measure_form, measure_spec
from .signals import TOKEN_SIGNALS, check_left_padded, window_block, window_max
from .slot_storage import stored_new, stored_slots
from .state import SIGNAL_NAMES, TOTALED, LayerConstants, LayerSlots, NewTokens


def measure(
    q: Tensor, slots: LayerSlots, new: NewTokens, const: LayerConstants, *, window: int, sliding: int,
    scale: float | None, block: int | None = DEFAULT_BLOCK, traced: bool = False, empty: bool = False,
    form: str | MeasureSpec = DEFAULT_MEASURE,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The attention output `[batch, q_heads, n, head_dim]`, the `TOTALED` signals' totals `[batch, kv_heads, 9]`
    (0 for a signal not measured), and the signals (`state.SIGNAL_NAMES`, a dict in that order) but those of
    `MEASURED_SIGNALS` outside the spec's set.

    `slots` is read only (its `keys`/`values` may have one head: the head pool, where every head sees the whole
    pool; `pos`, `state` and `norms` are then as each head sees them). The call's queries are processed in blocks
    of `block` positions, so temporaries are O(block x candidates), never O(n x candidates). Eagerly (a Python
    loop over blocks) a block skips the new tokens it cannot see (causally later ones, and on sliding layers those
    before its window). `traced=True` (the graph pass) loops with `scan` higher-order ops of static shapes, so the
    compiled graph does not grow with `n` and holds no host sync (`block_scan.scan_blocks`: a full layer's
    query blocks folded in pairs over exactly the causal triangle, `key_scan.fold_scan`; a sliding layer's band).
    `empty` (the marker's: the cache held nothing before the call) skips the slots, which would add exact zeros;
    eagerly, the positions say so anyway (and must agree).
    `form` (`settings.measure_form`): "flex" computes the output and `attn` with two fused `flex_attention` calls
    and the window signals from the last `w` queries' block (`flex_measure`), for a call of more than `w` queries;
    "blocks" is the above. The signals are the same either way. `form` may be a `MeasureSpec` (the form and the
    signal set); a plain form string measures every signal. Without `attn` and `acc_attn` in the set, the flex form
    skips its transposed call and the carried state is not updated.
    """
    spec = measure_spec(form)
    form, measured = spec.form, spec.signals
    as_stored, slots = slots, stored_slots(slots, new)  # quantized slots: read as the values they store
    need_attn = bool(measured & {"attn", "acc_attn"})
    k_slots, v_slots, pos_slots = slots.keys, slots.values, slots.pos
    k_new, v_new, new_pos = new.keys, new.values, new.pos
    b, h, S = pos_slots.shape
    d = k_slots.shape[-1]
    n = k_new.shape[2]
    g = q.shape[1] // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc = torch.promote_types(k_slots.dtype, torch.float32)  # softmax and signals in fp32 (fp64 for fp64 inputs)

    pos = torch.cat([pos_slots, new_pos.unsqueeze(1).expand(b, h, n)], dim=2)
    # Query head j*h_group.. of KV head i: rows (group member, query) of one matrix per KV head.
    queries = q.reshape(b, h, g * n, q.shape[-1])
    # Visibility is compared in int32 (positions stay far below 2^31): int32 vectorizes twice as wide as int64.
    qpos = new_pos.to(torch.int32)
    # Which queries each attention signal sums over: every valid query, the observation window (the last `w`
    # positions of the row), the last position. Pads (position -1) count nowhere.
    w = min(window, n)
    last = qpos.amax(dim=-1, keepdim=True)
    valid = qpos >= 0
    weights = torch.stack([valid, valid & (qpos > last - w), valid & (qpos == last)], dim=1).to(acc)  # [b, 3, n]
    slot_pos = pos_slots.to(torch.int32)
    if not traced and n > 1:
        check_left_padded(new_pos)  # the window is the call's last `w` queries (one token: nothing to check)
    if not traced:
        # Eagerly, a call on an empty cache (a prefill) is read from the positions. A compiled graph cannot branch
        # on data: it skips the slots only when the cache says they are empty (`empty`, a static argument).
        held = bool((slot_pos >= 0).any())
        if empty and held:
            raise RuntimeError("fxbudget: the cache said it was empty, but the layer's slots hold entries")
        empty = not held
    live = 0 if empty else S  # empty slots would add exact zeros
    # bf16/fp16: the blocks compute in fp32 throughout, as flash attention accumulates (logits rounded to the input
    # dtype first double the error against float64). The cost: an fp32 copy of the call's K/V (slots included).
    kv = [x.to(acc) for x in (k_slots[:, :, :live], v_slots[:, :, :live], k_new, v_new)]
    blk = Block(kv[0], kv[1], slot_pos[..., :live], kv[2], kv[3], qpos.unsqueeze(1), scale, sliding, acc)
    queries_acc = queries.to(acc)
    R = min(block or auto_block(b * q.shape[1], n, q.device), n)
    if n > w and measure_form(form, q.device, q.dtype) == "flex":  # a call of <= w queries is its own window block
        out, sig_s, sig_n, win_max = _flex(blk, q, queries_acc, k_slots[:, :, :live], v_slots[:, :, :live], k_new,
                                           v_new, qpos, weights, w, scale, sliding, need_attn)
    elif n <= R:  # one block (a decode step, a prefill chunk): the window max from its softmax
        out, sig_s, sig_n, max_s, max_n = blk(queries_acc, qpos, weights, 0, n, win=(n - w, n))
        win_max = torch.cat([max_s, max_n], dim=-1)
    elif traced:
        out, sig_s, sig_n = scan_blocks(blk, queries_acc, qpos, weights, R)
        win_max = window_max(blk, queries_acc, qpos, weights, w)  # the last w queries once more
    else:
        out, sig_s, sig_n, win_max = loop_blocks(blk, queries_acc, qpos, weights, R, w)
    out = out.reshape(b, q.shape[1], n, -1).to(v_new.dtype)
    if live < S:
        sig_s = weights.new_zeros(b, h, 3, S)
        win_max = torch.cat([win_max.new_zeros(b, h, S - live), win_max], dim=-1)

    attn, window_attn, last_attn = (torch.cat([sig_s[:, :, i], sig_n[:, :, i]], dim=-1) for i in range(3))
    found = dict(attn=attn, window_attn=window_attn, last_attn=last_attn, pos=pos,
                 queries=queries, k_slots=k_slots, k_new=k_new, new_pos=new_pos, inv_freq=const.inv_freq,
                 v_slots=v_slots, v_new=v_new, window_max_attn=win_max)
    if "acc_attn" in measured:  # the carried state is updated only by a kernel that measures attention
        found["acc_attn"] = torch.cat([slots.state, slots.state.new_zeros(b, h, n)], dim=2).to(acc) + attn
    # Cached entries' per-token signals were stored when they were written: no second pass over the K/V cache.
    if measured & set(TOKEN_SIGNALS):  # measured on what the slots will hold of the new tokens (quantized slots)
        written = stored_new(new, as_stored)
        found.update({name: torch.cat([slots.norms[..., i].to(acc), fn(written, const, acc)], dim=-1)
                      for i, (name, fn) in enumerate(TOKEN_SIGNALS.items()) if name in measured})
    # A `Signals` field measured nowhere fails here; a measured one outside the run's set is left out.
    signals = {name: found[name] for name in SIGNAL_NAMES if name in measured or name not in MEASURED_SIGNALS}
    return out, signal_totals(signals), signals


def _flex(blk: Block, q, queries_acc, k_slots, v_slots, k_new, v_new, qpos, weights, w: int, scale: float,
          sliding: int, need_attn: bool = True):
    """The flex form (`flex_measure`): the output and `attn` fused, the window signals from one `Block` over the
    last `w` queries. Returns what the block forms return: out, sums over slots and new tokens, the window max.
    Without `need_attn`, no transposed call: `attn`'s row is zeros there, left out of the signals by `measure`."""
    S = blk.slot_pos.shape[-1]
    out, attn = flex_attend(q, k_slots, v_slots, blk.slot_pos, k_new, v_new, qpos, scale=scale, sliding=sliding,
                            attn=need_attn)
    s_s, s_n, m_s, m_n, c0 = window_block(blk, queries_acc, qpos, weights, w)
    if attn is None:
        attn = s_s.new_zeros(s_s.shape[0], s_s.shape[1], S + qpos.shape[1])
    sig_s = torch.cat([attn[:, :, None, :S].to(s_s.dtype), s_s[:, :, 1:]], dim=2)
    sig_n = torch.cat([attn[:, :, None, S:].to(s_n.dtype), F.pad(s_n[:, :, 1:], (c0, 0))], dim=2)
    return out, sig_s, sig_n, torch.cat([m_s, F.pad(m_n, (c0, 0))], dim=-1)


def signal_totals(signals: dict[str, Tensor]) -> Tensor:
    """Per-call totals of the `TOTALED` signals (in that order), `[batch, kv_heads, len(TOTALED)]`, in the
    attention's dtype (fp32; fp64 for fp64 inputs); 0 for a signal not measured (outside the run's set: the totals
    are diagnostics, and a NaN would make two equal caches compare unequal)."""
    acc = torch.promote_types(signals["k_new"].dtype, torch.float32)
    pos = signals["pos"]
    return torch.stack([signals[name].to(acc).sum(dim=-1) if name in signals else
                        torch.zeros(pos.shape[:-1], dtype=acc, device=pos.device) for name in TOTALED], dim=-1)
