"""`fxbudget.compile`, `fxbudget.inspect`, `fxbudget.kernel_fingerprint`: the public entry points."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .backend import INNER_BACKENDS, NoBudgetAttentionError, kernel_window, make_backend
from .cache import BudgetCache, _layer_shapes
from .eager import BudgetAttentionMode
from .passes.sdpa import REGION_KEY
from .regions import compiled_forward
from .rules import Rule, get

log = logging.getLogger("fxbudget")

# transformers' own SDPA attention under a name it has no mask function for: models then build no 4-D mask (it
# would be unused, since visibility comes from positions, and shaped as if every layer held as many slots as layer 0,
# which per-layer budgets break). The SDPA call itself is unchanged: it is what the pass rewrites.
ATTN_IMPLEMENTATION = "fxbudget_sdpa"
AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)


def _check_int(name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _validate(model: nn.Module, budget: int, backend: str | None, chunk_size: int | None) -> None:
    """Every check that can fail before the model is touched (DESIGN §7)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxbudget.compile expects a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model.forward, BudgetForward):
        raise ValueError("this model is already compiled by fxbudget; call model.forward.restore() first")
    _check_int("budget", budget)
    if chunk_size is not None:
        _check_int("chunk_size", chunk_size)
    if backend is not None and backend not in INNER_BACKENDS:
        raise ValueError(f"backend must be one of {INNER_BACKENDS} or None (no torch.compile), got {backend!r}")
    config = getattr(model, "config", None)
    if config is None:
        return  # a custom module that builds its own BudgetCache
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "sdpa"):
        raise ValueError(
            f"fxbudget needs SDPA attention, this model uses {impl!r}: load it with attn_implementation='sdpa' "
            "or call model.set_attn_implementation('sdpa') first")
    _layer_shapes(config)  # raises for layer types fxbudget cannot budget
    max_pos = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_pos is not None and budget > max_pos:
        warnings.warn(f"budget {budget} exceeds the model's max_position_embeddings {max_pos}; "
                      "the cache will never be full", stacklevel=3)


def compile(model: nn.Module, rule: str | Rule = "snapkv", budget: int = 1024, *, chunk_size: int | None = None,
            backend: str | None = "inductor", headroom: int = 0, cudagraphs: bool = False,
            **rule_params) -> nn.Module:
    """Run `model` with a KV cache of at most `budget` entries per layer and KV head, evicting with `rule`.

    The model is modified in place (its `forward` is wrapped) and returned; `model.forward.restore()` undoes it.
    Every rule runs the same kernel; only its scoring ops differ.

    Args:
        model: a Hugging Face causal LM using SDPA attention, or any module that calls
            `scaled_dot_product_attention` on keys/values from a `BudgetCache` passed as `past_key_values`.
        rule: a registered rule name (`fxbudget.rules.available()`) or a `Rule` instance.
        budget: KV entries kept per full-attention layer and KV head.
        chunk_size: split inputs longer than this into chunks, so prefill memory is bounded by budget + chunk_size.
        backend: "inductor" (default), "aot_eager" or "eager" (Dynamo backends, same semantics), or None to run the
            kernel eagerly without torch.compile (the reference path).
        headroom: extra slots for caches created automatically (see `BudgetCache.frozen`).
        cudagraphs: with backend "inductor" on CUDA, replay the compiled graphs as CUDA graphs (mark the cache tensors
            with `torch._dynamo.mark_static_address`, or Inductor skips CUDA graphs for graphs that write them).
        **rule_params: hyperparameters of a named rule, e.g. `window=64` for snapkv.

    Returns:
        The same model, whose forward (and therefore `generate`) now uses the budget cache.
    """
    _validate(model, budget, backend, chunk_size)
    rule_obj = get(rule, **rule_params)
    _check_int("headroom", headroom, 0)
    if rule_obj.needs_rope and getattr(model, "config", None) is not None \
            and not BudgetCache(model.config, 1).has_rope:
        raise ValueError(f"rule {rule_obj.name!r} needs the model's RoPE frequencies, and this model does not use "
                         "default RoPE on its full-attention layers")
    return BudgetForward(model, rule_obj, budget, chunk_size=chunk_size, backend=backend, headroom=headroom,
                         cudagraphs=cudagraphs).install()


def frozen_runner(model: nn.Module, backend: str, window: int, *, cudagraphs: bool = False,
                  on_graph: Callable[[fx.GraphModule], None] | None = None) -> Callable[..., Any]:
    """A compiled runner of `model` for frozen calls, to share between forwards (`BudgetForward.share_frozen`).

    Args:
        model: the model (not compiled by fxbudget at the time of the call, or its original forward is used).
        backend: "inductor", "aot_eager" or "eager". window: the observation window of the forwards that share it
            (the signal totals stored in the cache depend on it). cudagraphs: as for `compile`.
        on_graph: called with each rewritten graph it compiles.
    Returns:
        A callable with the signature of `BudgetForward._run`. Its graphs carry the `window` rule's scoring ops: in a
        frozen call no score decides anything (see `share_frozen`).
    """
    forward = model.forward.original if isinstance(model.forward, BudgetForward) else model.forward
    return compiled_forward(model, forward, make_backend("window", inner=backend, on_graph=on_graph,
                                                         cudagraphs=cudagraphs, window=window))


def _layer_budgets(rule: Rule, budget: int, config) -> list[int] | None:
    """The rule's per-layer budgets for this model's full-attention layers (None = uniform)."""
    return rule.layer_budgets(budget, _layer_shapes(config)[4].count("full_attention"))


def model_cache(model: nn.Module, rule: Rule, budget: int, batch_size: int = 1, *,
                headroom: int = 0) -> BudgetCache:
    """A fresh `BudgetCache` for `model` (its config, dtype and device) and `rule`'s per-layer budgets."""
    if getattr(model, "config", None) is None:
        raise ValueError("this model has no .config: pass a fxbudget.BudgetCache(config, budget) explicitly")
    p = next(model.parameters())
    return BudgetCache(model.config, budget, batch_size, dtype=p.dtype, device=p.device, headroom=headroom,
                       layer_budgets=_layer_budgets(rule, budget, model.config))


class BudgetForward:
    """The wrapped forward of a model compiled by fxbudget (installed as `model.forward`)."""

    def __init__(self, model: nn.Module, rule: Rule, budget: int, *, chunk_size: int | None,
                 backend: str | None, headroom: int, cudagraphs: bool = False):
        """Build the forward of `model` (not yet installed: see `install`); the compiled graphs live here, so a
        forward installed, restored and installed again keeps them."""
        self.model, self.rule, self.budget = model, rule, budget
        self.chunk_size, self.backend, self.headroom = chunk_size, backend, headroom
        self.window = kernel_window(rule)
        self.original = model.forward
        self.graphs: list[fx.GraphModule] = []  # rewritten graphs compiled so far (one per region and input shape)
        self._verified = False
        self._checked_cache: BudgetCache | None = None
        self._sliding_rule = get("window")  # the rule of sliding-window layers (eager path)
        if backend is None:
            self._run = self._run_eager
        else:
            self._run = compiled_forward(model, self.original, make_backend(
                rule, inner=backend, on_graph=self.graphs.append, cudagraphs=cudagraphs))

    def install(self) -> nn.Module:
        """Make this the model's forward (and its attention fxbudget's maskless SDPA); returns the model."""
        model = self.model
        if isinstance(model.forward, BudgetForward):
            raise ValueError("this model is already compiled by fxbudget; call model.forward.restore() first")
        self._instance_forward = vars(model).get("forward")  # usually None: forward comes from the class
        config = getattr(model, "config", None)
        self._attn_implementation = getattr(config, "_attn_implementation", None)
        if self._attn_implementation is not None:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        gen_cfg = getattr(model, "generation_config", None)
        self._disable_compile = getattr(gen_cfg, "disable_compile", None)
        if gen_cfg is not None:
            gen_cfg.disable_compile = True  # generate() must not compile the forward again with its own settings
        model.forward = self
        return model

    def share_frozen(self, runner: Callable[..., Any]) -> None:
        """Run this forward's frozen calls (`BudgetCache.frozen`) with `runner` (from `frozen_runner`), shared with
        other rules' forwards of the same model and observation window.

        A frozen call evicts nothing the rule chooses: `admit` guarantees an empty slot for every new token, empty
        slots score -inf and rank below every token, so the candidates dropped are the lowest-index empty slots
        whatever the scores; attention, signals and the state written do not depend on the rule either. Every rule's
        frozen call therefore computes the same thing, and one compiled graph per shape serves them all (a comparison
        compiles its question and decode graphs once per budget, not once per rule and budget).
        """
        if self.backend is None:
            raise ValueError("share_frozen() is for compiled forwards (backend is None)")
        own = self._run

        def run(**kwargs):
            frozen = any(isinstance(v, BudgetCache) and v._frozen for v in kwargs.values())
            return (runner if frozen else own)(**kwargs)

        self._run = run

    def _run_eager(self, *args, **kwargs):
        with BudgetAttentionMode(self.rule, self.window, self._sliding_rule) as mode:
            out = self.original(*args, **kwargs)
        if mode.pending:  # the same failure the graph pass reports when it finds no SDPA to rewrite
            raise NoBudgetAttentionError(
                f"keys/values of BudgetCache layers {sorted(set(mode.pending.values()))} never reached "
                "scaled_dot_product_attention; fxbudget can only budget attention computed by SDPA")
        return out

    def restore(self) -> nn.Module:
        """Put the original forward back; returns the model."""
        if self._instance_forward is None:
            del self.model.forward
        else:
            self.model.forward = self._instance_forward
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.disable_compile = self._disable_compile
        if self._attn_implementation is not None:
            self.model.set_attn_implementation(self._attn_implementation)
        self._checked_cache = None  # do not hold the last cache while not installed
        return self.model

    def new_cache(self, batch_size: int = 1, *, headroom: int | None = None) -> BudgetCache:
        """A fresh `BudgetCache` for this model (its dtype and device)."""
        return model_cache(self.model, self.rule, self.budget, batch_size,
                           headroom=self.headroom if headroom is None else headroom)

    def _resolve_cache(self, cache, batch: int) -> BudgetCache:
        if cache is None or (isinstance(cache, DynamicCache) and int(cache.get_seq_length()) == 0):
            return self.new_cache(batch)  # generate() hands an empty DynamicCache on its first call
        if not isinstance(cache, BudgetCache):
            raise TypeError(f"past_key_values must be a fxbudget.BudgetCache, got {type(cache).__name__}")
        if cache is self._checked_cache and cache.batch_size == batch:
            return cache  # its model, dtype, device and budgets were checked on an earlier call and cannot change
        if cache.budget != self.budget:
            raise ValueError(f"cache budget {cache.budget} differs from the compiled budget {self.budget}")
        if cache.batch_size != batch:
            raise ValueError(f"cache was built for batch size {cache.batch_size}, input has {batch}")
        config = getattr(self.model, "config", None)
        if config is not None and cache.signature != _layer_shapes(config):
            raise ValueError("cache was built for another model (layers/heads/head_dim differ)")
        if self.rule.needs_rope and not cache.has_rope:
            raise ValueError(f"rule {self.rule.name!r} needs RoPE frequencies this cache does not have")
        expected = _layer_budgets(self.rule, self.budget, config) if config is not None else None
        if expected is not None and cache.layer_budgets != expected:
            raise ValueError(f"rule {self.rule.name!r} needs per-layer budgets {expected}; this cache has "
                             f"{cache.layer_budgets}: build it with fxbudget.BudgetCache(..., layer_budgets=...)")
        p = next(self.model.parameters(), None)
        if p is not None and (cache.dtype != p.dtype or cache.device != p.device):
            raise ValueError(f"cache is {cache.dtype} on {cache.device}, model is {p.dtype} on {p.device}; "
                             "build it with BudgetCache(..., dtype=, device=) matching the model")
        self._checked_cache = cache
        return cache

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, use_cache=None, **kwargs):
        x = input_ids if input_ids is not None else inputs_embeds
        if x is None:
            raise ValueError("pass input_ids or inputs_embeds")
        if use_cache is False:
            raise ValueError("a budget-compiled model always uses its cache; do not pass use_cache=False")
        batch, n = x.shape[0], x.shape[1]
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported yet: pass unpadded rows of equal length "
                             "(positions come from the cache, visibility from positions)")
        cache = self._resolve_cache(past_key_values, batch)
        if self.rule.never_evicts and not cache._frozen and not cache.fits(n):
            raise ValueError(f"rule {self.rule.name!r} keeps everything, but {n} more tokens overflow budget "
                             f"{self.budget} ({cache.tokens_seen} seen): use a budget of at least the sequence")
        if position_ids is not None:
            seen = cache.tokens_seen
            expected = torch.arange(seen, seen + n, device=position_ids.device).expand(batch, n)
            if position_ids.shape[-1] != n or not torch.equal(position_ids.reshape(-1, n).expand(batch, n), expected):
                raise ValueError("position_ids must continue the cache's positions (no padding or gaps supported)")
        step = self.chunk_size or n
        chunks = [slice(i, min(i + step, n)) for i in range(0, n, step)]
        keep = kwargs.pop("logits_to_keep", 0)
        if len(chunks) > 1 and not isinstance(keep, int):
            raise ValueError("with chunked prefill, logits_to_keep must be an int")
        # If only the last `keep` positions are wanted and the final chunk holds them, earlier chunks compute 1.
        tail_only = len(chunks) == 1 or 0 < keep <= chunks[-1].stop - chunks[-1].start
        outputs, logits = None, []
        for i, sl in enumerate(chunks):
            last = i == len(chunks) - 1
            part = {"input_ids": input_ids[:, sl]} if input_ids is not None else {"inputs_embeds": inputs_embeds[:, sl]}
            cache.admit(sl.stop - sl.start)
            outputs = self._call_once(past_key_values=cache, use_cache=True, **part, **kwargs,
                                      logits_to_keep=(keep if last else 1) if tail_only else 0)
            if not tail_only:
                logits.append(outputs.logits)
        if logits:
            outputs.logits = torch.cat(logits, dim=1)[:, -keep:] if keep else torch.cat(logits, dim=1)
        return outputs

    def _call_once(self, **kwargs):
        if self._verified:
            return self._run(**kwargs)
        try:
            out = self._run(**kwargs)
        except Exception as e:  # the first call traces: a model fxbudget cannot rewrite is left as it was
            cause = e
            while cause is not None and not isinstance(cause, NoBudgetAttentionError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                self.restore()
                raise NoBudgetAttentionError(str(cause)) from None
            raise
        self._verified = True
        return out


@contextlib.contextmanager
def _maskless_attention(model):
    """Run a transformers model with `ATTN_IMPLEMENTATION` for the duration (no-op for other modules)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None or impl == ATTN_IMPLEMENTATION:
        yield
        return
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(impl)


def _captured_graphs(model, input_ids, rule, budget, cache, rule_params) -> list[fx.GraphModule]:
    graphs: list[fx.GraphModule] = []
    fwd = model.forward.original if isinstance(model.forward, BudgetForward) else model.forward
    backend = make_backend(rule, inner="eager", on_graph=graphs.append, **rule_params)
    if cache is None:
        cache = model_cache(model, backend.rule, budget, input_ids.shape[0])
    with torch.no_grad(), _maskless_attention(model):
        compiled_forward(model, fwd, backend)(input_ids=input_ids, past_key_values=cache, use_cache=True)
    return graphs


def inspect(model: nn.Module, input_ids: torch.Tensor, *, rule: str | Rule = "snapkv", budget: int = 1024,
            cache: BudgetCache | None = None, **rule_params) -> str:
    """The rewritten graph's Python code for one forward of `model` on `input_ids` (model left unmodified).

    Args:
        model: the unmodified model (an HF causal LM, or a module taking `input_ids=` and `past_key_values=`).
        input_ids: a sample input; its length fixes the shapes of the traced graph.
        rule, budget, **rule_params: as for `fxbudget.compile`.
        cache: the BudgetCache to trace with (default: a fresh one for the model's config).
    Returns:
        The code of the rewritten graph(s), as `torch.fx` prints it.
    """
    _check_int("budget", budget)
    graphs = _captured_graphs(model, input_ids, rule, budget, cache, rule_params)
    return "\n".join(gm.code.strip() for gm in graphs)


def _node_key(node: fx.Node, names: dict[fx.Node, str]) -> str:
    def ref(a):
        if isinstance(a, fx.Node):
            return names[a]
        # Sizes are ints: abstracted, so per-layer budgets (pyramidkv) and input lengths hash alike.
        return "int" if isinstance(a, int) and not isinstance(a, bool) else repr(a)

    target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", str(node.target))
    if isinstance(node.target, torch._ops.OpOverload):
        target = str(node.target)
    args = torch.fx.node.map_aggregate(node.args, ref)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, ref)
    return f"{node.op}|{target}|{args}|{kwargs}"


def graph_fingerprint(graphs: list[fx.GraphModule]) -> str:
    """sha256 of the graphs' ops, their order, data flow and non-integer arguments, each run of rule-region ops
    collapsed into one `<rule>` token. Integer arguments (sizes) are left out: the budget, the window and the input
    length are recorded beside the fingerprint, not in it."""
    h = hashlib.sha256()
    for gm in graphs:
        names: dict[fx.Node, str] = {}
        in_rule, count = False, 0
        for node in gm.graph.nodes:
            if node.meta.get(REGION_KEY) == "rule":
                names[node] = "<rule>"
                if not in_rule:
                    h.update(b"<rule>\n")
                in_rule = True
                continue
            in_rule = False
            names[node] = f"%{count}"
            count += 1
            h.update(_node_key(node, names).encode() + b"\n")
    return h.hexdigest()


def kernel_fingerprint(model: nn.Module, input_ids: torch.Tensor, *, rule: str | Rule = "snapkv",
                       budget: int = 1024, cache: BudgetCache | None = None, **rule_params) -> str:
    """Hash of the rewritten graph with the rule's ops abstracted: equal for every rule means one shared kernel.

    Sizes are not part of it (see `graph_fingerprint`), so rules with per-layer budgets compare too: with per-layer
    compiled regions, each distinct graph counts once (pyramidkv's budgets give one region per layer, of one kernel).
    Args and model handling as for `inspect`. Returns a hex sha256 string.
    """
    _check_int("budget", budget)
    graphs = _captured_graphs(model, input_ids, rule, budget, cache, rule_params)
    distinct: dict[str, fx.GraphModule] = {}
    for gm in graphs:
        distinct.setdefault(graph_fingerprint([gm]), gm)
    return graph_fingerprint(list(distinct.values()))
