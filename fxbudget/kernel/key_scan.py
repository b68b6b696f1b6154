"""The traced causal triangle in one block body: query blocks folded in pairs over key tiles (issue 30).

A full-attention call of `n` new tokens in `nb` query blocks of `R` queries is scanned in `nb' / 2` steps, `nb'` =
`nb` rounded up to a multiple of `2 c` with blocks of pads, over key tiles of `c R` new tokens (`c = tile_blocks(R,
nb)`: tiles of `TILE_KEYS` tokens once the call has enough blocks). Step `j` takes query block `j` (first) and query
block `nb' - 1 - j` (last):
they see `j // c + 1` and `nb' / c - j // c` key tiles, `nb' / c + 1` together whatever `j`. The step gathers those
tiles (tile `u` is key tile `u` of the first block for `u <= j // c`, key tile `u - j // c - 1` of the last block
after) and computes every tile's logits with its own query block in one batched matmul, `[nb' / c + 1, rows, c R]`
per KV head: the O(R x n) working memory of a query block of the eager loop. So:
- the work is the triangle: `(nb' + c) / (2 nb')` of the padded square (0.5 as `n` grows; the level scan it
  replaces did `(L + 1) / (2 L)`, 0.5625 at its 8 levels); tiles of `c` blocks make the per-tile temporaries (the
  gathered queries, the partial outputs, `d / (c R)` of the logits each) small when the query block is;
- the graph holds one step body whatever `n` (one `scan`, static shapes: `nb` only changes the sizes);
- no host sync, no data-dependent size: the step's tile indices are data (gathers of a static count).
On an empty cache (`measure`'s `empty`: no slots) the step has no slot ops at all.
Each query row's softmax is exact within its step (its row max and normalizer over the slots and all its tiles are
reductions over the step's tiles, split by which block a tile belongs to), so the weighted column sums every signal
needs use the final normalizers directly: one QK, one PV and one weights-times-probabilities product per tile,
the floor of a kernel that must return per-candidate attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.scan import scan_op

from .attention import _heads_matmul

# Key tiles hold this many new tokens (whole query blocks; fewer on short calls). Wide tiles: a step's gathered
# queries (one copy of its block per tile, [rows, head dim]) shrink against its logits ([rows, tile]), and its
# matmuls are fewer and larger. One layer of the embedded model's shapes under Inductor, 512 against 64: 2K 0.74 ->
# 0.49 s, 8K 7.32 -> 6.54 s, 16K 27.48 -> 24.33 s (benchmarks/studies/results/tile_keys.md).
TILE_KEYS = 512


def tile_blocks(R: int, nb: int) -> int:
    """Query blocks of `R` per key tile for a call of `nb` blocks: `ceil(TILE_KEYS / R)`, but at most `nb // 16`
    (at least 1), so that rounding the blocks up to whole pairs of tiles adds at most 1/8 of the call in pads."""
    return max(1, min(-(-TILE_KEYS // R), nb // 16))


def padded_blocks(nb: int, c: int) -> int:
    """`nb` query blocks rounded up to a multiple of `2 c` (pairs of blocks over whole tiles)."""
    return -(-nb // (2 * c)) * 2 * c


def fold_pairs(nb: int, c: int = 1) -> list[tuple[int, list[tuple[int, int]]]]:
    """The schedule of `fold_scan` for `nb` query blocks and key tiles of `c` blocks, in plain ints (what the step
    body computes from data): per step, `(first query block, [(query block, key tile) for each of the step's
    nb' / c + 1 tiles])`, nb' = `padded_blocks(nb, c)`. Every (query block i, key tile k <= i // c) pair of the
    padded triangle appears once, nothing else."""
    nb2 = padded_blocks(nb, c)
    steps = []
    for j in range(nb2 // 2):
        jt = j // c
        steps.append((j, [(j, u) if u <= jt else (nb2 - 1 - j, u - jt - 1) for u in range(nb2 // c + 1)]))
    return steps


def fold_scan(blk, queries: Tensor, qpos: Tensor, weights: Tensor, R: int):
    """`block_scan.scan_blocks` of a full-attention layer (or a window covering the call) as the folded triangle.

    Args:
        blk: the call's `attention.Block`. queries: `[b, h, group * n, d]` (group-major rows), in `blk.acc`.
        qpos: `[b, n]` int32 positions (-1 = pad). weights: `[b, 3, n]` query weights of the three signals.
        R: queries per block (and new tokens per key tile).
    Returns:
        The output `[b, h, group, n, dv]`, the weighted attention sums over the slots `[b, h, 3, S]` and over the new
        tokens `[b, h, 3, n]` (the eager loop's, up to float rounding).
    """
    b, h, S = blk.slot_pos.shape
    n = qpos.shape[1]
    g = queries.shape[2] // n
    d = queries.shape[-1]
    nb = -(-n // R)
    c = tile_blocks(R, nb)
    nb2 = padded_blocks(nb, c)  # the last blocks may be all pads
    nt = nb2 // c  # key tiles of c R new tokens
    N = nb2 * R
    pad = N - n
    steps = nb2 // 2
    dev = queries.device

    qb = F.pad(queries.view(b, h, g, n, d), (0, 0, 0, pad)).view(b, h, g, nb2, R, d).permute(3, 0, 1, 2, 4, 5)
    pb = F.pad(qpos, (0, pad), value=-1).view(b, nb2, R).transpose(0, 1)
    wb = F.pad(weights, (0, pad)).view(b, 3, nb2, R).permute(2, 0, 1, 3)
    # Step j's two query blocks, j and nb2 - 1 - j, side by side (a scan slices contiguous inputs).
    xs = [torch.stack([x[:steps], x.flip(0)[:steps]], dim=1).contiguous() for x in (qb, pb, wb)]
    kt, vt = (F.pad(x, (0, 0, 0, pad)).view(b, h, nt, c * R, x.shape[-1]).permute(2, 0, 1, 3, 4).contiguous()
              for x in (blk.k_new, blk.v_new))
    kpt = F.pad(blk.new_pos, (0, pad), value=-1).view(b, 1, nt, c * R).permute(2, 0, 1, 3).contiguous()
    body = _fold_body(blk.scale, blk.sliding, b, h, g, R, S, nt, c)
    init = [weights.new_zeros(b, h, 3, S), weights.new_zeros(b, h, 3, N)]
    sig_s, sig_n, ys = scan_op(body, init, [torch.arange(steps, device=dev), *xs],
                               (blk.k_slots, blk.v_slots, blk.slot_pos, kt, vt, kpt,
                                torch.arange(nt + 1, device=dev)))
    dv = ys.shape[-1]
    # ys [steps, 2, b, h, g, R, dv]: blocks 0..steps-1 first, then the last blocks in reverse step order.
    blocks = torch.cat([ys[:, 0], ys[:, 1].flip(0)])
    out = blocks.permute(1, 2, 3, 0, 4, 5).reshape(b, h, g, N, dv)[:, :, :, :n]
    return out, sig_s, sig_n[..., :n]


def _fold_body(scale: float, sliding: int, b: int, h: int, g: int, R: int, S: int, nt: int, c: int):
    T = nt + 1  # tiles per step
    Rk = c * R  # new tokens per tile
    gr = g * R
    neg = float("-inf")

    def visible(kp: Tensor, qp: Tensor) -> Tensor:
        vis = (kp >= 0) & (kp <= qp)
        return vis & (kp > qp - sliding) if sliding else vis

    def body(sig_s, sig_n, j, q2, qp2, w2, k_slots, v_slots, slot_pos, kt, vt, kpt, u):
        # q2 [2, b, h, g, R, d], qp2 [2, b, R], w2 [2, b, 3, R]; tiles u: the first block's for u <= j // c.
        jt = j // c
        second = u > jt
        side = second.long()
        kidx = torch.where(second, u - jt - 1, u)
        qs = q2 * scale  # scaled once ([queries, d]), not in the logits
        # The tiles' logits, each against its own query block: one batched matmul [T, b, h, g * R, c * R].
        ln = qs.index_select(0, side).view(T, b, h, gr, -1) @ kt.index_select(0, kidx).transpose(-1, -2)
        ln = ln.view(T, b, h, g, R, Rk)
        qpt = qp2.index_select(0, side).view(T, b, 1, 1, R, 1)
        ln.masked_fill_(~visible(kpt.index_select(0, kidx).view(T, b, 1, 1, 1, Rk), qpt), neg)
        if S:  # the slots, for both blocks' rows: [b, h, 2, g, R, S] (none when the cache is empty)
            ls = _heads_matmul(qs.permute(1, 2, 0, 3, 4, 5).reshape(b, h, 2 * gr, -1), k_slots.transpose(-1, -2))
            ls = ls.view(b, h, 2, g, R, S)
            qps = qp2.transpose(0, 1).reshape(b, 1, 2, 1, R, 1)
            ls.masked_fill_(~visible(slot_pos.view(b, slot_pos.shape[1], 1, 1, 1, S), qps), neg)

        sec = second.view(T, 1, 1, 1, 1)
        mt = ln.amax(dim=-1)  # [T, b, h, g, R]
        m2 = torch.stack([mt.masked_fill(sec, neg).amax(0), mt.masked_fill(~sec, neg).amax(0)])
        if S:
            m2 = torch.maximum(m2, ls.amax(dim=-1).permute(2, 0, 1, 3, 4))
        # A row with nothing visible (a pad) would be NaN; it attends to nothing instead (exp(-inf) = 0).
        m2 = m2.masked_fill(m2 == neg, 0.0)  # [2, b, h, g, R]
        en = ln.sub_(m2.index_select(0, side).unsqueeze(-1)).exp_()
        es = ls.sub_(m2.permute(1, 2, 0, 3, 4).unsqueeze(-1)).exp_() if S else None
        st = en.sum(dim=-1)
        denom = torch.stack([st.masked_fill(sec, 0.0).sum(0), st.masked_fill(~sec, 0.0).sum(0)])
        if S:
            denom = denom + es.sum(dim=-1).permute(2, 0, 1, 3, 4)
        inv = 1.0 / denom.masked_fill(denom == 0, 1.0)  # [2, b, h, g, R]

        en = en.view(T, b, h, gr, Rk)
        es = es.view(b, h, 2, gr, S) if S else None
        pv = en @ vt.index_select(0, kidx)  # [T, b, h, g * R, dv]
        o2 = torch.stack([pv.masked_fill(sec, 0.0).sum(0), pv.masked_fill(~sec, 0.0).sum(0)])
        if S:
            o2 = o2 + _heads_matmul(es.reshape(b, h, 2 * gr, S), v_slots).view(b, h, 2, gr, -1).permute(2, 0, 1, 3, 4)
        o2 = (o2 * inv.view(2, b, h, gr, 1)).view(2, b, h, g, R, -1)

        # Weighted column sums with the final normalizers: [2, b, h, 3, g * R] weights per row.
        wg = (w2.view(2, b, 1, 3, 1, R) * inv.view(2, b, h, 1, g, R)).reshape(2, b, h, 3, gr)
        col = wg.index_select(0, side) @ en  # [T, b, h, 3, Rk]
        s_s = (wg.permute(1, 2, 0, 3, 4) @ es).sum(dim=2) if S else 0.0  # [b, h, 3, S]
        # Key tile k's sum: step tile k of the first block (k <= jt) plus step tile jt + 1 + k of the last block
        # (when that is a tile of the step: k <= nt - 1 - jt).
        k = u[:nt]
        later = k + jt + 1
        first_part = col[:nt].masked_fill((k > jt).view(nt, 1, 1, 1, 1), 0.0)
        last_part = col.index_select(0, later.clamp(max=nt)).masked_fill((later > nt).view(nt, 1, 1, 1, 1), 0.0)
        s_n = (first_part + last_part).permute(1, 2, 3, 0, 4).reshape(b, h, 3, nt * Rk)
        return sig_s + s_s, sig_n + s_n, o2

    return body
