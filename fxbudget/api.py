"""`fxbudget.compile`, `fxbudget.inspect`, `fxbudget.kernel_fingerprint`: the public entry points."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .architectures import check_model
from .backend import INNER_BACKENDS, NoBudgetAttentionError, kernel_window, make_backend
from .cache import BudgetCache, _layer_shapes
from .cache_arg import cache_kwargs, cache_name, pick_cache
from .checks import check_int
from .eager import BudgetAttentionMode
from .kernel import DEFAULT_BLOCK, check_block
from .passes.sdpa import INTS_KEY, REGION_KEY
from .positions import call_positions
from .regions import compiled_forward, whole_model_forward
from .rules import Rule, get

log = logging.getLogger("fxbudget")

# transformers' own SDPA attention under a name it has no mask function for: models then build no 4-D mask (it
# would be unused, since visibility comes from positions, and shaped as if every layer held as many slots as layer 0,
# which per-layer budgets break). The SDPA call itself is unchanged: it is what the pass rewrites.
ATTN_IMPLEMENTATION = "fxbudget_sdpa"
AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)


def _validate(model: nn.Module, budget: int, backend: str | None, chunk_size: int | None) -> None:
    """Every check that can fail before the model is touched (DESIGN §7)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxbudget.compile expects a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model.forward, BudgetForward):
        raise ValueError("this model is already compiled by fxbudget; call model.forward.restore() first")
    check_int("budget", budget)
    if chunk_size is not None:
        check_int("chunk_size", chunk_size)
    if backend is not None and backend not in INNER_BACKENDS:
        raise ValueError(f"backend must be one of {INNER_BACKENDS} or None (no torch.compile), got {backend!r}")
    config = getattr(model, "config", None)
    if config is None:
        return  # a custom module that builds its own BudgetCache
    check_model(model)  # raises, naming the feature, for attention fxbudget cannot reproduce exactly
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "sdpa"):
        raise ValueError(
            f"fxbudget needs SDPA attention, this model uses {impl!r}: load it with attn_implementation='sdpa' "
            "or call model.set_attn_implementation('sdpa') first")
    max_pos = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_pos is not None and budget > max_pos:
        warnings.warn(f"budget {budget} exceeds the model's max_position_embeddings {max_pos}; "
                      "the cache will never be full", stacklevel=3)


def compile(model: nn.Module, rule: str | Rule = "snapkv", budget: int = 1024, *, chunk_size: int | None = None,
            backend: str | None = "inductor", headroom: int = 0, block: int | None = DEFAULT_BLOCK,
            cudagraphs: bool = False, **rule_params) -> nn.Module:
    """Run `model` with a KV cache of at most `budget` entries per layer and KV head, evicting with `rule`.

    The model is modified in place (its `forward` is wrapped) and returned; `model.forward.restore()` undoes it.
    Every rule runs the same kernel; only its scoring ops differ. Inference only: the wrapped forward always runs
    without autograd (under `torch.no_grad()`), also when called in grad mode.

    Args:
        model: a Hugging Face causal LM using SDPA attention, or any module that calls
            `scaled_dot_product_attention` on keys/values from a `BudgetCache` passed as `cache` or
            `past_key_values` (transformers renamed the argument in 5.24; fxbudget accepts either and passes the
            name the model declares).
        rule: a registered rule name (`fxbudget.rules.available()`) or a `Rule` instance.
        budget: KV entries kept per full-attention layer and KV head.
        chunk_size: split inputs longer than this into chunks, so prefill memory is bounded by budget + chunk_size.
        backend: "inductor" (default), "aot_eager" or "eager" (Dynamo backends, same semantics), or None to run the
            kernel eagerly without torch.compile (the reference path).
        headroom: extra slots for caches created automatically (see `BudgetCache.frozen`).
        block: queries per block in the kernel's measure phase: a call's attention temporaries are
            O(block x candidates) whatever its length (a kernel setting: compare rules at one value; a call shorter
            than `block` is one block).
        cudagraphs: with backend "inductor" on CUDA, replay the compiled graphs as CUDA graphs (mark the cache tensors
            with `torch._dynamo.mark_static_address`, or Inductor skips CUDA graphs for graphs that write them).
        **rule_params: hyperparameters of a named rule, e.g. `window=64` for snapkv.

    Returns:
        The same model, whose forward (and therefore `generate`) now uses the budget cache. If its first call finds
        no SDPA attention fed by the cache, that call and every later one raise `NoBudgetAttentionError` (never a
        silent run of the unmodified model); `model.forward.restore()` undoes the wrapping.
    """
    _validate(model, budget, backend, chunk_size)
    rule_obj = get(rule, **rule_params)
    check_int("headroom", headroom, 0)
    check_block(block)
    if rule_obj.needs_rope and getattr(model, "config", None) is not None \
            and not BudgetCache(model.config, 1).has_rope:
        raise ValueError(f"rule {rule_obj.name!r} needs the model's RoPE frequencies, and this model does not use "
                         "default RoPE on its full-attention layers")
    return BudgetForward(model, rule_obj, budget, chunk_size=chunk_size, backend=backend, headroom=headroom,
                         block=block, cudagraphs=cudagraphs).install()


def frozen_runner(model: nn.Module, backend: str, window: int, *, block: int | None = DEFAULT_BLOCK,
                  cudagraphs: bool = False, on_graph: Callable[[fx.GraphModule], None] | None = None
                  ) -> Callable[..., Any]:
    """A compiled runner of `model` for frozen calls, to share between forwards (`BudgetForward.share_frozen`).

    Args:
        model: the model (if compiled by fxbudget at the time of the call, its original forward is used).
        backend: "inductor", "aot_eager" or "eager". window: the observation window of the forwards that share it
            (the signal totals stored in the cache depend on it). block, cudagraphs: as for `compile`.
        on_graph: called with each rewritten graph it compiles.
    Returns:
        A callable like `BudgetForward`'s compiled runner. Its graphs carry the `window` rule's scoring ops: in a
        frozen call no score decides anything (see `share_frozen`).
    """
    forward = model.forward.original if isinstance(model.forward, BudgetForward) else model.forward
    return compiled_forward(model, forward, make_backend("window", inner=backend, on_graph=on_graph, block=block,
                                                         cudagraphs=cudagraphs, observation_window=window))


def bucket_length(n: int, buckets: tuple[int, ...] = ()) -> int:
    """The smallest of `buckets` that holds `n` tokens, else `n` rounded up to a quarter of its power of two, at least
    16: from 64 tokens on, at most a quarter more tokens (four lengths per doubling); below, a multiple of 16."""
    fits = [b for b in buckets if b >= n]
    if fits:
        return min(fits)
    step = max(16, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


def _layer_budgets(rule: Rule, budget: int, config, prompt: int | None = None) -> list[int] | None:
    """The rule's per-layer budgets for this model's full-attention layers (None = uniform), for a prefill of
    `prompt` tokens when known."""
    return rule.layer_budgets(budget, _layer_shapes(config)[4].count("full_attention"), prompt=prompt)


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
                headroom: int = 0, prompt: int | None = None) -> BudgetCache:
    """A fresh `BudgetCache` for `model` (its config, dtype and each layer's device, `layer_devices`) and `rule`'s
    per-layer budgets, sized for a prefill of `prompt` tokens when given (schedules such as pyramidkv's adapt to it;
    None = the fixed schedule)."""
    if getattr(model, "config", None) is None:
        raise ValueError("this model has no .config: pass a fxbudget.BudgetCache(config, budget) explicitly")
    p = next(model.parameters())
    cache = BudgetCache(model.config, budget, batch_size, dtype=p.dtype, device=layer_devices(model),
                        headroom=headroom, layer_budgets=_layer_budgets(rule, budget, model.config, prompt))
    cache.sized_for_prompt = prompt  # what BudgetForward checks its layer budgets against
    return cache


class BudgetForward:
    """The wrapped forward of a model compiled by fxbudget (installed as `model.forward`).

    Inference only: every call runs under `torch.no_grad()`, whatever the caller's grad mode (e.g. a perplexity
    computed as `model(ids, labels=ids).loss` works, and its outputs do not require grad).
    If the first call finds no attention it can budget, it raises `NoBudgetAttentionError` and so does every later
    call: the model never runs unbudgeted under a budget's name. `restore()` gives back the unmodified model.

    Compiled (a `backend`), each call runs at a bucket length (`bucket`), padded on the left with fxbudget's own pads
    (position -1: never visible, never kept, not counted in `get_seq_length()`), so that a few graphs serve every
    length: the last prefill chunk runs at `chunk_size`. `buckets` (default: `(chunk_size,)`) are the lengths tried
    first; a call longer than all of them is rounded up to a quarter of its power of two.
    """

    _failure: str | None = None  # set when the first call found nothing to budget

    def __init__(self, model: nn.Module, rule: Rule, budget: int, *, chunk_size: int | None,
                 backend: str | None, headroom: int, block: int | None = DEFAULT_BLOCK, cudagraphs: bool = False):
        """Build the forward of `model` (not yet installed: see `install`); the compiled graphs live here, so a
        forward installed, restored and installed again keeps them."""
        self.model, self.rule, self.budget, self.block = model, rule, budget, block
        self.chunk_size, self.backend, self.headroom = chunk_size, backend, headroom
        self.window = kernel_window(rule)
        self.original = model.forward
        self.buckets: tuple[int, ...] = (chunk_size,) if chunk_size else ()
        self.graphs: list[fx.GraphModule] = []  # rewritten graphs compiled so far (one per region and input shape)
        self._verified = False
        self._checked_cache: BudgetCache | None = None
        self._sliding_rule = get("window")  # the rule of sliding-window layers (eager path)
        self._frozen_runner: Callable[..., Any] | None = None
        if backend is None:
            self._run = self._run_eager
        else:
            self._runner = compiled_forward(model, self.original, make_backend(
                rule, inner=backend, on_graph=self.graphs.append, block=block, cudagraphs=cudagraphs))
            self._run = self._run_compiled

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

        A frozen call evicts nothing the rule chooses: `admit` guarantees an empty slot for every new token, and
        invalid candidates (pads, empty slots) rank below every token whatever its score, so the candidates dropped
        are the call's pads and then empty slots, in a fixed order; attention, signals and the state written do not
        depend on the rule either. Every rule's frozen call therefore computes the same thing, and one compiled graph
        per shape serves them all (a comparison compiles its question and decode graphs once per budget, not once
        per rule and budget).
        """
        if self.backend is None:
            raise ValueError("share_frozen() is for compiled forwards (backend is None)")
        self._frozen_runner = runner

    def bucket(self, n: int, *, frozen: bool) -> int:
        """The length a compiled call of `n` tokens runs at (`n` plus fxbudget's pads)."""
        if n <= 1 or (not frozen and n < self.window):
            # The rules see `min(window, n)` as the observation window (`rule_region`), e.g. the recent tokens
            # snapkv protects: a call shorter than the window keeps its length. A frozen call protects nothing.
            return n
        return bucket_length(n, self.buckets)

    def _run_compiled(self, **kwargs):
        """The compiled runner (the shared one for frozen calls), the call padded on the left to its bucket."""
        cache = next(v for v in kwargs.values() if isinstance(v, BudgetCache))
        run = self._frozen_runner if cache._frozen and self._frozen_runner is not None else self._runner
        name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        x = kwargs[name]
        n = x.shape[1]
        pads = self.bucket(n, frozen=cache._frozen) - n
        # Another per-token input than those padded below: run at the call's own length (one more graph, exact).
        per_token = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == n}
        if per_token - {name, "position_ids", "labels"}:
            pads = 0
        if cache.call.pos is not None:  # a fresh tensor: a chunk's slice has the whole prompt's strides (a guard)
            cache.call.pos = cache.call.pos.clone(memory_format=torch.contiguous_format)
        if not pads or cache.call.pos is None:
            kwargs[name] = x.clone(memory_format=torch.contiguous_format)
            return run(**kwargs)
        # fxbudget's own pads: any token (0), RoPE position 0 (unused), kernel position -1; the cache's seen count
        # advances by the call's own tokens only (`cache.call.advance`, set by the caller, is left as it is).
        kwargs[name] = torch.cat([x.new_zeros(x.shape[0], pads, *x.shape[2:]), x], dim=1)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = F.pad(kwargs["position_ids"], (pads, 0), value=0)
        if kwargs.get("labels") is not None:
            # Ignored (-100) labels for the pads and the first real token, which the last pad's logits would predict:
            # the loss keeps exactly the terms of the unpadded call.
            labels = F.pad(kwargs["labels"], (pads, 0), value=-100)
            labels[:, pads] = -100
            kwargs["labels"] = labels
        cache.call.pos = F.pad(cache.call.pos, (pads, 0), value=-1)
        out = run(**kwargs)
        if out.logits.shape[1] > n:  # every position's logits were asked for: drop the pads'
            out.logits = out.logits[:, -n:]
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(h[:, -n:] for h in out.hidden_states)
        return out

    def _run_eager(self, *args, **kwargs):
        with BudgetAttentionMode(self.rule, self.window, self._sliding_rule, self.block) as mode:
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

    def new_cache(self, batch_size: int = 1, *, headroom: int | None = None,
                  prompt: int | None = None) -> BudgetCache:
        """A fresh `BudgetCache` for this model (its dtype and device), its per-layer budgets sized for a prefill of
        `prompt` tokens if given (pyramidkv adapts its schedule to the prompt; None = the rule's fixed schedule)."""
        return model_cache(self.model, self.rule, self.budget, batch_size,
                           headroom=self.headroom if headroom is None else headroom, prompt=prompt)

    def _resolve_cache(self, cache, batch: int, n: int) -> BudgetCache:
        if cache is None or (isinstance(cache, DynamicCache) and int(cache.get_seq_length()) == 0):
            # generate() hands an empty DynamicCache on its first call. This call's `n` tokens are the prompt.
            return self.new_cache(batch, prompt=n)
        if not isinstance(cache, BudgetCache):
            raise TypeError(f"the cache (cache= or past_key_values=) must be a fxbudget.BudgetCache, "
                            f"got {type(cache).__name__}")
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
        prompt = getattr(cache, "sized_for_prompt", None)  # None for an explicitly built cache: the fixed schedule
        expected = _layer_budgets(self.rule, self.budget, config, prompt) if config is not None else None
        if expected is not None and cache.layer_budgets != expected:
            raise ValueError(f"rule {self.rule.name!r} needs per-layer budgets {expected}; this cache has "
                             f"{cache.layer_budgets}: build it with model.forward.new_cache() (new_cache(prompt=n) "
                             "for a schedule sized for an n-token prompt) or BudgetCache(..., layer_budgets=...)")
        p = next(self.model.parameters(), None)
        if p is not None:
            # Each layer's slots on that layer's device (one device, or several with device_map="auto").
            devices = layer_devices(self.model) if config is not None else [p.device] * len(cache.devices)
            if cache.dtype != p.dtype or cache.devices != devices:
                raise ValueError(f"cache is {cache.dtype} on {_where(cache.devices)}, model is {p.dtype} on "
                                 f"{_where(devices)}; build it with model.forward.new_cache() or BudgetCache(..., "
                                 "dtype=, device=) matching the model (device=fxbudget.api.layer_devices(model): "
                                 "one per layer)")
        self._checked_cache = cache
        return cache

    @functools.cached_property
    def _cache_name(self) -> str:
        """The keyword the original forward takes its cache under (`cache` from transformers 5.24)."""
        return cache_name(self.original)

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                 use_cache=None, *, past_key_values=None, **kwargs):
        if self._failure is not None:
            raise NoBudgetAttentionError(self._failure)
        # Either name of the cache argument (transformers 5.24 renamed past_key_values to cache); one code path.
        cache = pick_cache(cache, past_key_values)
        x = input_ids if input_ids is not None else inputs_embeds
        if x is None:
            raise ValueError("pass input_ids or inputs_embeds")
        if use_cache is False:
            raise ValueError("a budget-compiled model always uses its cache; do not pass use_cache=False")
        batch, n = x.shape[0], x.shape[1]
        cache = self._resolve_cache(cache, batch, n)
        # Each row's positions (-1 = a left pad): the kernel's visibility and the model's RoPE both use them.
        pos = call_positions(cache, n, attention_mask, position_ids, x.device)
        real = (pos >= 0).sum(-1)
        if self.rule.never_evicts and not cache._frozen and not cache.fits(int(real.max())):
            raise ValueError(f"rule {self.rule.name!r} keeps everything, but {n} more tokens overflow budget "
                             f"{self.budget} ({cache.tokens_seen} seen): use a budget of at least the sequence")
        step = self.chunk_size or n
        chunks = [slice(i, min(i + step, n)) for i in range(0, n, step)]
        keep = kwargs.pop("logits_to_keep", 0)
        if len(chunks) > 1 and not isinstance(keep, int):
            raise ValueError("with chunked prefill, logits_to_keep must be an int")
        # Chunked, each chunk's logits predict across its boundary too: the loss is taken once over all the logits.
        labels = kwargs.pop("labels", None) if len(chunks) > 1 else None
        if labels is not None and keep:
            raise ValueError("labels with chunked prefill need every position's logits: do not pass logits_to_keep")
        # If only the last `keep` positions are wanted and the final chunk holds them, earlier chunks compute 1.
        tail_only = len(chunks) == 1 or 0 < keep <= chunks[-1].stop - chunks[-1].start
        outputs, logits = None, []
        for i, sl in enumerate(chunks):
            last = i == len(chunks) - 1
            part = {"input_ids": input_ids[:, sl]} if input_ids is not None else {"inputs_embeds": inputs_embeds[:, sl]}
            chunk_pos = pos[:, sl]
            cache.admit(int((chunk_pos >= 0).sum(-1).max()))
            cache.call.pos, cache.call.advance = chunk_pos, torch.tensor(sl.stop - sl.start, device=x.device)
            try:
                outputs = self._call_once(**{self._cache_name: cache}, use_cache=True,
                                          position_ids=chunk_pos.clamp(min=0), **part, **kwargs,
                                          logits_to_keep=(keep if last else 1) if tail_only else 0)
            finally:
                cache.call.pos = cache.call.advance = None
            cache.next_pos += (chunk_pos >= 0).sum(-1).to(cache.next_pos.device)
            if not tail_only:
                logits.append(outputs.logits)
        if logits:
            outputs.logits = torch.cat(logits, dim=1)[:, -keep:] if keep else torch.cat(logits, dim=1)
        if labels is not None:
            outputs.loss = self._loss(outputs.logits, labels)
        return outputs

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's own causal-LM loss over the whole call (transformers' `loss_function`), else the shifted
        cross-entropy it computes (labels -100 ignored)."""
        loss_function = getattr(self.model, "loss_function", None)
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if loss_function is not None and vocab is not None:
            return loss_function(logits=logits, labels=labels.to(logits.device), vocab_size=vocab)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                               ignore_index=-100)

    def _call_once(self, **kwargs):
        # Inference only: without autograd whatever the caller's grad mode (the in-place slot writes would break a
        # backward pass, and a graph kept through the cache would grow with every call).
        with torch.no_grad():
            return self._call_checked(**kwargs)

    def _call_checked(self, **kwargs):
        if self._verified:
            return self._run(**kwargs)
        try:
            out = self._run(**kwargs)
        except Exception as e:  # the first call traces: it finds out whether fxbudget can budget this model
            cause = e
            while cause is not None and not isinstance(cause, NoBudgetAttentionError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                # Stay installed and failing: restoring here would let the next call run the unmodified model,
                # unbudgeted, under this budget's name.
                self._failure = (f"{cause}. fxbudget cannot budget this model: every call fails until "
                                 "model.forward.restore() puts the unmodified model back")
                raise NoBudgetAttentionError(self._failure) from None
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


def _captured_graphs(model, input_ids, rule, budget, cache, rule_params, *, block: int | None = DEFAULT_BLOCK,
                     decode: bool = False) -> list[fx.GraphModule]:
    """The rewritten graphs of one forward on `input_ids` (and, with `decode`, of one more token after it)."""
    check_block(block)
    graphs: list[fx.GraphModule] = []
    fwd = model.forward.original if isinstance(model.forward, BudgetForward) else model.forward
    backend = make_backend(rule, inner="eager", on_graph=graphs.append, block=block, **rule_params)
    if cache is None:
        cache = model_cache(model, backend.rule, budget, input_ids.shape[0])
    run = whole_model_forward(fwd, backend)  # every layer in one graph: what `inspect` reports per layer
    with torch.no_grad(), _maskless_attention(model):
        run(input_ids=input_ids, use_cache=True, **cache_kwargs(fwd, cache))
        if decode:
            run(input_ids=input_ids[:, -1:], use_cache=True, **cache_kwargs(fwd, cache))
    return graphs


def inspect(model: nn.Module, input_ids: torch.Tensor, *, rule: str | Rule = "snapkv", budget: int = 1024,
            cache: BudgetCache | None = None, **rule_params) -> str:
    """The rewritten graph's Python code for one forward of `model` on `input_ids` (model left unmodified).

    Args:
        model: the unmodified model (an HF causal LM, or a module taking `input_ids=` and `cache=` or
            `past_key_values=`).
        input_ids: a sample input; its length fixes the shapes of the traced graph.
        rule, budget, **rule_params: as for `fxbudget.compile`.
        cache: the BudgetCache to trace with (default: a fresh one for the model's config).
    Returns:
        The code of the rewritten graph(s), as `torch.fx` prints it.
    """
    check_int("budget", budget)
    graphs = _captured_graphs(model, input_ids, rule, budget, cache, rule_params)
    return "\n".join(gm.code.strip() for gm in graphs)


def _node_key(node: fx.Node, names: dict[fx.Node, str]) -> str:
    # Kernel nodes carry their ints from the pass, budget-derived ones as `BudgetInt`; every other int is literal.
    forms = iter(node.meta[INTS_KEY]) if INTS_KEY in node.meta else None

    def ref(a):
        if isinstance(a, fx.Node):
            return names[a]
        if forms is not None and isinstance(a, int) and not isinstance(a, bool):
            return repr(next(forms))
        return repr(a)

    target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", str(node.target))
    if isinstance(node.target, torch._ops.OpOverload):
        target = str(node.target)
    args = torch.fx.node.map_aggregate(node.args, ref)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, ref)
    return f"{node.op}|{target}|{args}|{kwargs}"


def graph_fingerprint(graphs: list[fx.GraphModule]) -> str:
    """sha256 of the graphs' ops, their order, data flow and arguments, each run of rule-region ops collapsed into
    one `<rule>` token.

    Integer arguments are hashed, with one normalization: in the spliced kernel (`measure` and `evict`), an int that
    grows with the layer's budget is hashed as `a*S+b` (S = the layer's slots). The pass finds them by tracing each
    layer's kernel twice, at its slots and keep and at one more of each (`passes.sdpa.trace_kernel`): the ints that
    change are budget-derived, and `a`, `b` come from the two values. So per-layer budgets (pyramidkv) and the run's
    budget hash alike, while a kernel that keeps, slices, reduces or selects differently does not. Everything else is
    literal: the call's length (the model's own ops outside the kernel carry it too: views, `arange`), the
    observation window, the head sizes, dims. Fingerprints therefore compare rules at one input length and one
    window (the runner records both). Two layers whose budgets sit on different sides of the call's length hash
    differently: `evict` writes `min(n, S)` rows."""
    h = hashlib.sha256()
    for gm in graphs:
        _hash_graph(h, gm)
    return h.hexdigest()


def _hash_graph(h, gm: fx.GraphModule) -> None:
    """Feed `gm`'s nodes to `h`; a higher-order op's body graph (measure's scan) is hashed where it is referenced."""
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
        sub = getattr(gm, node.target) if node.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            h.update(b"<subgraph>\n")
            _hash_graph(h, sub)
            h.update(b"</subgraph>\n")
            continue
        h.update(_node_key(node, names).encode() + b"\n")


def kernel_fingerprint(model: nn.Module, input_ids: torch.Tensor, *, rule: str | Rule = "snapkv",
                       budget: int = 1024, cache: BudgetCache | None = None, block: int | None = None,
                       **rule_params) -> str:
    """Hash of the rewritten graphs with the rule's ops abstracted: equal for every rule means one shared kernel.

    Two graphs are hashed: one forward on `input_ids`, traced with a query block of half its length (`block=None`), so
    the measure phase's loop over blocks is in it, and one decode step after it (a call of one query).
    Budget-derived sizes are normalized (see `graph_fingerprint`), so rules with per-layer budgets compare too; the
    input length, the block and the window are part of it.
    Args and model handling as for `inspect`. Returns a hex sha256 string.
    """
    check_int("budget", budget)
    block = max(2, (input_ids.shape[1] + 1) // 2) if block is None else block
    return graph_fingerprint(_captured_graphs(model, input_ids, rule, budget, cache, rule_params, block=block,
                                              decode=True))
