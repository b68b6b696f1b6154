"""`BudgetForward`: the forward `fxbudget.compile` installs as `model.forward` (chunking, positions, buckets, the
eager or compiled run, restore)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .backend import NoBudgetAttentionError, kernel_window, make_backend
from .buckets import bucket_length, pad_left, unpad_outputs
from ..cache.budget_cache import BudgetCache
from ..cache.keyword import cache_name, pick_cache
from ..passes.eager import BudgetAttentionMode
from ..kernel import DEFAULT_BLOCK
from ..cache.for_model import check_cache, model_cache, resolve_head_pool
from .positions import call_positions
from .progress import CallProgress
from .regions import compiled_forward
from ..rules import Rule, get

# transformers' own SDPA attention under a name it has no mask function for: models then build no 4-D mask (it
# would be unused, since visibility comes from positions, and shaped as if every layer held as many slots as layer 0,
# which per-layer budgets break). The SDPA call itself is unchanged: it is what the pass rewrites.
ATTN_IMPLEMENTATION = "fxbudget_sdpa"
AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)


def _not_installed():
    """`model.forward.restore()` on a model whose forward is not fxbudget's (restored already, or never compiled)."""
    raise RuntimeError("model.forward is the model's own forward, not fxbudget's: restore() was already called (or "
                       "the model was never compiled by fxbudget); nothing to restore")


class BudgetForward:
    """The wrapped forward of a model compiled by fxbudget (installed as `model.forward`).

    Inference only: every call runs under `torch.no_grad()`, whatever the caller's grad mode (e.g. a perplexity
    computed as `model(ids, labels=ids).loss` works, and its outputs do not require grad).
    If the first call finds no attention it can budget, it raises `NoBudgetAttentionError` and so does every later
    call: the model never runs unbudgeted under a budget's name. `restore()` gives back the unmodified model; a
    second `model.forward.restore()` raises a RuntimeError saying so.

    Compiled (a `backend`), every call of more than one token runs at a bucket length (`bucket`), padded on the left
    with fxbudget's own pads (position -1: never visible, never kept, not counted in `get_seq_length()` nor in the
    rule's observation window), so that a bounded number of graphs serves every length (`fxbudget.compiler.buckets`: at most
    49 per compiled region for calls up to 128K tokens). `buckets` (default: `(chunk_size,)`) are the lengths tried
    first, so every prefill chunk runs at `chunk_size`.

    With `cudagraphs=True` the cache's tensors are marked static (`BudgetCache.mark_static`) before the first
    compiled call, and the cache created for `generate()` is kept and reset for the next `generate()` (one per
    batch size and per-layer budgets), so the recorded CUDA graphs stay valid: a cache returned by one
    `generate()` is reset by the next.
    """

    _failure: str | None = None  # set when the first call found nothing to budget

    def __init__(self, model: nn.Module, rule: Rule, budget: int, *, chunk_size: int | None,
                 backend: str | None, headroom: int, block: int | None = DEFAULT_BLOCK, cudagraphs: bool = False,
                 head_pool: bool | None = None, interval: int = 1, measure: str = "auto", progress: bool = False,
                 slot_dtype: str = "model"):
        """Build the forward of `model` (not yet installed: see `install`); the compiled graphs live here, so a
        forward installed, restored and installed again keeps them."""
        self.model, self.rule, self.budget, self.block = model, rule, budget, block
        self.budget_bytes = None  # the size a byte budget asked for (`fxbudget.compile`); `budget` is its tokens
        self.measure = measure  # the measure phase's form (`kernel.settings.measure_form`)
        self.head_pool = resolve_head_pool(rule, head_pool)  # the cache layout of every cache this forward uses
        self.chunk_size, self.backend, self.headroom, self.cudagraphs = chunk_size, backend, headroom, cudagraphs
        self.interval = interval  # decode steps between evictions in the caches this forward creates (`new_cache`)
        self.slot_dtype = slot_dtype  # how its caches store keys and values (`kernel.slot_storage`)
        self.window = kernel_window(rule)
        self.progress = CallProgress(progress, f"{rule.name} at budget {budget}")
        self.original = model.forward
        self.buckets: tuple[int, ...] = (chunk_size,) if chunk_size else ()
        self.graphs: list[fx.GraphModule] = []  # rewritten graphs compiled so far (one per region and input shape)
        self._verified, self._installed = False, False
        self._checked_cache: BudgetCache | None = None
        self._kept: dict[tuple, BudgetCache] = {}  # cudagraphs: generate()'s caches, reused (stable addresses)
        self._advance: dict[tuple, torch.Tensor] = {}  # one tensor per call length and device: no copy per step
        self._sliding_rule = get("window")  # the rule of sliding-window layers (eager path)
        self._frozen_runner: Callable[..., Any] | None = None
        self._growth_runner: Callable[..., Any] | None = None  # this forward's own, when none is shared (`_run_grown`)
        # Set by a rule's own protocol around the one call it may evict in (`fxbudget.harness.kvzip_protocol`): that call is
        # never split into chunks. A `replay_only` rule refuses every other evicting call.
        self.replaying = False
        if backend is None:
            self._run = self._run_eager
        else:
            self._runner = compiled_forward(model, self.original, make_backend(
                rule, inner=backend, on_graph=self.graphs.append, block=block, cudagraphs=cudagraphs,
                budget_ints=False, measure=measure), cudagraphs=cudagraphs)  # compiled, never hashed
            # (kernel_fingerprint traces its own)
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
        self._installed = True
        return model

    def restore(self) -> nn.Module:
        """Put the original forward back; returns the model. Once restored, `model.forward` is the model's own, and
        `model.forward.restore()` raises a RuntimeError that says so (calling this object's `restore()` again is a
        no-op)."""
        if not self._installed:
            return self.model
        if self._instance_forward is None:
            del self.model.forward
        else:
            self.model.forward = self._instance_forward
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.disable_compile = self._disable_compile
        if self._attn_implementation is not None:
            self.model.set_attn_implementation(self._attn_implementation)
        self._checked_cache, self._installed = None, False  # do not hold the last cache while not installed
        self._kept.clear()
        # A bound method reads unknown attributes from its function: `model.forward.restore()` now names the mistake
        # instead of "'function' object has no attribute 'restore'" (set on the function, not on the model).
        fn = getattr(self.model.forward, "__func__", self.model.forward)
        if not hasattr(fn, "restore"):
            try:
                fn.restore = _not_installed
            except (AttributeError, TypeError):  # a builtin or slotted callable: the plain AttributeError stays
                pass
        return self.model

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

    def bucket(self, n: int, *, frozen: bool = False) -> int:
        """The length a compiled call of `n` tokens runs at (`n` plus fxbudget's pads): `n` for a decode step,
        else `fxbudget.compiler.buckets.bucket_length(n, self.buckets)`, short calls included (the rule's observation window
        counts real tokens only, so the padding changes no score). `frozen` is accepted for callers of the old
        signature; frozen and evicting calls bucket alike."""
        return n if n <= 1 else bucket_length(n, self.buckets)

    def _run_compiled(self, **kwargs):
        """The compiled runner (the shared one for frozen calls), the call padded on the left to its bucket."""
        cache = next(v for v in kwargs.values() if isinstance(v, BudgetCache))
        run = self._frozen_runner if cache._frozen and self._frozen_runner is not None else self._runner
        if not cache.evicting and not cache._frozen:
            run = self._grown_runner()
        name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        x = kwargs[name]
        n = x.shape[1]
        pads = self.bucket(n) - n
        # Another per-token input than those padded below: run at the call's own length (one more graph, exact).
        per_token = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == n}
        if per_token - {name, "position_ids", "labels"}:
            pads = 0
        if cache.call.pos is not None:  # a fresh tensor: a chunk's slice has the whole prompt's strides (a guard)
            cache.call.pos = cache.call.pos.clone(memory_format=torch.contiguous_format)
        if not pads or cache.call.pos is None:
            kwargs[name] = x.clone(memory_format=torch.contiguous_format)
            return run(**kwargs)
        # The cache's seen count advances by the call's own tokens only (`cache.call.advance`, set by the caller).
        cache.call.pos = pad_left(kwargs, name, pads, cache.call.pos)
        return unpad_outputs(run(**kwargs), n)

    def _grown_runner(self) -> Callable[..., Any]:
        """The compiled runner of a decode step between evictions (`BudgetCache.interval`): the shared frozen runner
        if one is set (`share_frozen`), else this forward's own, built on first use. Such a step evicts nothing the
        rule chooses (its layers keep every slot, as a frozen call does), so it runs without the rule's scoring: the
        scoring cost is paid on the evicting steps only, which is what an interval amortizes."""
        if self._frozen_runner is not None:
            return self._frozen_runner
        if self._growth_runner is None:
            self._growth_runner = frozen_runner(self.model, self.backend, self.window, block=self.block,
                                                cudagraphs=self.cudagraphs, on_graph=self.graphs.append,
                                                measure=self.measure)
        return self._growth_runner

    def _run_eager(self, *args, **kwargs):
        cache = next((v for v in kwargs.values() if isinstance(v, BudgetCache)), None)
        # A decode step between evictions (`BudgetCache.interval`) runs the kernel with the `window` rule: it evicts
        # nothing the rule chooses (see `_grown_runner`), so the rule's scoring is skipped, as compiled.
        grown = cache is not None and not cache.evicting and not cache._frozen
        rule = self._sliding_rule if grown else self.rule
        with BudgetAttentionMode(rule, self.window, self._sliding_rule, self.block, self.measure) as mode:
            out = self.original(*args, **kwargs)
        if mode.pending:  # the same failure the graph pass reports when it finds no SDPA to rewrite
            raise NoBudgetAttentionError(
                f"keys/values of BudgetCache layers {sorted(set(mode.pending.values()))} never reached "
                "scaled_dot_product_attention; fxbudget can only budget attention computed by SDPA")
        return out

    def new_cache(self, batch_size: int = 1, *, headroom: int | None = None,
                  prompt: int | None = None, interval: int | None = None) -> BudgetCache:
        """A fresh `BudgetCache` for this model (its dtype and device), its per-layer budgets sized for a prefill of
        `prompt` tokens if given (pyramidkv adapts its schedule to the prompt; None = the rule's fixed schedule),
        evicting decode steps every `interval` steps (None: this forward's `interval`)."""
        return model_cache(self.model, self.rule, self.budget, batch_size,
                           headroom=self.headroom if headroom is None else headroom, prompt=prompt,
                           head_pool=self.head_pool, interval=self.interval if interval is None else interval,
                           slot_dtype=self.slot_dtype)

    def _generate_cache(self, batch: int, n: int) -> BudgetCache:
        """The cache of a new sequence (generate()'s first call); with cudagraphs, the same one again, reset."""
        cache = self.new_cache(batch, prompt=n)
        if not self.cudagraphs:
            return cache
        key = (batch, tuple(cache.layer_budgets), cache.headroom, cache.interval)
        kept = self._kept.setdefault(key, cache)
        if kept is not cache:
            kept.reset()
            kept.sized_for_prompt = n
        return kept

    def _resolve_cache(self, cache, batch: int, n: int) -> BudgetCache:
        if cache is None or (isinstance(cache, DynamicCache) and int(cache.get_seq_length()) == 0):
            # generate() hands an empty DynamicCache on its first call. This call's `n` tokens are the prompt.
            cache = self._generate_cache(batch, n)
        elif not isinstance(cache, BudgetCache):
            raise TypeError(f"the cache (cache= or past_key_values=) must be a fxbudget.BudgetCache, "
                            f"got {type(cache).__name__}")
        if cache is self._checked_cache and cache.batch_size == batch:
            return cache  # its model, dtype, device and budgets were checked on an earlier call and cannot change
        check_cache(cache, self.model, self.rule, self.budget, batch, self.head_pool, self.slot_dtype)
        if self.cudagraphs:
            cache.mark_static()  # before the first compiled call that sees it
        self._checked_cache = cache
        return cache

    @functools.cached_property
    def _cache_name(self) -> str:
        """The keyword the original forward takes its cache under (`cache` from transformers 5.24)."""
        return cache_name(self.original)

    def _advance_tensor(self, n: int, device: torch.device) -> torch.Tensor:
        # Made once per length and device: a decode step copies nothing from the host.
        key = (n, device)
        if key not in self._advance:
            self._advance[key] = torch.tensor(n, device=device)
        return self._advance[key]

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
        if self.rule.replay_only and not cache._frozen and not self.replaying:
            raise ValueError(f"rule {self.rule.name!r} scores a replay of the context and evicts only in its protocol: "
                             f"use fxbudget.harness.kvzip_protocol.compress(model, context_ids, replay_ids) to compress a "
                             f"context (calls under cache.frozen() are allowed), not plain generation")
        step = n if self.replaying else (self.chunk_size or n)
        chunks = [slice(i, min(i + step, n)) for i in range(0, n, step)]
        # Each row's positions (-1 = a left pad): the kernel's visibility and the model's RoPE both use them. Read
        # back once per call at most (the mask check and the real tokens per chunk; a decode step reads nothing).
        pos, reals, most = call_positions(cache, n, attention_mask, position_ids, x.device, chunks)
        if self.rule.never_evicts and not cache._frozen and not cache.fits(most):
            raise ValueError(f"rule {self.rule.name!r} keeps everything, but {n} more tokens overflow budget "
                             f"{self.budget} ({cache.tokens_seen} seen): use a budget of at least the sequence")
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
        self.progress.before(batch, n)
        for i, (sl, real) in enumerate(zip(chunks, reals)):
            last = i == len(chunks) - 1
            part = {"input_ids": input_ids[:, sl]} if input_ids is not None else {"inputs_embeds": inputs_embeds[:, sl]}
            chunk_pos = pos[:, sl]
            # A one-call prefill on an empty cache may skip the slots (`BudgetLayer.mark`); a chunked one does not, so
            # its chunks share one graph.
            empty = cache.empty and len(chunks) == 1
            cache.admit(real, length=sl.stop - sl.start)
            cache.call.pos, cache.call.advance = chunk_pos, self._advance_tensor(sl.stop - sl.start, x.device)
            cache.call.empty = empty
            try:
                outputs = self._call_once(**{self._cache_name: cache}, use_cache=True,
                                          position_ids=chunk_pos.clamp(min=0), **part, **kwargs,
                                          logits_to_keep=(keep if last else 1) if tail_only else 0)
            finally:
                cache.call.pos = cache.call.advance = None
                cache.call.empty = False
            cache.next_pos += (chunk_pos >= 0).sum(-1).to(cache.next_pos.device)
            if not tail_only:
                logits.append(outputs.logits)
        self.progress.after(n)
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


def frozen_runner(model: nn.Module, backend: str, window: int, *, block: int | None = DEFAULT_BLOCK,
                  cudagraphs: bool = False, on_graph: Callable[[fx.GraphModule], None] | None = None,
                  measure: str = "auto") -> Callable[..., Any]:
    """A compiled runner of `model` for frozen calls, to share between forwards (`BudgetForward.share_frozen`).

    Args:
        model: the model (if compiled by fxbudget at the time of the call, its original forward is used).
        backend: "inductor", "aot_eager" or "eager". window: the observation window of the forwards that share it
            (the signal totals stored in the cache depend on it). block, cudagraphs, measure: as for `compile`.
        on_graph: called with each rewritten graph it compiles.
    Returns:
        A callable like `BudgetForward`'s compiled runner. Its graphs carry the `window` rule's scoring ops: in a
        frozen call no score decides anything (see `share_frozen`).
    """
    forward = model.forward.original if isinstance(model.forward, BudgetForward) else model.forward
    return compiled_forward(model, forward, make_backend("window", inner=backend, on_graph=on_graph, block=block,
                                                         cudagraphs=cudagraphs, observation_window=window,
                                                         budget_ints=False, measure=measure),
                            cudagraphs=cudagraphs)
