"""Shared prefill: run a one-call prefill once, then branch the cache for each rule and budget.

In a call on an empty cache the kernel attends exactly over the new tokens and evicts only afterwards, so every
layer's output, hence the whole forward, is bit-identical for every rule and budget (empty slots add exact zeros).
Only the eviction differs. `shared_prefill` runs the forward once and records, per layer, the kernel's inputs and the
signals it measured over the new tokens; `branch` then runs only the rule's score and the shared `evict` on each
rule's cache, with the signals of its empty slots filled in exactly as `measure` computes them. A rule that asks for
another observation window replays the whole kernel call on the recorded queries instead (also exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..api import compile as fx_compile
from ..compiler.backend import kernel_window
from ..cache.budget_cache import BudgetCache
from ..passes.eager import recording
from ..kernel import (DEFAULT_BLOCK, DEFAULT_WINDOW, SIGNAL_NAMES, TOTALED, LayerConstants, attend, from_marker,
                      layout, select, signal_totals)
from ..kernel.settings import MEASURED_SIGNALS, MeasureSpec
from ..kernel.signal_set import run_signals
from ..kernel.signals import TOKEN_SIGNALS
from ..kernel.slot_storage import stored_slots
from ..rules import Rule, get
from ..rules.base import Signals

_SLOT_TENSORS = ("k_slots", "v_slots")  # signals that are the cache's own tensors: the branched cache's, not recorded


@dataclass
class _Recorder(Rule):
    """Stores the new tokens' part of each call's signals (its own eviction is irrelevant)."""

    name = "recorder"
    window: int = DEFAULT_WINDOW
    signals: list = field(default_factory=list, repr=False)

    def score(self, s: Signals) -> Tensor:
        S = s.k_slots.shape[2]
        self.signals.append({n: getattr(s, n)[..., S:] if n in TOTALED else getattr(s, n)
                             for n in SIGNAL_NAMES if n not in _SLOT_TENSORS})
        return s.pos.float()


@dataclass
class SharedPrefill:
    """One prefill: each layer's kernel call `(query, MarkerCall, scale)`, the new tokens' signals of each
    full-attention layer (in call order), the record cache (for sliding layers), last-position logits, length."""

    calls: list
    signals: list
    cache: BudgetCache
    logits: Tensor
    n: int
    window: int
    block: int


def shared_prefill(model: nn.Module, input_ids: Tensor, *, window: int = DEFAULT_WINDOW,
                   block: int | None = DEFAULT_BLOCK, slot_dtype: str = "model") -> SharedPrefill:
    """Run `model` once on `input_ids` (unmodified HF causal LM, one call on an empty cache) and record it.

    Args:
        model: the unmodified model (not compiled by fxbudget); it runs fxbudget's eager kernel.
        input_ids: `[batch, n]`, the whole prefill in one call.
        window: the observation window the recorded signals use; rules with another window replay the kernel.
        block: the kernel's query block (branched caches equal separate runs with the same block).
        slot_dtype: the slot storage of the caches to branch into (`fxbudget.compile`'s): the recorded per-token
            signals are then of the values those slots store, as a separate prefill measures them.
    Returns:
        A `SharedPrefill`. It holds every layer's queries and new keys/values (memory ~ n x layers x heads).
    """
    n = input_ids.shape[1]
    recorder = _Recorder(window=window)
    # One slot per layer: what the record cache keeps does not matter (only its sliding layers are reused), and the
    # new tokens' signals do not depend on the number of empty slots; fewer slots make the recorded forward cheaper.
    # Every signal (`branch` drops those outside a run's set); "all" also spares the recorder a dry run.
    fx_compile(model, rule=recorder, budget=1, backend=None, block=block, signals="all", progress=False,
               slot_dtype=slot_dtype)
    try:
        cache = model.forward.new_cache(input_ids.shape[0])
        with torch.no_grad(), recording() as calls:
            out = model(input_ids=input_ids, cache=cache, logits_to_keep=1)  # fxbudget takes either name
    finally:
        model.forward.restore()
    return SharedPrefill(calls=calls, signals=recorder.signals, cache=cache, logits=out.logits[:, -1], n=n,
                         window=window, block=block)


def branch(prefill: SharedPrefill, cache: BudgetCache, rule: Rule | str, signals=None) -> None:
    """Put `cache` (empty) in exactly the state a separate prefill with `rule` would leave it in.

    Args:
        prefill: from `shared_prefill` on the same model and batch size.
        cache: an empty BudgetCache for that model (its layer budgets, head-room and `keep` are used).
        rule: the rule to evict with.
        signals: the run's signal set, as for `fxbudget.compile` (None: what `rule` reads). The prefill recorded
            every signal; those outside the set are dropped before the rule region, as that kernel leaves them out.
    """
    if cache.tokens_seen:
        raise ValueError("branch() needs an empty cache")
    if cache.slot_dtype != prefill.cache.slot_dtype:  # recorded norms (and sliding layers) are of stored values
        raise ValueError(f"branch() into {cache.slot_dtype} slots needs a shared prefill recorded for them "
                         f"(shared_prefill(..., slot_dtype={cache.slot_dtype!r}); this one: "
                         f"{prefill.cache.slot_dtype!r})")
    if cache.signature != prefill.cache.signature or cache.batch_size != prefill.cache.batch_size:
        raise ValueError("branch() needs a cache for the model and batch size of the shared prefill")
    rule = get(rule)
    window = kernel_window(rule)
    spec = MeasureSpec(signals=run_signals([rule], signals))
    cache.admit(prefill.n)
    signals = iter(prefill.signals)
    sliding_rule = get("window")
    with torch.no_grad():
        for query, call, scale in prefill.calls:
            layer = cache.layers[call.layer]
            _, new, _ = from_marker(call.tensors)
            layer.seen.add_(prefill.n)
            if window != prefill.window:  # the recorded signals are for another window: replay the kernel call
                attend(query, layer.kernel_slots(), new, LayerConstants(layer.inv_freq, layer.wo),
                       rule=sliding_rule if layer.sliding else rule, budget=layer.budget, keep=layer.keep,
                       pooled=layer.pooled, sliding=layer.sliding, window=window, scale=scale, block=prefill.block,
                       measure=spec)
                if not layer.sliding:
                    next(signals)
                continue
            if layer.sliding:  # sliding layers run the `window` rule whatever the rule: the same state for all
                layer.load(prefill.cache.layers[call.layer].snapshot())
                _unmeasured_cleared(layer, spec.signals)
                continue
            _evict_from_signals(next(signals), layer, new, rule, window, spec.signals)
    cache.next_pos.copy_(prefill.cache.next_pos)


def _evict_from_signals(rec: dict, layer, new, rule: Rule, window: int, measured: frozenset) -> None:
    """The kernel's rule region and `evict` (`kernel.select`) on the recorded signals, the slots' part filled in as
    `measure` computes it for empty slots: zero attention, the carried state and cached per-token signals (zeros),
    position -1, each as the layer's layout hands its slots to `measure` (`Layout.view`)."""
    lay = layout(layer.pooled)
    slots = layer.kernel_slots()
    view = lay.view(stored_slots(slots, new))  # quantized slots: the rule reads the values they store
    slot_part = {"pos": view.pos, "acc_attn": view.state, "k_slots": view.keys, "v_slots": view.values,
                 **{name: view.norms[..., i] for i, name in enumerate(TOKEN_SIGNALS)}}
    sig = {}
    for name in SIGNAL_NAMES:
        if name in MEASURED_SIGNALS and name not in measured:
            continue  # outside the run's signal set: left out, as its kernel leaves it out
        if name in TOTALED:
            recorded = rec[name]
            part = slot_part.get(name)
            part = torch.zeros_like(recorded[..., :1]).expand(*recorded.shape[:-1], view.pos.shape[-1]) \
                if part is None else part.to(recorded.dtype)
            sig[name] = torch.cat([part, recorded], dim=-1)
        else:
            sig[name] = slot_part[name] if name in _SLOT_TENSORS else rec[name]
    select(lay, rule, sig, signal_totals(sig), slots, new, budget=layer.budget, keep=layer.keep, window=window)


def _unmeasured_cleared(layer, measured: frozenset) -> None:
    """A layer loaded from the prefill (which measured every signal) as a kernel measuring `measured` leaves it
    after one call on an empty cache: the carried state 0 without `acc_attn`, a per-token signal's cached column
    and a signal's total 0 outside the set (`kernel.pipeline.evict_inputs`, `kernel.measure.signal_totals`)."""
    if "acc_attn" not in measured:
        layer.state.zero_()
    for i, name in enumerate(TOKEN_SIGNALS):
        if name not in measured:
            layer.norms[..., i].zero_()
    for i, name in enumerate(TOTALED):
        if name in MEASURED_SIGNALS and name not in measured:
            layer.totals[..., i].zero_()
