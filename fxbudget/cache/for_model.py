"""A model's `BudgetCache`: built for its config, dtype, per-layer devices and the rule's per-layer budgets, and the
checks that a cache handed to a compiled forward was built that way."""

from __future__ import annotations

import torch
from torch import nn

from .budget_cache import BudgetCache, _layer_shapes
from .rope import model_rope
from ..rules import Rule


def layer_budgets(rule: Rule, budget: int, config, prompt: int | None = None) -> list[int] | None:
    """The rule's per-layer budgets for this model's full-attention layers (None = uniform), for a prefill of
    `prompt` tokens when known."""
    return rule.layer_budgets(budget, _layer_shapes(config)[4].count("full_attention"), prompt=prompt)


def resolve_head_pool(rule: Rule, head_pool: bool | None) -> bool:
    """The cache layout a run of `rule` uses: `head_pool`, or (None) the head-pooled layout iff the rule is
    head-adaptive (`AdaKV`). A uniform rule may run pooled; a head-adaptive one needs the pool.

    Raises:
        ValueError: `head_pool` not a bool or None, or False for a head-adaptive rule.
    """
    if head_pool is not None and not isinstance(head_pool, bool):
        raise ValueError(f"head_pool must be True, False or None (pooled iff the rule is head-adaptive), "
                         f"got {head_pool!r}")
    adaptive = rule.head_adaptive
    if head_pool is False and adaptive:
        raise ValueError(f"rule {rule.name!r} spreads the budget over heads and needs the head-pooled cache layout: "
                         "pass head_pool=True or None")
    return adaptive if head_pool is None else head_pool


def check_rule_budget(rule: Rule, budget: int, config, prompt: int | None = None) -> None:
    """A head-adaptive rule's check of its layer budgets against the tokens it protects per head (no-op for the
    others): before any model work."""
    rule.check_budget(layer_budgets(rule, budget, config, prompt) or [budget])


def layer_devices(model: nn.Module) -> list[torch.device]:
    """Where each decoder layer computes its keys, so where its cache slots must live: the device of the layer's
    weights, or the execution device accelerate dispatches an offloaded layer to. A model on one device gives that
    device for every layer; one loaded with `device_map="auto"` gives each layer its own.

    Args:
        model: a transformers causal LM (its `config` gives the number of layers).
    Returns:
        One `torch.device` per decoder layer.
    Raises:
        NotImplementedError: the model is spread over devices (`hf_device_map`) but its decoder layers cannot be
            found (`model.get_decoder().layers`).
    """
    n_layers = _layer_shapes(model.config)[0]
    first = next(model.parameters()).device
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) != n_layers:
        if len(set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))) > 1:
            raise NotImplementedError("this model is spread over devices (hf_device_map) but fxbudget cannot find its "
                                      "decoder layers (model.get_decoder().layers) to put each layer's cache on its "
                                      "device; load it on one device")
        return [first] * n_layers
    devices = []
    for layer in layers:
        executes = getattr(getattr(layer, "_hf_hook", None), "execution_device", None)  # accelerate offloading
        p = next(layer.parameters(), None)
        devices.append(torch.device(executes) if executes is not None else p.device if p is not None else first)
    return devices


def _where(devices: list[torch.device]) -> str:
    return str(devices[0]) if len(set(devices)) == 1 else "layers' devices " + ", ".join(map(str, devices))


def model_cache(model: nn.Module, rule: Rule, budget: int, batch_size: int = 1, *,
                headroom: int = 0, prompt: int | None = None, head_pool: bool | None = None,
                interval: int = 1, slot_dtype: str | None = None) -> BudgetCache:
    """A fresh `BudgetCache` for `model` (its config, dtype and each layer's device, `layer_devices`) and `rule`'s
    per-layer budgets, sized for a prefill of `prompt` tokens when given (schedules such as pyramidkv's adapt to it;
    None = the fixed schedule), in the layout `resolve_head_pool(rule, head_pool)`, evicting decode steps every
    `interval` steps (`BudgetCache`)."""
    if getattr(model, "config", None) is None:
        raise ValueError("this model has no .config: pass a fxbudget.BudgetCache(config, budget) explicitly")
    pooled = resolve_head_pool(rule, head_pool)
    check_rule_budget(rule, budget, model.config, prompt)
    p = next(model.parameters())
    cache = BudgetCache(model.config, budget, batch_size, dtype=p.dtype, device=layer_devices(model),
                        headroom=headroom, layer_budgets=layer_budgets(rule, budget, model.config, prompt),
                        head_pool=pooled, interval=interval, slot_dtype=slot_dtype)
    cache.sized_for_prompt = prompt  # what BudgetForward checks its layer budgets against
    cache.set_rope(model_rope(model))  # the model's own frequencies (llama3, YaRN, linear, ...), not the config's
    cache.set_output_projections([w if w is not None and w.device == d else None  # offloaded weights: unknown
                                  for w, d in zip(output_projections(model), cache.devices)])
    return cache


def output_projections(model: nn.Module) -> list[torch.Tensor | None]:
    """Each decoder layer's attention output projection weight (`o_proj.weight`, `[hidden, q_heads * head_dim]`),
    found as the attention modules that carry a `layer_idx` and a linear `o_proj` (every transformers decoder that
    names it so); None for every layer when they cannot all be found (the `wov_norm` signal is then unknown)."""
    n_layers, _, head_dim, heads, _ = _layer_shapes(model.config)
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        proj, idx = getattr(module, "o_proj", None), getattr(module, "layer_idx", None)
        if isinstance(proj, nn.Linear) and isinstance(idx, int) and proj.weight.shape[1] == heads * head_dim:
            found[idx] = proj.weight
    if sorted(found) != list(range(n_layers)):
        return [None] * n_layers
    return [found[i] for i in range(n_layers)]


def check_cache(cache: BudgetCache, model: nn.Module, rule: Rule, budget: int, batch: int,
                head_pool: bool | None = None, slot_dtype: str = "model") -> None:
    """Raise a ValueError unless `cache` was built for `model`, `rule`'s per-layer budgets, `budget` and `batch`
    rows, with the model's dtype and each layer's device, in the layout `resolve_head_pool(rule, head_pool)`."""
    pooled = resolve_head_pool(rule, head_pool)
    if cache.head_pool != pooled:
        layout = {True: "head-pooled", False: "unpooled (slots)"}
        raise ValueError(f"cache layout is {layout[cache.head_pool]}, the compiled run's is {layout[pooled]}: build "
                         f"it with model.forward.new_cache() or BudgetCache(..., head_pool={pooled})")
    if cache.budget != budget:
        raise ValueError(f"cache budget {cache.budget} differs from the compiled budget {budget}")
    if cache.slot_dtype != slot_dtype:
        raise ValueError(f"cache slots store {cache.slot_dtype}, the compiled run's store {slot_dtype}: build it "
                         f"with model.forward.new_cache() or BudgetCache(..., slot_dtype={slot_dtype!r})")
    if cache.batch_size != batch:
        raise ValueError(f"cache was built for batch size {cache.batch_size}, input has {batch}")
    config = getattr(model, "config", None)
    if config is not None and cache.signature != _layer_shapes(config):
        raise ValueError("cache was built for another model (layers/heads/head_dim differ)")
    if rule.needs_rope and not cache.has_rope:
        raise ValueError(f"rule {rule.name!r} needs RoPE frequencies this cache does not have: build it with "
                         "model.forward.new_cache(), or call cache.set_rope(fxbudget.cache.rope.model_rope(model))")
    if rule.needs_wo and not cache.has_wo:
        raise ValueError(f"rule {rule.name!r} needs each layer's output projection (W_o) and this cache has none: "
                         "build it with model.forward.new_cache(), or call cache.set_output_projections("
                         "fxbudget.cache.for_model.output_projections(model))")
    prompt = getattr(cache, "sized_for_prompt", None)  # None for an explicitly built cache: the fixed schedule
    expected = layer_budgets(rule, budget, config, prompt) if config is not None else None
    if expected is not None and cache.layer_budgets != expected:
        raise ValueError(f"rule {rule.name!r} needs per-layer budgets {expected}; this cache has "
                         f"{cache.layer_budgets}: build it with model.forward.new_cache() (new_cache(prompt=n) "
                         "for a schedule sized for an n-token prompt) or BudgetCache(..., layer_budgets=...)")
    p = next(model.parameters(), None)
    if p is not None:
        # Each layer's slots on that layer's device (one device, or several with device_map="auto").
        devices = layer_devices(model) if config is not None else [p.device] * len(cache.devices)
        if cache.dtype != p.dtype or cache.devices != devices:
            raise ValueError(f"cache is {cache.dtype} on {_where(cache.devices)}, model is {p.dtype} on "
                             f"{_where(devices)}; build it with model.forward.new_cache() or BudgetCache(..., "
                             "dtype=, device=) matching the model (device=fxbudget.api.layer_devices(model): "
                             "one per layer)")
