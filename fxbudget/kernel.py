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
from torch import Tensor

from .rule_contract import NoMutation, RuleContractError, check_output  # noqa: F401 (RuleContractError: re-export)
from .rules.base import Rule, Signals

DEFAULT_WINDOW = 32  # observation window shared by all rules of a run (snapkv's paper default)

# Names of the tensors `measure` returns after the attention output and the totals: the `Signals` tensor fields.
SIGNAL_NAMES = (
    "attn", "window_attn", "last_attn", "acc_attn", "key_norm", "value_norm", "pos", "queries", "k_slots", "k_new",
    "new_pos", "inv_freq",
)
# The computed signals whose per-call totals are stored (`BudgetLayer.totals`, `[batch, kv_heads, 8]`). Storing them
# makes every signal a live value for every rule: dead-code elimination cannot give one rule a cheaper kernel.
TOTALED = ("attn", "window_attn", "last_attn", "acc_attn", "key_norm", "value_norm", "pos")


def measure(
    q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor, *, window: int, sliding: int,
    scale: float | None,
) -> tuple[Tensor, ...]:
    """Attention output `[batch, q_heads, n, head_dim]`, signal totals, then the signal tensors (`SIGNAL_NAMES`)."""
    b, h, S, d = k_slots.shape
    n = k_new.shape[2]
    hq = q.shape[1]
    g = hq // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    pos = torch.cat([pos_slots, new_pos.view(1, 1, n).expand(b, h, n)], dim=2)
    # Query head j*h_group.. of KV head i: rows (group member, query) of one matrix per KV head.
    queries = q.reshape(b, h, g * n, q.shape[-1])
    # Visibility is compared in int32 (positions stay far below 2^31): the compiled softmax loop evaluates it per
    # (query, candidate), and int32 vectorizes twice as wide as int64.
    qpos = new_pos.to(torch.int32).repeat(g).view(1, 1, g * n, 1)
    slot_pos = pos_slots.to(torch.int32).unsqueeze(2)
    new_cand = new_pos.to(torch.int32).view(1, 1, 1, n)
    vis_s = (slot_pos >= 0) & (slot_pos <= qpos)
    vis_n = (new_cand >= 0) & (new_cand <= qpos)
    if sliding:
        vis_s = vis_s & (slot_pos > qpos - sliding)
        vis_n = vis_n & (new_cand > qpos - sliding)
    # Slots and new tokens stay separate all the way (logits, softmax, signals): concatenating K/V would copy the
    # whole cache, and concatenating the [queries, candidates] logits or probabilities costs a full extra pass.
    # The softmax over both parts is torch.softmax's formula, exp(x - max) / sum, computed piecewise.
    acc = torch.promote_types(k_slots.dtype, torch.float32)  # softmax and signals in fp32 (fp64 for fp64 inputs)
    ls = ((queries @ k_slots.transpose(-1, -2)).to(acc) * scale).masked_fill(~vis_s, float("-inf"))
    ln = ((queries @ k_new.transpose(-1, -2)).to(acc) * scale).masked_fill(~vis_n, float("-inf"))
    m = torch.maximum(ls.amax(dim=-1, keepdim=True), ln.amax(dim=-1, keepdim=True))
    # A row with nothing visible would be NaN; it attends to nothing instead (exp(-inf) = 0 over a finite max).
    m = m.masked_fill(m == float("-inf"), 0.0)
    es, en = torch.exp(ls - m), torch.exp(ln - m)
    denom = es.sum(dim=-1, keepdim=True) + en.sum(dim=-1, keepdim=True)
    denom = denom.masked_fill(denom == 0, 1.0)
    ps, pn = es / denom, en / denom
    out = ps.to(v_slots.dtype) @ v_slots + pn.to(v_new.dtype) @ v_new
    out = out.view(b, h, g, n, -1).reshape(b, hq, n, -1)

    w = min(window, n)

    def per_candidate(f):
        """`f` of the `[b, h, group, n, candidates]` probabilities, slots then new tokens on the last dim."""
        return torch.cat([f(ps.view(b, h, g, n, S)), f(pn.view(b, h, g, n, n))], dim=-1)

    attn = per_candidate(lambda x: x.sum(dim=(2, 3)))
    window_attn = per_candidate(lambda x: x[:, :, :, n - w:].sum(dim=(2, 3)))
    last_attn = per_candidate(lambda x: x[:, :, :, n - 1].sum(dim=2))
    acc_attn = torch.cat([state, state.new_zeros(b, h, n)], dim=2).to(acc) + attn
    # Norms of cached entries were stored when they were written: no second pass over the whole K/V cache.
    key_norm = torch.cat([norms[..., 0].to(acc), torch.linalg.vector_norm(k_new, dim=-1, dtype=acc)], dim=-1)
    value_norm = torch.cat([norms[..., 1].to(acc), torch.linalg.vector_norm(v_new, dim=-1, dtype=acc)], dim=-1)
    totals = signal_totals((attn, window_attn, last_attn, acc_attn, key_norm, value_norm, pos), acc)
    return (out, totals, attn, window_attn, last_attn, acc_attn, key_norm, value_norm, pos, queries, k_slots, k_new,
            new_pos, inv_freq)


def signal_totals(totaled: tuple[Tensor, ...], acc: torch.dtype) -> Tensor:
    """Per-call totals of the `TOTALED` signals (in that order), `[batch, kv_heads, len(TOTALED)]`."""
    return torch.stack([x.to(acc).sum(dim=-1) for x in totaled], dim=-1)


def rule_region(rule: Rule, budget: int, window: int, *signals: Tensor) -> Tensor:
    """The only rule-specific ops: the final score of every candidate. `window` is already clamped to `n`.

    Protected candidates score +inf and empty slots -inf, so selection needs nothing else from the rule.
    The rule must not write any tensor it is handed (refused, naming the op) and must return a floating score of
    exactly the candidates' shape (refused otherwise; `rule_contract`). A NaN score (either sign) ranks lowest among
    real candidates, like -inf, and still above empty slots (ties go to the newer position; an empty slot is older than any token). Scores are
    cast to the signals' dtype (float32, float64 for float64 inputs) and ranked in float32 by `evict`: scores that
    differ only beyond float32's precision tie, and the newer candidate wins.
    """
    s = Signals(*signals, budget=budget, window=window)
    with NoMutation(rule, signals):
        score = rule.score(s)
        protect = rule.protect(s)
    check_output(rule, "the score", score, s.pos, floating=True)
    score = score.to(s.attn.dtype)
    score = score.masked_fill(score.isnan(), float("-inf"))
    if protect is not None:
        check_output(rule, "protect()", protect, s.pos, floating=False)
        score = score.masked_fill(protect, float("inf"))
    return score.masked_fill(s.pos < 0, float("-inf"))


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
    k_new: Tensor, v_new: Tensor, *, keep: int,
) -> None:
    """Keep the best `keep` candidates and write the surviving new tokens into freed slots, in place."""
    b, h, S, _ = k_slots.shape
    n = k_new.shape[2]
    C = S + n
    dev = pos.device

    # One exact total order: score, then the newer position; among empty slots the lowest index goes first.
    # Scores map to order-preserving int32 (flip the magnitude bits of negatives) and share an int64 with the
    # tie-breaker, so one top-k finds the `C - keep` candidates to drop: linear time, deterministic.
    bits = score.float().view(torch.int32)
    order_key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    idx = torch.arange(C, device=dev)
    tie = torch.where(pos >= 0, pos + C, idx)
    dropped = _top_indices(order_key * 2**32 + tie, C - keep, largest=False)
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
    state.copy_(refill(acc_attn[..., :S], acc_attn, 0.0))
    norms.copy_(torch.stack([refill(x[..., :S], x, 0.0) for x in (key_norm, value_norm)], dim=-1))
    totals_buf.copy_(totals)


def budget_attention(
    q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor, totals: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor | None = None, *,
    rule: Rule, budget: int, keep: int | None = None, sliding: int = 0, window: int = DEFAULT_WINDOW,
    scale: float | None = None,
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
        new_pos: positions of the new tokens `[n]` (the same for every row: no padding).
        inv_freq: RoPE inverse frequencies `[head_dim // 2]` (a signal; NaN = unknown, the default).
        rule: the scoring rule. budget: the layer's budget, for rules.
        keep: how many candidates to keep (default `budget`; all `S` slots while eviction is frozen).
        sliding: sliding-window size for sliding layers, 0 for full attention.
        window: observation window for `window_attn`. scale: softmax scale (None = 1/sqrt(head_dim)).

    Returns:
        The attention output `[batch, q_heads, n, head_dim]`, exact over the visible candidates.
    """
    if inv_freq is None:
        inv_freq = torch.full((k_slots.shape[-1] // 2,), float("nan"), device=k_slots.device)
    out, new_totals, *signals = measure(q, k_slots, v_slots, pos_slots, state, norms, k_new, v_new, new_pos,
                                        inv_freq, window=window, sliding=sliding, scale=scale)
    score = rule_region(rule, budget, min(window, k_new.shape[2]), *signals)
    sig = dict(zip(SIGNAL_NAMES, signals))
    evict(score, sig["pos"], sig["acc_attn"], sig["key_norm"], sig["value_norm"], new_totals,
          k_slots, v_slots, pos_slots, state, norms, totals, k_new, v_new, keep=budget if keep is None else keep)
    return out
