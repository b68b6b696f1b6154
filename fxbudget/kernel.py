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
   positions and the carried state (accumulated attention) are updated.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.scan import scan_op

from .rule_contract import NoMutation, RuleContractError, check_output  # noqa: F401 (RuleContractError: re-export)
from .rules.base import Rule, Signals

DEFAULT_WINDOW = 32  # observation window shared by all rules of a run (snapkv's paper default)
# Queries per block of `measure`: a kernel setting shared by every rule (None = `auto_block`). A call's attention
# temporaries are O(block x candidates) whatever its length.
DEFAULT_BLOCK = None

# Names of the tensors `measure` returns after the attention output and the totals: the `Signals` tensor fields.
SIGNAL_NAMES = (
    "attn", "window_attn", "last_attn", "acc_attn", "key_norm", "value_norm", "pos", "queries", "k_slots", "k_new",
    "new_pos", "inv_freq", "v_slots", "v_new",
)
# The computed signals whose per-call totals are stored (`BudgetLayer.totals`, `[batch, kv_heads, 8]`). Storing them
# makes every signal a live value for every rule: dead-code elimination cannot give one rule a cheaper kernel.
TOTALED = ("attn", "window_attn", "last_attn", "acc_attn", "key_norm", "value_norm", "pos")


def measure(
    q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor, *, window: int, sliding: int,
    scale: float | None, block: int | None = DEFAULT_BLOCK, traced: bool = False,
) -> tuple[Tensor, ...]:
    """Attention output `[batch, q_heads, n, head_dim]`, signal totals, then the signal tensors (`SIGNAL_NAMES`).

    The call's queries are processed in blocks of `block` positions (`attend_block`), so temporaries are
    O(block x candidates), never O(n x candidates). Eagerly (a Python loop over blocks) a block skips the new tokens
    it cannot see (causally later ones, and on sliding layers those before its window). `traced=True` (the graph
    pass) loops with a `scan` higher-order op of static shapes, so the compiled graph does not grow with `n` and
    holds no host sync: there a full layer's block masks the later tokens instead of skipping them (`_scan_blocks`).
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
    if n <= R:
        out, sig_s, sig_n = blk(queries_acc, qpos, weights, 0, n)
    elif traced:
        out, sig_s, sig_n = _scan_blocks(blk, queries_acc, qpos, weights, R)
    else:
        out, sig_s, sig_n = _loop_blocks(blk, queries_acc, qpos, weights, R)
    out = out.reshape(b, q.shape[1], n, -1).to(v_new.dtype)
    if live < S:
        sig_s = weights.new_zeros(b, h, 3, S)

    attn, window_attn, last_attn = (torch.cat([sig_s[:, :, i], sig_n[:, :, i]], dim=-1) for i in range(3))
    acc_attn = torch.cat([state, state.new_zeros(b, h, n)], dim=2).to(acc) + attn
    # Norms of cached entries were stored when they were written: no second pass over the whole K/V cache.
    key_norm = torch.cat([norms[..., 0].to(acc), torch.linalg.vector_norm(k_new, dim=-1, dtype=acc)], dim=-1)
    value_norm = torch.cat([norms[..., 1].to(acc), torch.linalg.vector_norm(v_new, dim=-1, dtype=acc)], dim=-1)
    totals = signal_totals((attn, window_attn, last_attn, acc_attn, key_norm, value_norm, pos), acc)
    return (out, totals, attn, window_attn, last_attn, acc_attn, key_norm, value_norm, pos, queries, k_slots, k_new,
            new_pos, inv_freq, v_slots, v_new)


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

    def __call__(self, qb: Tensor, qpos: Tensor, weights: Tensor, c0, c1):
        """`qb` `[b, h, group * R, d]` (group-major rows), `qpos` `[b, R]`, `weights` `[b, 3, R]`; new tokens
        `c0:c1` are the candidates besides the slots. Returns the output `[b, h, group * R, dv]` and the weighted
        attention sums (`[b, h, 3, S]` over slots, `[b, h, 3, c1 - c0]` over the new tokens)."""
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
        return out, wg @ es, wg @ en


def _heads_matmul(a: Tensor, m: Tensor) -> Tensor:
    """`a @ m` for `a` `[b, h, rows, k]` and `m` `[b, h or 1, k, cols]`. With one head in `m` (the head pool), the
    heads are folded into `a`'s rows: one matmul over `m`, where broadcasting would copy `m` once per head."""
    b, h = a.shape[:2]
    if m.shape[1] == h:
        return a @ m
    return (a.reshape(b, 1, h * a.shape[2], a.shape[-1]) @ m).view(*a.shape[:-1], m.shape[-1])


def _loop_blocks(blk: _Block, queries: Tensor, qpos: Tensor, weights: Tensor, R: int):
    """Eager: a Python loop over blocks of `R` queries, each seeing only the new tokens it can see. `queries` is the
    signal tensor `[b, h, group * n, d]`: the blocks read it, so it is computed for every rule."""
    b, h, S = blk.slot_pos.shape
    n = qpos.shape[1]
    g = queries.shape[2] // n
    q5 = queries.view(b, h, g, n, queries.shape[-1])
    out = queries.new_empty(b, h, g, n, blk.v_slots.shape[-1])
    sig_s = weights.new_zeros(b, h, 3, S)
    sig_n = weights.new_zeros(b, h, 3, n)
    for r0 in range(0, n, R):
        r1 = min(r0 + R, n)
        c0, c1 = _visible_range(r0, r1, n, blk.sliding)
        o, s_s, s_n = blk(q5[:, :, :, r0:r1].reshape(b, h, g * (r1 - r0), -1), qpos[:, r0:r1], weights[..., r0:r1],
                          c0, c1)
        out[:, :, :, r0:r1] = o.view(b, h, g, r1 - r0, -1)
        sig_s += s_s
        sig_n[..., c0:c1] += s_n
    return out, sig_s, sig_n


def _visible_range(r0, r1, n: int, sliding: int):
    """New tokens `c0:c1` that queries `r0:r1` of a call may see: none after the block (causal) and, on a sliding
    layer, none `sliding` or more before its first query. Positions of a row's valid tokens are consecutive and
    pads are never visible, so index distance is position distance."""
    return (max(r0 - sliding + 1, 0) if sliding else 0), min(r1, n)


def _scan_blocks(blk: _Block, queries: Tensor, qpos: Tensor, weights: Tensor, R: int):
    """Traced: the same blocks as one `scan` over blocks (Inductor lowers it to a loop), so the graph holds one
    block's ops whatever `n`. Every shape in the body is static and nothing in it is read back to the host: on a full
    layer each block attends over all `n` new tokens, the causally later ones masked by position; on a sliding
    layer over a band of `block + sliding - 1` new tokens ending at its last query, gathered at a data offset (a
    gather, not a data-dependent size). The queries are padded to whole blocks with pads (position -1)."""
    b, h, S = blk.slot_pos.shape
    n = qpos.shape[1]
    g = queries.shape[2] // n
    nb = -(-n // R)
    pad = nb * R - n
    d = queries.shape[-1]
    q5 = F.pad(queries.view(b, h, g, n, d), (0, 0, 0, pad))
    band = R + blk.sliding - 1 if blk.sliding else nb * R
    lead = blk.sliding - 1 if band < nb * R else 0  # new tokens a block's band reaches before its first query
    if lead:
        # Pad the new tokens by `lead` invisible entries (position -1) in front, so block i's band is
        # [i * R, i * R + band) of the padded tokens: in range for every block, no clamping.
        k_new, v_new = (F.pad(x, (0, 0, lead, pad)) for x in (blk.k_new, blk.v_new))
        new_pos = F.pad(blk.new_pos, (lead, pad), value=-1)
    else:
        band = n
        k_new, v_new, new_pos = blk.k_new, blk.v_new, blk.new_pos
    # Block-major and contiguous: a scan traces its body on a contiguous slice, so every slice must be one.
    xs = [x.contiguous() for x in (
        q5.view(b, h, g, nb, R, d).permute(3, 0, 1, 2, 4, 5).reshape(nb, b, h, g * R, d),
        F.pad(qpos, (0, pad), value=-1).view(b, nb, R).transpose(0, 1),
        F.pad(weights, (0, pad)).view(b, 3, nb, R).permute(2, 0, 1, 3),
        torch.arange(nb, device=queries.device) * R)]
    offsets = torch.arange(band, device=queries.device)

    def body(sig_s, sig_n, qb, qp, wb, start, k_slots, v_slots, slot_pos, kn, vn, np_, offs):
        # The slots and new tokens come in as the scan's additional inputs: a scan body may not close over tensors.
        if lead:
            idx = start + offs  # the block's band of padded new tokens: a data offset, a static length
            kn, vn, np_ = kn.index_select(2, idx), vn.index_select(2, idx), np_.index_select(-1, idx)
        inner = _Block(k_slots, v_slots, slot_pos, kn, vn, np_, blk.scale, blk.sliding, blk.acc)
        o, s_s, s_n = inner(qb, qp, wb, 0, band)
        if lead:
            # Each index of the band once: a gather, an add and a scatter of distinct entries (deterministic).
            s_n = sig_n.index_select(-1, idx) + s_n
            return sig_s + s_s, sig_n.index_copy(-1, idx, s_n), o
        return sig_s + s_s, sig_n + s_n, o

    init = [weights.new_zeros(b, h, 3, S), weights.new_zeros(b, h, 3, lead + nb * R if lead else n)]
    sig_s, sig_n, ys = scan_op(body, init, xs, (blk.k_slots, blk.v_slots, blk.slot_pos, k_new, v_new, new_pos,
                                                offsets))
    if lead:
        sig_n = sig_n[..., lead:lead + n]
    dv = ys.shape[-1]
    out = ys.view(nb, b, h, g, R, dv).permute(1, 2, 3, 0, 4, 5).reshape(b, h, g, nb * R, dv)[:, :, :, :n]
    return out, sig_s, sig_n


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


def _top_indices(x: Tensor, k: int, *, largest: bool) -> Tensor:
    """`torch.topk(x, k, dim=-1, largest=largest).indices`. For k = 1 (every decode step) an arg-reduction instead,
    which Inductor fuses into its own loops rather than calling ATen's top-k: the keys ranked for dropping are unique,
    and where `dst`/`src` tie (no free slot / nothing to write) the write of that row is a no-op either way."""
    if k == 1:
        return (x.argmax if largest else x.argmin)(dim=-1, keepdim=True)
    return torch.topk(x, k, dim=-1, largest=largest).indices


def evict(
    score: Tensor, pos: Tensor, acc_attn: Tensor, key_norm: Tensor, value_norm: Tensor, totals: Tensor,
    k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor, totals_buf: Tensor,
    k_new: Tensor, v_new: Tensor, *, keep: int, owner: Tensor | None = None, cand_owner: Tensor | None = None,
    tie_pos: Tensor | None = None,
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
    norms.copy_(torch.stack([refill(x[..., :S], x, 0.0) for x in (key_norm, value_norm)], dim=-1))
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


def budget_attention(
    q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor, totals: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor | None = None, owner: Tensor | None = None, *,
    rule: Rule, budget: int, keep: int | None = None, sliding: int = 0, window: int = DEFAULT_WINDOW,
    scale: float | None = None, block: int | None = DEFAULT_BLOCK, pooled: bool = False,
) -> Tensor:
    """Budget-aware attention for one layer and one call; updates the slot tensors in place.

    Args:
        q: queries `[batch, q_heads, n, head_dim]` (post-RoPE), as given to SDPA.
        k_slots, v_slots: cached keys/values `[batch, kv_heads, S, head_dim]` (post-RoPE); written in place.
        pos_slots: original positions `[batch, kv_heads, S]`, -1 = empty; written in place.
        state: accumulated attention mass `[batch, kv_heads, S]` (float32); written in place.
        norms: key and value L2 norms of the cached entries `[batch, kv_heads, S, 2]`; written in place.
        totals: `[batch, kv_heads, len(TOTALED)]`, receives each signal's total over the candidates of this call.
        k_new, v_new: this call's keys/values `[batch, kv_heads, n, head_dim]`.
        new_pos: positions of the new tokens `[batch, n]` (`[n]`: the same for every row); -1 marks a pad, which
            is never visible, never kept and asks nothing (its output row is zero).
        inv_freq: RoPE inverse frequencies `[head_dim // 2]` (a signal; NaN = unknown, the default).
        rule: the scoring rule. budget: the layer's budget, for rules.
        keep: how many candidates to keep (default `budget`; all `S` slots while eviction is frozen).
        sliding: sliding-window size for sliding layers, 0 for full attention.
        window: observation window for `window_attn`. scale: softmax scale (None = 1/sqrt(head_dim)).
        block: queries per block of the measure phase (memory is O(block x candidates)).
        owner: the KV head each slot's entry belongs to `[batch, kv_heads, S]` (int32, -1 = free); read and written
            only with `pooled`.
        pooled: the head-pooled layout (`fxbudget.pool`): the `kv_heads x S` slots of a row are one pool, spread
            over the heads by the allocation step (`rule.floor(budget)` for a head-adaptive rule, else `budget`).

    Returns:
        The attention output `[batch, q_heads, n, head_dim]`, exact over the visible candidates.
    """
    check_block(block)
    if inv_freq is None:
        inv_freq = torch.full((k_slots.shape[-1] // 2,), float("nan"), device=k_slots.device)
    if new_pos.dim() == 1:
        new_pos = new_pos.expand(k_slots.shape[0], -1)
    if pooled:
        from .pool import attend_pooled  # the pooled phases build on this module's

        return attend_pooled(q, k_slots, v_slots, pos_slots, state, norms, totals, k_new, v_new, new_pos, inv_freq,
                             owner, rule=rule, budget=budget, keep=budget if keep is None else keep,
                             sliding=sliding, window=window, scale=scale, block=block)
    out, new_totals, *signals = measure(q, k_slots, v_slots, pos_slots, state, norms, k_new, v_new, new_pos,
                                        inv_freq, window=window, sliding=sliding, scale=scale, block=block)
    score = rule_region(rule, budget, min(window, k_new.shape[2]), *signals)
    sig = dict(zip(SIGNAL_NAMES, signals))
    evict(score, sig["pos"], sig["acc_attn"], sig["key_norm"], sig["value_norm"], new_totals,
          k_slots, v_slots, pos_slots, state, norms, totals, k_new, v_new, keep=budget if keep is None else keep)
    return out
