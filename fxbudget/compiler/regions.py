"""How fxbudget hands a model to Dynamo: one compiled region per decoder-layer configuration, or the whole forward.

Compiling the whole forward traces, rewrites and lowers every decoder layer again (24 times for the embedded model),
although the layers are structurally identical. For models with a list of decoder layers (`model.get_decoder()
.layers`, every transformers decoder), each layer's forward instead calls a `torch.compile`d function whose code
object is shared by all layers of one configuration; Dynamo then reuses one graph for all of them. The outer loop
(embedding, RoPE tables, final norm, LM head) runs eagerly: it is a few ops per call.

What makes the layers' graphs equal: attention calls `past_key_values.update(k, v, self.layer_idx)`, and an int that
reaches the graph is a guard (one graph per layer). Each compiled layer therefore receives a `LayerCacheView` of its
own cache layer, whose `update` ignores the index and marks the call with layer -1 (`BudgetLayer.mark`).

Each configuration (layer type, budget, sliding window) gets its own code object, hence its own Dynamo cache: layers
with other per-layer budgets (pyramidkv) or sliding windows (Gemma 3) compile their own region without piling onto
one cache up to the recompile limit. Every call of `compiled_forward` gets fresh code objects, freed with it.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from typing import Any, Callable

import torch
from torch import nn

from .buckets import MAX_GRAPHS_PER_REGION
from ..cache.budget_cache import BudgetCache, BudgetLayer
from ..cache.keyword import NAMES as _CACHE_KWARGS  # `cache` from transformers 5.24 on, `past_key_values` before

_CODE_IDS = itertools.count()


def _fresh(fn: Callable, name: str) -> Callable:
    """`fn` with a code object of its own: Dynamo keeps compiled graphs (and counts recompiles) per code object."""
    code = fn.__code__.replace(co_name=f"{name}_{next(_CODE_IDS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _compile(fn: Callable, backend) -> Callable:
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def _strict():
    """Past the recompile limit: an error, never a silent eager fallback (for fxbudget's own calls only). The limit
    is the number of graphs the shape buckets can need (`fxbudget.compiler.buckets.MAX_GRAPHS_PER_REGION`), not Dynamo's 8:
    a region serves every bucket of both eviction modes."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=MAX_GRAPHS_PER_REGION)


def _entry(forward, kwargs):
    return forward(**kwargs)


def whole_model_forward(forward: Callable, backend) -> Callable[..., Any]:
    """`torch.compile` of `forward(**kwargs)` as one graph, through an entry function with its own code object."""
    entry = _compile(_fresh(_entry, "fxbudget_forward"), backend)

    def run(**kwargs):
        with _strict():
            return entry(forward, kwargs)

    return run


class LayerCacheView:
    """What a compiled decoder layer sees as its cache: one `BudgetLayer`; `update` ignores the layer index (the
    marker gets -1, the same in every layer's trace).

    Only `update` is provided: a decoder layer that reads other cache attributes cannot be compiled per layer (pass
    such a model through the whole-model path, `fxbudget.compiler.regions.whole_model_forward`)."""

    def __init__(self, layer: BudgetLayer):
        self.layer = layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.layer.mark(key_states, value_states, -1)


def _region(layer: nn.Module, args: tuple, kwargs: dict):
    # The class's forward, not the instance attribute (which is the wrapper calling this).
    return type(layer).forward(layer, *args, **kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module] | None:
    """The model's decoder layers, layer `i` reading cache layer `i`; None if the model has no such list."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    config = getattr(model, "config", None)
    if not isinstance(layers, nn.ModuleList) or config is None or len(layers) == 0:
        return None
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if len(layers) != cfg.num_hidden_layers:
        return None
    for i, layer in enumerate(layers):
        idx = {m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)}
        if idx - {i}:  # a layer that indexes another cache layer (KV sharing): keep the whole-model path
            return None
    return list(layers)


@contextlib.contextmanager
def _collector_readable():
    """transformers' output-capturing hooks (`output_hidden_states=`, `output_attentions=`) read a ContextVar, which
    Dynamo cannot trace; the outer forward sets it eagerly, so for the duration of a compiled layer the collector
    serves its current value as the plain attribute it uses while compiling."""
    collector = _output_collector()
    if collector is None or getattr(collector, "compiling", True):
        yield
        return
    collector.global_var, collector.compiling = collector.get(), True
    try:
        yield
    finally:
        collector.global_var, collector.compiling = None, False


def _output_collector():
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    return getattr(output_capturing, "_active_collector", None)


class CompiledLayers:
    """Decoder layers whose forwards run compiled regions while `installed()`; one code object per configuration."""

    def __init__(self, layers: list[nn.Module], backend, on_layer: Callable[[tuple], None] | None = None,
                 cudagraphs: bool = False):
        self.layers, self.backend, self.on_layer, self.cudagraphs = layers, backend, on_layer, cudagraphs
        self._regions: dict[tuple, Callable] = {}

    @staticmethod
    def key(layer: nn.Module, cache_layer: BudgetLayer) -> tuple:
        """A layer's configuration: layers with equal keys share one code object, hence their graphs."""
        return (type(layer), cache_layer.budget, cache_layer.sliding)

    def region(self, layer: nn.Module, cache_layer: BudgetLayer) -> Callable:
        key = self.key(layer, cache_layer)
        if key not in self._regions:
            self._regions[key] = _compile(_fresh(_region, "fxbudget_layer"), self.backend)
        return self._regions[key]

    def _wrapper(self, i: int, layer: nn.Module) -> Callable:
        def forward(*args, **kwargs):
            # GPT-NeoX, GPT-BigCode: the model passes its cache to each layer as `layer_past`
            name = next((k for k in (*_CACHE_KWARGS, "layer_past") if isinstance(kwargs.get(k), BudgetCache)), None)
            if name is None:
                raise RuntimeError(f"fxbudget: decoder layer {i} was called without the BudgetCache as a keyword "
                                   f"argument ({' or '.join(_CACHE_KWARGS)}); it cannot be compiled per layer")
            cache_layer = kwargs[name].layers[i]
            with _collector_readable():
                out = self.region(layer, cache_layer)(layer, args, {**kwargs, name: LayerCacheView(cache_layer)})
            if self.cudagraphs:
                # Layers of one configuration replay one CUDA graph, whose outputs live in its static buffers: the
                # next layer's replay would overwrite this one's hidden states while the model still reads them
                # (measured on an H200, torch 2.11: "accessing tensor output of CUDAGraphs that has been
                # overwritten"). A copy of one decode step's hidden states per layer is small.
                out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
            if self.on_layer is not None:
                self.on_layer(self.key(layer, cache_layer))
            return out

        return forward

    @contextlib.contextmanager
    def installed(self):
        """Route every decoder layer's forward through its compiled region for the duration (nothing persists)."""
        for i, layer in enumerate(self.layers):
            layer.forward = self._wrapper(i, layer)
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward


def compiled_forward(model: nn.Module, forward: Callable, backend,
                     on_layer: Callable[[tuple], None] | None = None, cudagraphs: bool = False) -> Callable[..., Any]:
    """`forward(**kwargs)` (the model's unmodified forward) with its attention compiled by `backend`.

    Per-layer regions when the model has a list of decoder layers (see the module docstring), else one whole-model
    graph. Each call returns a runner with its own Dynamo caches. `on_layer(key)` is called after each decoder
    layer's region ran (`CompiledLayers.key`; never on the whole-model path). `cudagraphs`: the backend wraps graphs
    in CUDA graphs (each region's outputs are then copied out of the graph's buffers).
    """
    layers = decoder_layers(model)
    if layers is None or any("forward" in vars(layer) for layer in layers):
        return whole_model_forward(forward, backend)
    compiled = CompiledLayers(layers, backend, on_layer, cudagraphs=cudagraphs)

    def run(**kwargs):
        with compiled.installed(), _strict():
            return forward(**kwargs)

    run.layers = compiled
    return run
