"""The one pipeline: `measure` -> rule region -> `evict`, on either layout, for one layer and one call.

Every caller runs these three phase functions and nothing else: the eager path (`fxbudget.passes.eager`, through
`attend`), the SDPA pass (`fxbudget.passes.sdpa` traces each phase with `make_fx` and splices it into the graph),
shared-prefill branching (`harness.branch`: the rule region and `evict` on recorded signals, through `select`),
likelihood scratch calls and kvzip's replay (both run the model, so the eager path or a compiled graph).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..rules.base import Rule
from .evict import EVICT_READS
from .layouts import Layout, layout
from .measure import measure
from .rule_region import rule_region
from .settings import DEFAULT_BLOCK, DEFAULT_MEASURE, DEFAULT_WINDOW, check_block, check_measure
from .signals import unknown_wo
from .state import LayerConstants, LayerSlots, NewTokens


def measure_phase(lay: Layout, q: Tensor, slots: LayerSlots, new: NewTokens, const: LayerConstants, *,
                  window: int, sliding: int, scale: float | None, block: int | None, traced: bool = False,
                  empty: bool = False, form: str = DEFAULT_MEASURE):
    """Phase 1: `measure` over the slots as the layout hands them, in `form` (`settings.measure_form`). Returns
    `(out, totals, signals)`."""
    return measure(q, lay.view(slots), new, const, window=window, sliding=sliding, scale=scale, block=block,
                   traced=traced, empty=empty, form=form)


def rule_phase(lay: Layout, rule: Rule, budget: int, window: int, signals: dict[str, Tensor]) -> Tensor:
    """Phase 2, the rule region: the rule's score, then the layout's allocation step."""
    return rule_region(rule, budget, window, signals, floor=lay.floor(rule, budget))


def evict_phase(lay: Layout, score: Tensor, signals: dict[str, Tensor], totals: Tensor, slots: LayerSlots,
                new: NewTokens, *, keep: int) -> None:
    """Phase 3: keep `keep` entries per head (the layer's `h x keep` on the head pool), in place."""
    lay.evict(score, evict_inputs(lay, signals, slots), totals, slots, new, keep=keep)


def evict_inputs(lay: Layout, signals: dict[str, Tensor], slots: LayerSlots) -> dict[str, Tensor]:
    """`signals` with what `evict` writes back of a signal outside the run's set (`EVICT_READS`): `acc_attn` as the
    carried state unchanged (new tokens' 0: not updated by a kernel that does not measure attention), a per-token
    signal as zeros in its cached column."""
    missing = [name for name in EVICT_READS if name not in signals]
    if not missing:
        return signals
    pos = signals["pos"]
    acc = torch.promote_types(signals["k_new"].dtype, torch.float32)
    n = signals["new_pos"].shape[-1]
    done = dict(signals)
    for name in missing:
        if name == "acc_attn":
            state = lay.view(slots).state
            done[name] = torch.cat([state, state.new_zeros(*state.shape[:-1], n)], dim=-1).to(acc)
        else:
            done[name] = torch.zeros(pos.shape, dtype=acc, device=pos.device)
    return done


def select(lay: Layout, rule: Rule, signals: dict[str, Tensor], totals: Tensor, slots: LayerSlots, new: NewTokens,
           *, budget: int, keep: int, window: int) -> None:
    """Phases 2 and 3 on signals measured before (a shared prefill's, `harness.branch`)."""
    evict_phase(lay, rule_phase(lay, rule, budget, window, signals), signals, totals, slots, new, keep=keep)


def attend(q: Tensor, slots: LayerSlots, new: NewTokens, const: LayerConstants, *, rule: Rule, budget: int,
           keep: int, pooled: bool = False, sliding: int = 0, window: int = DEFAULT_WINDOW,
           scale: float | None = None, block: int | None = DEFAULT_BLOCK, empty: bool = False,
           measure: str = DEFAULT_MEASURE) -> Tensor:
    """The three phases in order, eagerly; returns the attention output and updates `slots` in place."""
    lay = layout(pooled)
    out, totals, signals = measure_phase(lay, q, slots, new, const, window=window, sliding=sliding, scale=scale,
                                         block=block, empty=empty, form=measure)
    select(lay, rule, signals, totals, slots, new, budget=budget, keep=keep, window=window)
    return out


def budget_attention(
    q: Tensor, k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor, totals: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor | None = None, wo: Tensor | None = None,
    owner: Tensor | None = None, *,
    rule: Rule, budget: int, keep: int | None = None, sliding: int = 0, window: int = DEFAULT_WINDOW,
    scale: float | None = None, block: int | None = DEFAULT_BLOCK, pooled: bool = False,
    measure: str = DEFAULT_MEASURE,
) -> Tensor:
    """`attend` on loose tensors (tests, benchmarks, a cache of one's own); updates the slot tensors in place.

    Args:
        q: queries `[batch, q_heads, n, head_dim]` (post-RoPE), as given to SDPA.
        k_slots, v_slots, pos_slots, state, norms, totals, owner: the layer's slots (`LayerSlots`: keys, values,
            pos, state, norms, totals, owner). `owner` is read and written only with `pooled` (required then).
        k_new, v_new: this call's keys/values `[batch, kv_heads, n, head_dim]`.
        new_pos: positions of the new tokens `[batch, n]` (`[n]`: the same for every row); -1 marks a pad, which
            is never visible, never kept and asks nothing (its output row is zero).
        inv_freq: RoPE inverse frequencies `[head_dim // 2]` (a signal; NaN = unknown, the default).
        wo: the layer's output projection as `wov_norm` reads it, `[kv_heads, v_head_dim, group * v_head_dim]`
            (`signals.out_projection_factors` of `o_proj.weight`; None = unknown: NaN).
        rule: the scoring rule. budget: the layer's budget, for rules.
        keep: how many candidates to keep (default `budget`; all `S` slots while eviction is frozen).
        sliding: sliding-window size for sliding layers, 0 for full attention.
        window: observation window for `window_attn`. scale: softmax scale (None = 1/sqrt(head_dim)).
        block: queries per block of the measure phase (memory is O(block x candidates)).
        measure: the measure phase's form: "auto" (the default: "flex" on CUDA, "blocks" elsewhere), "blocks" or "flex"
            (`settings.measure_form`; the same signals either way where verified).
        pooled: the head-pooled layout (`layouts.HeadPool`): the `kv_heads x S` slots of a row are one pool, spread
            over the heads by the allocation step (`rule.head_floor(budget)`).

    Returns:
        The attention output `[batch, q_heads, n, head_dim]`, exact over the visible candidates.
    """
    check_block(block)
    check_measure(measure)
    if pooled and owner is None:
        raise ValueError("budget_attention(pooled=True) needs the slots' owner tensor")
    if owner is None:
        owner = torch.arange(k_slots.shape[1], dtype=torch.int32, device=k_slots.device).view(1, -1, 1).expand(
            pos_slots.shape)
    if inv_freq is None:
        inv_freq = torch.full((k_slots.shape[-1] // 2,), float("nan"), device=k_slots.device)
    if wo is None:
        wo = unknown_wo(k_new.shape[1], q.shape[1] // k_new.shape[1], v_new.shape[-1], k_slots.device)
    if new_pos.dim() == 1:
        new_pos = new_pos.expand(k_slots.shape[0], -1)
    return attend(q, LayerSlots(k_slots, v_slots, pos_slots, state, norms, totals, owner),
                  NewTokens(k_new, v_new, new_pos), LayerConstants(inv_freq, wo), rule=rule, budget=budget,
                  keep=budget if keep is None else keep, pooled=pooled, sliding=sliding, window=window, scale=scale,
                  block=block, measure=measure)
