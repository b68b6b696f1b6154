"""Exact attention of a block of queries over a layer's candidates (`Block`), and the eager loop over a call's
blocks: `measure`'s attention (`fxbudget.kernel.measure`). The traced loop is `block_scan`."""

from __future__ import annotations

import torch
from torch import Tensor


class Block:
    """Exact attention of one block of queries over the slots and a range of the call's new tokens.

    Slots and new tokens stay separate all the way (logits, softmax, signals): concatenating K/V would copy the whole
    cache, and concatenating the [queries, candidates] logits or probabilities costs a full extra pass. The softmax
    over both parts is torch.softmax's formula, exp(x - max) / sum, computed piecewise, so the new tokens' part is
    the same whatever the number of (empty) slots: that is what lets a shared prefill be branched bit-exactly.
    """

    def __init__(self, k_slots, v_slots, slot_pos, k_new, v_new, new_pos, scale, sliding, acc):
        # Every float tensor (and the queries) in `acc`: fp32, or fp64 for fp64 inputs.
        self.k_slots, self.v_slots, self.slot_pos = k_slots, v_slots, slot_pos  # slot_pos: [b, h, S] int32
        self.k_new, self.v_new, self.new_pos = k_new, v_new, new_pos  # new_pos: [b, 1, n] int32
        self.scale, self.sliding, self.acc = scale, sliding, acc

    def __call__(self, qb: Tensor, qpos: Tensor, weights: Tensor, c0, c1, win: tuple[int, int] | None = None):
        """`qb` `[b, h, group * R, d]` (group-major rows), `qpos` `[b, R]`, `weights` `[b, 3, R]`; new tokens
        `c0:c1` are the candidates besides the slots. Returns the output `[b, h, group * R, dv]` and the weighted
        attention sums (`[b, h, 3, S]` over slots, `[b, h, 3, c1 - c0]` over the new tokens); with `win`, the
        block's rows `win[0]:win[1]` that may be window queries, also the window max over them (`window_max`)."""
        b, h, gr, _ = qb.shape
        R = qpos.shape[1]
        g = gr // R
        qp = qpos.view(b, 1, 1, R, 1)
        qs = qb * self.scale  # scaled once here ([queries, d]), not in the [queries, candidates] logits

        def logits(k: Tensor, kpos: Tensor) -> Tensor:
            lg = _heads_matmul(qs, k.transpose(-1, -2)).view(b, h, g, R, -1)
            kp = kpos.unsqueeze(2).unsqueeze(2)  # [b, h or 1, 1, 1, candidates]
            vis = (kp >= 0) & (kp <= qp)
            if self.sliding:
                vis = vis & (kp > qp - self.sliding)
            return lg.masked_fill_(~vis, float("-inf"))

        # In place from here on: one [queries, candidates] buffer per part is the block's whole working memory.
        # No slots (a prefill on an empty cache): no slot ops at all, not empty ones.
        slots = self.slot_pos.shape[-1] > 0
        ls = logits(self.k_slots, self.slot_pos) if slots else None
        length = c1 - c0
        ln = logits(self.k_new.narrow(2, c0, length), self.new_pos.narrow(-1, c0, length))
        m = ln.amax(dim=-1, keepdim=True)
        if slots:
            m = torch.maximum(ls.amax(dim=-1, keepdim=True), m)
        # A row with nothing visible (a pad) would be NaN; it attends to nothing instead (exp(-inf) = 0).
        m = m.masked_fill(m == float("-inf"), 0.0)
        es = ls.sub_(m).exp_().view(b, h, gr, -1) if slots else None
        en = ln.sub_(m).exp_().view(b, h, gr, -1)
        denom = (es.sum(dim=-1, keepdim=True) + en.sum(dim=-1, keepdim=True)) if slots else en.sum(dim=-1, keepdim=True)
        # The normalization is applied to the small results ([queries, d] and the weights), not to the probabilities.
        inv = 1.0 / denom.masked_fill(denom == 0, 1.0)  # [b, h, group * R, 1]
        if slots:
            out = (_heads_matmul(es, self.v_slots) + en @ self.v_new.narrow(2, c0, length)) * inv
        else:
            out = (en @ self.v_new.narrow(2, c0, length)) * inv
        # The three weighted sums over (group member, query) in one matmul per part: one read of the probabilities.
        wg = weights.unsqueeze(2).expand(b, 3, g, R).reshape(b, 1, 3, gr) * inv.transpose(-1, -2)
        s_s = wg @ es if slots else wg.new_zeros(b, h, 3, 0)
        if win is None:
            return out, s_s, wg @ en
        return out, s_s, wg @ en, *self.window_max(es, en, inv, weights[:, 1], *win)

    def window_max(self, es: Tensor | None, en: Tensor, inv: Tensor, in_window: Tensor, r0: int, r1: int):
        """`window_max_attn` over rows `r0:r1` of the block: the largest probability each candidate gets from one
        window query (`in_window` `[b, R]`, 0/1) and one query head of the group, `[b, h, S]` and `[b, h, new]`:
        a second read of those rows of the probabilities only. `es` None: no slots."""
        b, h, gr, _ = en.shape
        R = in_window.shape[1]
        g = gr // R
        scale = (inv.view(b, h, g, R, 1) * in_window.view(b, 1, 1, R, 1))[:, :, :, r0:r1]
        def top(x: Tensor) -> Tensor:
            return (x.view(b, h, g, R, -1)[:, :, :, r0:r1] * scale).amax(dim=(2, 3))

        m_s = top(es) if es is not None else None
        m_n = top(en)
        return (m_n.new_zeros(b, h, 0) if m_s is None else m_s), m_n


def _heads_matmul(a: Tensor, m: Tensor) -> Tensor:
    """`a @ m` for `a` `[b, h, rows, k]` and `m` `[b, h or 1, k, cols]`. With one head in `m` (the head pool), the
    heads are folded into `a`'s rows: one matmul over `m`, where broadcasting would copy `m` once per head."""
    b, h = a.shape[:2]
    if m.shape[1] == h:
        return a @ m
    return (a.reshape(b, 1, h * a.shape[2], a.shape[-1]) @ m).view(*a.shape[:-1], m.shape[-1])


def loop_blocks(blk: Block, queries: Tensor, qpos: Tensor, weights: Tensor, R: int, w: int):
    """Eager: a Python loop over blocks of `R` queries, each seeing only the new tokens it can see. `queries` is the
    signal tensor `[b, h, group * n, d]`: the blocks read it, so it is computed for every rule. The blocks holding
    the call's last `w` queries also give the window max (`Block.window_max`)."""
    b, h, S = blk.slot_pos.shape
    n = qpos.shape[1]
    g = queries.shape[2] // n
    q5 = queries.view(b, h, g, n, queries.shape[-1])
    out = queries.new_empty(b, h, g, n, blk.v_slots.shape[-1])
    sig_s = weights.new_zeros(b, h, 3, S)
    sig_n = weights.new_zeros(b, h, 3, n)
    max_s, max_n = weights.new_zeros(b, h, S), weights.new_zeros(b, h, n)
    for r0 in range(0, n, R):
        r1 = min(r0 + R, n)
        c0, c1 = _visible_range(r0, r1, n, blk.sliding)
        win = (max(n - w, r0) - r0, r1 - r0) if r1 > n - w else None
        o, s_s, s_n, *m = blk(q5[:, :, :, r0:r1].reshape(b, h, g * (r1 - r0), -1), qpos[:, r0:r1],
                              weights[..., r0:r1], c0, c1, win=win)
        out[:, :, :, r0:r1] = o.view(b, h, g, r1 - r0, -1)
        sig_s += s_s
        sig_n[..., c0:c1] += s_n
        if m:
            max_s = torch.maximum(max_s, m[0])
            max_n[..., c0:c1] = torch.maximum(max_n[..., c0:c1], m[1])
    return out, sig_s, sig_n, torch.cat([max_s, max_n], dim=-1)


def _visible_range(r0, r1, n: int, sliding: int):
    """New tokens `c0:c1` that queries `r0:r1` of a call may see: none after the block (causal) and, on a sliding
    layer, none `sliding` or more before its first query. Positions of a row's valid tokens are consecutive and
    pads are never visible, so index distance is position distance."""
    return (max(r0 - sliding + 1, 0) if sliding else 0), min(r1, n)


