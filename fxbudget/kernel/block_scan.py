"""The traced query-blocked measure phase: `scan` higher-order ops over query blocks, static shapes, no host sync.

`measure.measure` runs its query blocks eagerly as a Python loop (`attention.loop_blocks`), each block narrowed to the
new tokens it can see. A traced graph cannot narrow by data (`.item()` sizes fail to compile on torch 2.14/2.15 and for
one KV head, and sync the host), and an unrolled loop grows with the call. Here every size is a Python int known at
trace time:
- full-attention layers (or a window covering the call): one `scan` over pairs of query blocks folded over key tiles
  (`key_scan.fold_scan`): the exact causal triangle, one block body whatever `n`.
- sliding layers: one `scan`; a block attends over a band of `block + sliding - 1` new tokens ending at its last
  query, gathered at a data offset (a gather, not a data-dependent size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.scan import scan_op

from .key_scan import fold_scan


def scan_blocks(blk, queries: Tensor, qpos: Tensor, weights: Tensor, R: int):
    """Traced: `attention.loop_blocks`'s blocks as one `scan` (Inductor lowers it to a loop).

    Args:
        blk: the call's `attention.Block` (slots and new tokens); its slot tensors are passed through unchanged.
        queries: `[b, h, group * n, d]` (group-major rows). qpos: `[b, n]` int32 positions (-1 = pad).
        weights: `[b, 3, n]` query weights of the three attention signals. R: queries per block.
    Returns:
        The output `[b, h, group, n, dv]`, the weighted attention sums over the slots `[b, h, 3, S]` and over the new
        tokens `[b, h, 3, n]`, as `_loop_blocks` returns them (equal up to float rounding).
    """
    b, h, S = blk.slot_pos.shape
    n = qpos.shape[1]
    g = queries.shape[2] // n
    nb = -(-n // R)
    if not (blk.sliding and R + blk.sliding - 1 < nb * R):
        # Full attention, or a window that covers the whole call: the triangle, query blocks folded in pairs.
        return fold_scan(blk, queries, qpos, weights, R)
    pad = nb * R - n
    d = queries.shape[-1]
    # The queries padded to whole blocks with pads (position -1), block-major and contiguous: a scan traces its body
    # on a contiguous slice, so every slice must be one.
    q5 = F.pad(queries.view(b, h, g, n, d), (0, 0, 0, pad))
    xs = [x.contiguous() for x in (
        q5.view(b, h, g, nb, R, d).permute(3, 0, 1, 2, 4, 5).reshape(nb, b, h, g * R, d),
        F.pad(qpos, (0, pad), value=-1).view(b, nb, R).transpose(0, 1),
        F.pad(weights, (0, pad)).view(b, 3, nb, R).permute(2, 0, 1, 3))]
    sig_s, sig_n, ys = _band_scan(blk, xs, nb, R, n)
    dv = ys.shape[-1]
    out = ys.view(nb, b, h, g, R, dv).permute(1, 2, 3, 0, 4, 5).reshape(b, h, g, nb * R, dv)[:, :, :, :n]
    return out, sig_s, sig_n


def _inner(blk, k_slots, v_slots, slot_pos, kn, vn, np_):
    # The body's own block over its inputs (a scan body may not close over tensors).
    return type(blk)(k_slots, v_slots, slot_pos, kn, vn, np_, blk.scale, blk.sliding, blk.acc)


def _band_scan(blk, xs: list[Tensor], nb: int, R: int, n: int):
    """Sliding layer: block i attends over the band `[i * R, i * R + band)` of the new tokens padded in front by
    `sliding - 1` invisible entries (position -1), so every band is in range, no clamping."""
    b, h, S = blk.slot_pos.shape
    band = R + blk.sliding - 1
    lead = blk.sliding - 1
    pad = nb * R - n
    k_new, v_new = (F.pad(x, (0, 0, lead, pad)) for x in (blk.k_new, blk.v_new))
    new_pos = F.pad(blk.new_pos, (lead, pad), value=-1)
    starts = torch.arange(nb, device=xs[0].device) * R
    offsets = torch.arange(band, device=xs[0].device)

    def body(sig_s, sig_n, qb, qp, wb, start, k_slots, v_slots, slot_pos, kn, vn, np_, offs):
        idx = start + offs  # the block's band of padded new tokens: a data offset, a static length
        kn, vn, np_ = kn.index_select(2, idx), vn.index_select(2, idx), np_.index_select(-1, idx)
        o, s_s, s_n = _inner(blk, k_slots, v_slots, slot_pos, kn, vn, np_)(qb, qp, wb, 0, band)
        # Each index of the band once: a gather, an add and a scatter of distinct entries (deterministic).
        s_n = sig_n.index_select(-1, idx) + s_n
        return sig_s + s_s, sig_n.index_copy(-1, idx, s_n), o

    init = [xs[2].new_zeros(b, h, 3, S), xs[2].new_zeros(b, h, 3, lead + nb * R)]
    sig_s, sig_n, ys = scan_op(body, init, [*xs, starts], (blk.k_slots, blk.v_slots, blk.slot_pos, k_new, v_new,
                                                           new_pos, offsets))
    return sig_s, sig_n[..., lead:lead + n], ys
