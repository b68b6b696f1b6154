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
from ..backend import kernel_window
from ..cache import MARKER_TENSORS, BudgetCache
from ..eager import recording
from ..budget_attention import budget_attention
from ..kernel import DEFAULT_BLOCK, DEFAULT_WINDOW, SIGNAL_NAMES, TOTALED, evict, rule_region, signal_totals
from ..pool import evict_pooled, head_view
from ..rules import Rule, get
from ..rules.base import Signals

_K, _V, _P = (MARKER_TENSORS.index(n) for n in ("k_new", "v_new", "new_pos"))
_SLOT_TENSORS = ("k_slots", "v_slots")  # signals that are the cache's own tensors: the branched cache's, not recorded
_PER_CANDIDATE = ("attn", "window_attn", "last_attn", "acc_attn", "key_norm", "value_norm", "pos", "window_max_attn",
                  "wov_norm")


@dataclass
class _Recorder(Rule):
    """Stores the new tokens' part of each call's signals (its own eviction is irrelevant)."""

    name = "recorder"
    window: int = DEFAULT_WINDOW
    signals: list = field(default_factory=list, repr=False)

    def score(self, s: Signals) -> Tensor:
        S = s.k_slots.shape[2]
        self.signals.append({n: getattr(s, n)[..., S:] if n in _PER_CANDIDATE else getattr(s, n)
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
                   block: int | None = DEFAULT_BLOCK) -> SharedPrefill:
    """Run `model` once on `input_ids` (unmodified HF causal LM, one call on an empty cache) and record it.

    Args:
        model: the unmodified model (not compiled by fxbudget); it runs fxbudget's eager kernel.
        input_ids: `[batch, n]`, the whole prefill in one call.
        window: the observation window the recorded signals use; rules with another window replay the kernel.
        block: the kernel's query block (branched caches equal separate runs with the same block).
    Returns:
        A `SharedPrefill`. It holds every layer's queries and new keys/values (memory ~ n x layers x heads).
    """
    n = input_ids.shape[1]
    recorder = _Recorder(window=window)
    # One slot per layer: what the record cache keeps does not matter (only its sliding layers are reused), and the
    # new tokens' signals do not depend on the number of empty slots; fewer slots make the recorded forward cheaper.
    fx_compile(model, rule=recorder, budget=1, backend=None, block=block)
    try:
        cache = model.forward.new_cache(input_ids.shape[0])
        with torch.no_grad(), recording() as calls:
            out = model(input_ids=input_ids, cache=cache, logits_to_keep=1)  # fxbudget takes either name
    finally:
        model.forward.restore()
    return SharedPrefill(calls=calls, signals=recorder.signals, cache=cache, logits=out.logits[:, -1], n=n,
                         window=window, block=block)


def branch(prefill: SharedPrefill, cache: BudgetCache, rule: Rule | str) -> None:
    """Put `cache` (empty) in exactly the state a separate prefill with `rule` would leave it in.

    Args:
        prefill: from `shared_prefill` on the same model and batch size.
        cache: an empty BudgetCache for that model (its layer budgets, head-room and `keep` are used).
        rule: the rule to evict with.
    """
    if cache.tokens_seen:
        raise ValueError("branch() needs an empty cache")
    if cache.signature != prefill.cache.signature or cache.batch_size != prefill.cache.batch_size:
        raise ValueError("branch() needs a cache for the model and batch size of the shared prefill")
    rule = get(rule)
    window = kernel_window(rule)
    cache.admit(prefill.n)
    signals = iter(prefill.signals)
    sliding_rule = get("window")
    with torch.no_grad():
        for query, call, scale in prefill.calls:
            layer, t = cache.layers[call.layer], call.tensors
            layer.seen.add_(prefill.n)
            if window != prefill.window:  # the recorded signals are for another window: replay the kernel call
                budget_attention(query, layer.keys, layer.values, layer.pos, layer.state, layer.norms,
                                 layer.totals, t[_K], t[_V], t[_P], layer.inv_freq, layer.wo, layer.owner,
                                 rule=sliding_rule if layer.sliding else rule, budget=layer.budget, keep=layer.keep,
                                 sliding=layer.sliding, window=window, scale=scale, block=prefill.block,
                                 pooled=layer.pooled)
                if not layer.sliding:
                    next(signals)
                continue
            if layer.sliding:  # sliding layers run the `window` rule whatever the rule: the same state for all
                layer.load(prefill.cache.layers[call.layer].snapshot())
                continue
            rec = next(signals)
            _evict_from_signals(rec, layer, rule, window, t[_V])
    cache.next_pos.copy_(prefill.cache.next_pos)


def _evict_from_signals(rec: dict, layer, rule: Rule, window: int, v_new: Tensor) -> None:
    """`rule_region` + `evict` of the kernel on the recorded signals, the empty slots' part filled in as `measure`
    computes it for empty slots: zero attention and norms, the carried state (zero), position -1. A head-pooled
    layer's slots are seen per head (`fxbudget.pool`), as `measure_pooled` hands them to the rule."""
    pos, state, norms = layer.pos, layer.state, layer.norms
    keys, values, slots = layer.keys, layer.values, layer.slots
    if layer.pooled:
        b, h, S, d = keys.shape
        pos, state, norms = (head_view(x, layer.owner, e) for x, e in ((pos, -1), (state, 0.0), (norms, 0.0)))
        keys = keys.view(b, 1, h * S, d).expand(b, h, h * S, d)
        values = values.view(b, 1, h * S, values.shape[-1]).expand(b, h, h * S, values.shape[-1])
        slots = h * S
    slot_part = {"pos": pos, "acc_attn": state, "key_norm": norms[..., 0], "value_norm": norms[..., 1],
                 "wov_norm": norms[..., 2]}
    sig = {}
    for name in SIGNAL_NAMES:
        if name in _PER_CANDIDATE:
            new = rec[name]
            part = slot_part.get(name)
            part = torch.zeros_like(new[..., :1]).expand(*new.shape[:-1], slots) if part is None \
                else part.to(new.dtype)
            sig[name] = torch.cat([part, new], dim=-1)
        else:
            sig[name] = {"k_slots": keys, "v_slots": values}[name] if name in _SLOT_TENSORS else rec[name]
    n = rec["k_new"].shape[2]
    floor = {"floor": rule.head_floor(layer.budget)} if layer.pooled else {}
    score = rule_region(rule, layer.budget, min(window, n), *sig.values(), **floor)
    totals = signal_totals(tuple(sig[name] for name in TOTALED), sig["attn"].dtype)
    args = (score, sig["pos"], sig["acc_attn"], sig["key_norm"], sig["value_norm"], sig["wov_norm"], totals,
            layer.keys, layer.values, layer.pos, layer.state, layer.norms, layer.totals, rec["k_new"], v_new)
    if layer.pooled:
        evict_pooled(*args, layer.owner, keep=layer.keep)
    else:
        evict(*args, keep=layer.keep)

