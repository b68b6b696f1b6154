"""`budget_attention`: the shared kernel's one entry, its three phases (`fxbudget.kernel`) in order on either cache
layout (per-head slots, or the head pool of `fxbudget.pool`), for one layer and one call.

The eager path (`fxbudget.eager`), shared-prefill replays (`harness.branch`) and the tests call it; the SDPA pass
splices the same phases into the traced graph. Its own module so that the kernel's phases and the layouts import
each other in one direction only (kernel <- pool <- here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel import DEFAULT_BLOCK, DEFAULT_WINDOW, SIGNAL_NAMES, check_block, measure, rule_region
from .kernel_signals import unknown_wo
from .pool import attend_pooled
from .rules.base import Rule
from .selection import evict


def budget_attention(
    q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor, totals: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor | None = None, wo: Tensor | None = None,
    owner: Tensor | None = None, *,
    rule: Rule, budget: int, keep: int | None = None, sliding: int = 0, window: int = DEFAULT_WINDOW,
    scale: float | None = None, block: int | None = DEFAULT_BLOCK, pooled: bool = False,
) -> Tensor:
    """Budget-aware attention for one layer and one call; updates the slot tensors in place.

    Args:
        q: queries `[batch, q_heads, n, head_dim]` (post-RoPE), as given to SDPA.
        k_slots, v_slots: cached keys/values `[batch, kv_heads, S, head_dim]` (post-RoPE); written in place.
        pos_slots: original positions `[batch, kv_heads, S]`, -1 = empty; written in place.
        state: accumulated attention mass `[batch, kv_heads, S]` (float32); written in place.
        norms: |k|_2, |v|_2 and |W_o v|_2 (`wov_norm`) of the cached entries `[batch, kv_heads, S, 3]`; in place.
        totals: `[batch, kv_heads, len(TOTALED)]`, receives each signal's total over the candidates of this call.
        k_new, v_new: this call's keys/values `[batch, kv_heads, n, head_dim]`.
        new_pos: positions of the new tokens `[batch, n]` (`[n]`: the same for every row); -1 marks a pad, which
            is never visible, never kept and asks nothing (its output row is zero).
        inv_freq: RoPE inverse frequencies `[head_dim // 2]` (a signal; NaN = unknown, the default).
        wo: the layer's output projection as `wov_norm` reads it, `[kv_heads, v_head_dim, group * v_head_dim]`
            (`kernel_signals.out_projection_factors` of `o_proj.weight`; None = unknown: NaN).
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
    if wo is None:
        wo = unknown_wo(k_new.shape[1], q.shape[1] // k_new.shape[1], v_new.shape[-1], k_slots.device)
    if new_pos.dim() == 1:
        new_pos = new_pos.expand(k_slots.shape[0], -1)
    if pooled:
        return attend_pooled(q, k_slots, v_slots, pos_slots, state, norms, totals, k_new, v_new, new_pos, inv_freq,
                             wo, owner, rule=rule, budget=budget, keep=budget if keep is None else keep,
                             sliding=sliding, window=window, scale=scale, block=block)
    out, new_totals, *signals = measure(q, k_slots, v_slots, pos_slots, state, norms, k_new, v_new, new_pos,
                                        inv_freq, wo, window=window, sliding=sliding, scale=scale, block=block)
    score = rule_region(rule, budget, min(window, k_new.shape[2]), *signals)
    sig = dict(zip(SIGNAL_NAMES, signals))
    evict(score, sig["pos"], sig["acc_attn"], sig["key_norm"], sig["value_norm"], sig["wov_norm"], new_totals,
          k_slots, v_slots, pos_slots, state, norms, totals, k_new, v_new, keep=budget if keep is None else keep)
    return out
