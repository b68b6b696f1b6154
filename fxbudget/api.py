"""`fxbudget.compile`: the public entry point. `fxbudget.inspect` and `fxbudget.kernel_fingerprint` live in
`fxbudget.fairness.fingerprint`; the wrapped forward and `frozen_runner` in `fxbudget.compiler.forward` (a forward
that decodes at an interval builds one itself); their names stay importable from here."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn

from .models.architectures import check_model
from .compiler.backend import INNER_BACKENDS
from .compiler.buckets import bucket_length  # noqa: F401  (re-export)
from .cache.budget_cache import BudgetCache  # noqa: F401  (re-export)
from .checks import byte_size, check_int, check_slot_dtype
from .fairness.fingerprint import captured_graphs as _captured_graphs  # noqa: F401  (re-export)
from .fairness.fingerprint import graph_fingerprint, inspect, kernel_fingerprint  # noqa: F401  (re-export)
from .compiler.forward import ATTN_IMPLEMENTATION, BudgetForward, frozen_runner  # noqa: F401  (re-export)
from .kernel import DEFAULT_BLOCK, check_block
from .kernel.flex_measure import CPU_INDUCTOR
from .kernel.settings import MeasureSpec, check_measure
from .kernel.signal_set import run_signals
from .cache.byte_budget import model_tokens_for_bytes
from .cache.rope import rope_refusal_for
from .cache.for_model import (  # noqa: F401  (re-export)
    check_rule_budget, layer_devices, model_cache, output_projections, resolve_head_pool)
from .rules import Rule, get


def _validate(model: nn.Module, budget: int, backend: str | None, chunk_size: int | None, cudagraphs: bool) -> None:
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
    if cudagraphs and backend != "inductor":
        raise ValueError(f"cudagraphs=True needs backend='inductor' (CUDA graphs are an Inductor feature), got "
                         f"backend={backend!r}")
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


def _token_budget(model: nn.Module, budget, rule: Rule, head_pool: bool | None,
                  slot_dtype: str = "model") -> tuple[int, int | None]:
    """`budget` as tokens, and its bytes if it was a size (`cache.byte_budget`: the largest token budget whose cache,
    at the model's dtype and the run's layout, fits in them)."""
    size = byte_size(budget)  # raises on a malformed size
    if size is None:
        if isinstance(budget, str):
            raise ValueError(f"budget must be an int >= 1 (KV entries per layer and KV head) or a size in bytes such "
                             f"as '256MiB', got {budget!r}")
        return budget, None
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        raise ValueError(f"budget={budget!r}: a byte budget needs a model with a .config (its layers, KV heads and "
                         "head size give the bytes of an entry); pass a token budget (an int)")
    return model_tokens_for_bytes(budget, model, head_pool=resolve_head_pool(rule, head_pool),
                                  slot_dtype=slot_dtype), size


def compile(model: nn.Module, rule: str | Rule = "snapkv", budget: int | str = 1024, *, chunk_size: int | None = None,
            backend: str | None = "inductor", headroom: int = 0, block: int | None = DEFAULT_BLOCK,
            cudagraphs: bool = False, head_pool: bool | None = None, interval: int = 1, measure: str = "auto",
            signals: str | Iterable[str] | None = None, progress: bool = True, slot_dtype: str | None = None,
            **rule_params) -> nn.Module:
    """Run `model` with a KV cache of at most `budget` entries per layer and KV head, evicting with `rule`.

    The model is modified in place (its `forward` is wrapped) and returned; `model.forward.restore()` undoes it.
    Every rule runs the same kernel; only its scoring ops differ. Inference only: the wrapped forward always runs
    without autograd (under `torch.no_grad()`), also when called in grad mode. Compiled, every call length is
    bucketed (`fxbudget.compiler.buckets`): any sequence of lengths up to 128K tokens serves with at most 49 graphs per
    compiled region (one decoder-layer configuration) and eviction mode.

    Args:
        model: a Hugging Face causal LM using SDPA attention, or any module that calls
            `scaled_dot_product_attention` on keys/values from a `BudgetCache` passed as `cache` or
            `past_key_values` (transformers renamed the argument in 5.24; fxbudget accepts either and passes the
            name the model declares).
        rule: a registered rule name (`fxbudget.rules.available()`) or a `Rule` instance.
        budget: KV entries kept per full-attention layer and KV head, or a memory budget in bytes such as
            `"256MiB"` (units B, KB, MB, GB, KiB, MiB, GiB): the largest token budget whose cache for one sequence,
            at the model's dtype now, fits in it (keys, values and each entry's bookkeeping; sliding layers' windows
            included; `fxbudget.cache.byte_budget`). `model.forward.budget` is the token budget, `.budget_bytes`
            the size (None for a token budget).
        chunk_size: split inputs longer than this into chunks, so prefill memory is bounded by budget + chunk_size.
        backend: "inductor" (default), "aot_eager" or "eager" (Dynamo backends, same semantics), or None to run the
            kernel eagerly without torch.compile (the reference path).
        headroom: extra slots for caches created automatically (see `BudgetCache.frozen`).
        block: queries per block in the kernel's measure phase: a call's attention temporaries are
            O(block x candidates) whatever its length (a kernel setting: compare rules at one value; a call shorter
            than `block` is one block).
        measure: the form of the kernel's measure phase (a kernel setting, like `block`): "auto" (default) is
            "flex" on CUDA and "blocks" elsewhere. "blocks": query blocks against every candidate (the fastest exact
            form on a CPU). "flex": the output and each candidate's attention from two fused `flex_attention` calls,
            with no n x candidates scores (verified on a CPU and on an H200; on other devices it runs only with
            FXBUDGET_UNVERIFIED_FLEX=1). The same signals either way (docs/gpu.md).
        signals: the kernel's signal set (a kernel setting, like `measure`): None (default) measures what `rule`
            reads (its dry run, `fxbudget.kernel.signal_set`), "all" every signal (the kernel of a run that pools
            rows with others), or an explicit set of `MEASURED_SIGNALS` (a rule that reads outside it is refused).
            A signal not measured is absent from the rule's `Signals`; on the flex form, a set without `attn` and
            `acc_attn` skips the transposed call. Outputs and kept sets are the same under any set the rule's reads
            fit in.
        cudagraphs: with backend "inductor" on CUDA, replay the compiled graphs as CUDA graphs. The cache's tensors
            are marked static before the first compiled call, and generate()'s cache is reused across calls (see
            `BudgetForward`); each decoder layer's region is recorded once per layer and shape (the layers share
            one compiled graph but not their cache addresses).
        head_pool: the cache layout: the head-pooled one (`BudgetCache(head_pool=True)`), where a layer's heads
            share its slots, or the per-head slots (False). None (default): pooled iff the rule is head-adaptive
            (`AdaKV`, `"adakv:<rule>"`), which needs it. A uniform rule runs pooled with the same kept sets, at
            `kv_heads` times the slot-attention FLOPs (docs/DESIGN.md).
        interval: decode steps between evictions in caches created automatically (kvpress DecodingPress's
            `compression_interval`, its `target_size` the budget; default 1: every call evicts). Between evictions
            a layer grows by up to `interval - 1` entries beyond the budget (the slots are allocated up front) and
            the steps that do not evict skip the rule's scoring (they run the rule-independent frozen call); see
            `BudgetCache` and docs/DESIGN.md §3.
        slot_dtype: how the cache stores keys and values (a kernel setting, like `measure`): None (default) in the
            model's dtype; "float8_e4m3fn", "int8" or "int4" quantized per entry and KV head with a float32 scale
            (`fxbudget.kernel.slot_storage`): the attention and the rule read the stored values, a call's own new
            tokens are attended in the model's dtype, and a byte budget buys more entries.
        progress: print a line on stderr before and after a call of 512 tokens or more (a prefill: tens of seconds
            on a CPU) and, while decoding, one every 10 s (`fxbudget.compiler.progress`); False: silent.
        **rule_params: hyperparameters of a named rule, e.g. `window=64` for snapkv (for `"adakv:<rule>"`,
            `alpha` goes to AdaKV, the rest to the wrapped rule).

    Returns:
        The same model, whose forward (and therefore `generate`) now uses the budget cache. If its first call finds
        no SDPA attention fed by the cache, that call and every later one raise `NoBudgetAttentionError` (never a
        silent run of the unmodified model); `model.forward.restore()` undoes the wrapping.
    """
    rule_obj = get(rule, **rule_params)
    slot_dtype = check_slot_dtype(slot_dtype)
    budget, budget_bytes = _token_budget(model, budget, rule_obj, head_pool, slot_dtype)
    _validate(model, budget, backend, chunk_size, cudagraphs)
    resolve_head_pool(rule_obj, head_pool)
    if getattr(model, "config", None) is not None:
        check_rule_budget(rule_obj, budget, model.config)
    check_int("headroom", headroom, 0)
    check_int("interval", interval, 1)
    check_block(block)
    check_measure(measure)
    if measure == "flex" and backend == "inductor" and next(model.parameters()).device.type == "cpu":
        raise NotImplementedError(CPU_INDUCTOR)
    rope_refused = rope_refusal_for(model) if rule_obj.needs_rope and getattr(model, "config", None) is not None \
        else None
    if rope_refused:
        raise ValueError(f"rule {rule_obj.name!r} needs the model's RoPE frequencies, and fxbudget cannot give them "
                         f"for this model: {rope_refused}")
    if rule_obj.needs_wo and getattr(model, "config", None) is not None \
            and any(w is None for w in output_projections(model)):
        raise ValueError(f"rule {rule_obj.name!r} needs each attention layer's output projection (W_o), and fxbudget "
                         "cannot find it in this model (attention modules with a layer_idx and a linear o_proj)")
    spec = MeasureSpec(form=measure, signals=run_signals([rule_obj], signals))  # raises in one line
    forward = BudgetForward(model, rule_obj, budget, chunk_size=chunk_size, backend=backend, headroom=headroom,
                            block=block, cudagraphs=cudagraphs, head_pool=head_pool, interval=interval,
                            measure=spec, progress=progress, slot_dtype=slot_dtype)
    forward.budget_bytes = budget_bytes
    return forward.install()
