"""The shared budget-attention kernel: the fairness contract (DESIGN §4).

Every rule runs exactly this code; only `rule_region` (the rule's `score` and `protect`) differs. The kernel is split
in three phases so that the SDPA pass can splice each one into the traced graph and mark the rule's ops as a region
(that is what `kernel_fingerprint` abstracts away). The eager path calls the same three functions in the same order.

One call, per batch row and KV head, with `S` slots and `n` new tokens (`C = S + n` candidates):
1. `measure`: exact softmax attention of the call's queries over the visible candidates (valid slots and new tokens at
   positions <= the query's; within `sliding` for sliding-window layers). Query heads are grouped per KV head, K/V are
   never copied per query head. Then every signal, for every candidate, whatever the rule.
2. `rule_region`: `score = rule.score(signals)`; candidates in `rule.protect(signals)` score +inf, empty slots -inf.
3. `evict`: the top `keep` candidates by score are kept (ties: newer position wins);
   surviving new tokens are written into freed slots only (a decode step writes one row per head, not the cache);
   positions and the carried state (accumulated attention) are updated (`fxbudget.selection`).
The head-pooled layout (`fxbudget.pool`, for head-adaptive rules such as AdaKV) runs these same three phases on a
pool of slots the KV heads of a layer share, with an allocation step in the rule region (`rule_region(floor=)`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .block_scan import scan_blocks as _scan_blocks
from .kernel_signals import check_left_padded, value_out_norms, window_max
from .rule_contract import NoMutation, RuleContractError, check_output  # noqa: F401 (RuleContractError: re-export)
from .rules.base import Rule, Signals
from .selection import _order_key, _top_indices, evict  # noqa: F401 (evict: the kernel's third phase, re-export)

DEFAULT_WINDOW = 32  # observation window shared by all rules of a run (snapkv's paper default)
# Queries per block of `measure`: a kernel setting shared by every rule (None = `auto_block`). A call's attention
# temporaries are O(block x candidates) whatever its length.
DEFAULT_BLOCK = None

# Names of the tensors `measure` returns after the attention output and the totals: the `Signals` tensor fields.
SIGNAL_NAMES = (
    "attn", "window_attn", "last_attn", "acc_attn", "key_norm", "value_norm", "pos", "queries", "k_slots", "k_new",
    "new_pos", "inv_freq", "v_slots", "v_new", "window_max_attn", "wov_norm",
)
# The computed signals whose per-call totals are stored (`BudgetLayer.totals`, `[batch, kv_heads, 9]`). Storing them
# makes every signal a live value for every rule: dead-code elimination cannot give one rule a cheaper kernel.
TOTALED = ("attn", "window_attn", "last_attn", "acc_attn", "key_norm", "value_norm", "pos", "window_max_attn",
           "wov_norm")


def measure(
    q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor, wo: Tensor, *, window: int, sliding: int,
    scale: float | None, block: int | None = DEFAULT_BLOCK, traced: bool = False,
) -> tuple[Tensor, ...]:
    """Attention output `[batch, q_heads, n, head_dim]`, signal totals, then the signal tensors (`SIGNAL_NAMES`).

    The call's queries are processed in blocks of `block` positions (`attend_block`), so temporaries are
    O(block x candidates), never O(n x candidates). Eagerly (a Python loop over blocks) a block skips the new tokens
    it cannot see (causally later ones, and on sliding layers those before its window). `traced=True` (the graph
    pass) loops with `scan` higher-order ops of static shapes, so the compiled graph does not grow with `n` and
    holds no host sync: there a full layer's blocks come in a few levels, each masking the later tokens up to its
    level's end instead of skipping them (`block_scan.scan_blocks`).
    """
    # The slots' head dim may be 1 (the head-pooled layout, `fxbudget.pool`: every head sees the whole pool); the
    # heads and slots each head sees are those of its positions.
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
    live = S
    if not traced and n > 1:
        check_left_padded(new_pos)  # the window is the call's last `w` queries (one token: nothing to check)
    if not traced and not bool((slot_pos >= 0).any()):
        # Eagerly, a call on an empty cache (a prefill) skips its empty slots: they would add exact zeros. The
        # compiled graph cannot branch on data and computes them.
        live = 0
    # bf16/fp16: the blocks compute in fp32 throughout, as flash attention accumulates (logits rounded to the input
    # dtype first double the error against float64). The cost: an fp32 copy of the call's K/V (slots included).
    kv = [x.to(acc) for x in (k_slots[:, :, :live], v_slots[:, :, :live], k_new, v_new)]
    blk = _Block(kv[0], kv[1], slot_pos[..., :live], kv[2], kv[3], qpos.unsqueeze(1), scale, sliding, acc)
    queries_acc = queries.to(acc)
    R = min(block or auto_block(b * q.shape[1], n, q.device), n)
    if n <= R:  # one block (a decode step, a prefill chunk): the window max from its softmax
        out, sig_s, sig_n, max_s, max_n = blk(queries_acc, qpos, weights, 0, n, win=(n - w, n))
        win_max = torch.cat([max_s, max_n], dim=-1)
    elif traced:
        out, sig_s, sig_n = _scan_blocks(blk, queries_acc, qpos, weights, R)
        win_max = window_max(blk, queries_acc, qpos, weights, w)  # the last w queries once more
    else:
        out, sig_s, sig_n, win_max = _loop_blocks(blk, queries_acc, qpos, weights, R, w)
    out = out.reshape(b, q.shape[1], n, -1).to(v_new.dtype)
    if live < S:
        sig_s = weights.new_zeros(b, h, 3, S)
        win_max = torch.cat([win_max.new_zeros(b, h, S - live), win_max], dim=-1)

    attn, window_attn, last_attn = (torch.cat([sig_s[:, :, i], sig_n[:, :, i]], dim=-1) for i in range(3))
    acc_attn = torch.cat([state, state.new_zeros(b, h, n)], dim=2).to(acc) + attn
    # Norms of cached entries were stored when they were written: no second pass over the whole K/V cache.
    key_norm = torch.cat([norms[..., 0].to(acc), torch.linalg.vector_norm(k_new, dim=-1, dtype=acc)], dim=-1)
    value_norm = torch.cat([norms[..., 1].to(acc), torch.linalg.vector_norm(v_new, dim=-1, dtype=acc)], dim=-1)
    wov_norm = torch.cat([norms[..., 2].to(acc), value_out_norms(v_new, wo, acc)], dim=-1)
    totals = signal_totals((attn, window_attn, last_attn, acc_attn, key_norm, value_norm, pos, win_max, wov_norm), acc)
    return (out, totals, attn, window_attn, last_attn, acc_attn, key_norm, value_norm, pos, queries, k_slots, k_new,
            new_pos, inv_freq, v_slots, v_new, win_max, wov_norm)


class _Block:
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
        ls = logits(self.k_slots, self.slot_pos)
        length = c1 - c0
        ln = logits(self.k_new.narrow(2, c0, length), self.new_pos.narrow(-1, c0, length))
        m = ln.amax(dim=-1, keepdim=True)
        if ls.shape[-1]:  # no slots: a prefill on an empty cache (eager)
            m = torch.maximum(ls.amax(dim=-1, keepdim=True), m)
        # A row with nothing visible (a pad) would be NaN; it attends to nothing instead (exp(-inf) = 0).
        m = m.masked_fill(m == float("-inf"), 0.0)
        es = ls.sub_(m).exp_().view(b, h, gr, -1)
        en = ln.sub_(m).exp_().view(b, h, gr, -1)
        denom = es.sum(dim=-1, keepdim=True) + en.sum(dim=-1, keepdim=True)
        # The normalization is applied to the small results ([queries, d] and the weights), not to the probabilities.
        inv = 1.0 / denom.masked_fill(denom == 0, 1.0)  # [b, h, group * R, 1]
        out = (_heads_matmul(es, self.v_slots) + en @ self.v_new.narrow(2, c0, length)) * inv
        # The three weighted sums over (group member, query) in one matmul per part: one read of the probabilities.
        wg = weights.unsqueeze(2).expand(b, 3, g, R).reshape(b, 1, 3, gr) * inv.transpose(-1, -2)
        if win is None:
            return out, wg @ es, wg @ en
        return out, wg @ es, wg @ en, *self.window_max(es, en, inv, weights[:, 1], *win)

    def window_max(self, es: Tensor, en: Tensor, inv: Tensor, in_window: Tensor, r0: int, r1: int):
        """`window_max_attn` over rows `r0:r1` of the block: the largest probability each candidate gets from one
        window query (`in_window` `[b, R]`, 0/1) and one query head of the group, `[b, h, S]` and `[b, h, new]`:
        a second read of those rows of the probabilities only."""
        b, h, gr, _ = es.shape
        R = in_window.shape[1]
        g = gr // R
        scale = (inv.view(b, h, g, R, 1) * in_window.view(b, 1, 1, R, 1))[:, :, :, r0:r1]
        return tuple((x.view(b, h, g, R, -1)[:, :, :, r0:r1] * scale).amax(dim=(2, 3)) for x in (es, en))


def _heads_matmul(a: Tensor, m: Tensor) -> Tensor:
    """`a @ m` for `a` `[b, h, rows, k]` and `m` `[b, h or 1, k, cols]`. With one head in `m` (the head pool), the
    heads are folded into `a`'s rows: one matmul over `m`, where broadcasting would copy `m` once per head."""
    b, h = a.shape[:2]
    if m.shape[1] == h:
        return a @ m
    return (a.reshape(b, 1, h * a.shape[2], a.shape[-1]) @ m).view(*a.shape[:-1], m.shape[-1])


def _loop_blocks(blk: _Block, queries: Tensor, qpos: Tensor, weights: Tensor, R: int, w: int):
    """Eager: a Python loop over blocks of `R` queries, each seeing only the new tokens it can see. `queries` is the
    signal tensor `[b, h, group * n, d]`: the blocks read it, so it is computed for every rule. The blocks holding
    the call's last `w` queries also give the window max (`_Block.window_max`)."""
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


def signal_totals(totaled: tuple[Tensor, ...], acc: torch.dtype) -> Tensor:
    """Per-call totals of the `TOTALED` signals (in that order), `[batch, kv_heads, len(TOTALED)]`."""
    return torch.stack([x.to(acc).sum(dim=-1) for x in totaled], dim=-1)


def rule_region(rule: Rule, budget: int, window: int, *signals: Tensor, floor: int | None = None) -> Tensor:
    """The only rule-specific ops: the final score of every candidate. `window` is already clamped to `n`; the
    rule sees it per row as `Signals.window`, counted over real tokens only.

    Protected candidates score +inf and empty slots -inf, so selection needs nothing else from the rule.
    The rule must not write any tensor it is handed (refused, naming the op) and must return a floating score of
    exactly the candidates' shape (refused otherwise; `rule_contract`). A NaN score (either sign) ranks lowest among
    real candidates, like -inf, and still above empty slots (ties go to the newer position; an empty slot is older than any token). Scores are
    cast to the signals' dtype (float32, float64 for float64 inputs) and ranked in float32 by `evict`: scores that
    differ only beyond float32's precision tie, and the newer candidate wins.

    `floor` (the head-pooled layout only, `fxbudget.pool`): the allocation step. Each head's best `floor` real
    candidates (in `evict`'s order) are raised to float32's largest finite value (protected ones stay +inf), so the
    pooled eviction's one top-k over every head of the layer keeps them before any other: `floor = budget` is
    uniform allocation, `AdaKV.floor(budget)` AdaKV's safeguard.
    """
    # The window as data, per row: how many of the call's real queries `window_attn` sums over. fxbudget's own
    # pads (a call padded to a shape bucket) then change nothing a rule sees (an int would be `min(window, bucket)`).
    new_pos = signals[SIGNAL_NAMES.index("new_pos")]
    rows = (new_pos >= 0).sum(-1).clamp(max=window).view(-1, 1, 1)
    h = signals[SIGNAL_NAMES.index("pos")].shape[1]
    # The head pool's slots come with one head: every head's rule sees them all (a view, not a copy).
    signals = tuple(x.expand(x.shape[0], h, *x.shape[2:]) if name in ("k_slots", "v_slots") and x.shape[1] != h
                    else x for name, x in zip(SIGNAL_NAMES, signals))
    s = Signals(*signals, budget=budget, window=rows)
    with NoMutation(rule, signals):
        score = rule.score(s)
        protect = rule.protect(s)
    check_output(rule, "the score", score, s.pos, floating=True)
    score = score.to(s.attn.dtype)
    score = score.masked_fill(score.isnan(), float("-inf"))
    if protect is not None:
        check_output(rule, "protect()", protect, s.pos, floating=False)
        score = score.masked_fill(protect, float("inf"))
    score = score.masked_fill(s.pos < 0, float("-inf"))
    if floor:
        C = score.shape[-1]
        best = _top_indices(_order_key(score, s.pos, C)[0], min(floor, C), largest=True)
        top = torch.zeros_like(s.pos, dtype=torch.bool).scatter(-1, best, True) & (s.pos >= 0) & (score < float("inf"))
        score = score.masked_fill(top, torch.finfo(torch.float32).max)
    return score


def auto_block(rows: int, n: int, device: torch.device) -> int:
    """The default query block of a call of `n` tokens with `rows` query rows per token (batch x query heads): the
    largest power of two in [16, 1024] whose [queries x new tokens] fp32 buffer stays within 8 MB on CPU (a block's
    five passes then run in cache: on the embedded model, 8K tokens took 1.6x SDPA's time with blocks of 16 and
    1.9x with 128) and 1 GB on an accelerator (fewer, larger launches). It depends on the call's length and shapes
    only, never on the rule or the number of slots (a shared prefill is branched bit-exactly).
    """
    floats = 2**21 if torch.device(device).type == "cpu" else 2**28
    fit = max(1, floats // max(1, rows * n))
    return 1 << max(4, min(10, fit.bit_length() - 1))


def check_block(block) -> None:
    """`block` is None (`auto_block`) or an int >= 2 (a block of one query is one loop step per token: never
    useful)."""
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 2):
        raise ValueError(f"block must be None (automatic) or an int >= 2 (queries per block of the measure phase), "
                         f"got {block!r}")
