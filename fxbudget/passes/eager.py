"""The eager path: the same rewrite as the SDPA pass, done at call time.

While `BudgetAttentionMode` is active, the marker's outputs carry their arguments (`MarkerCall`); views and copies of
them (repeat_kv's expand/reshape, slicing) inherit it; an SDPA call whose key carries it runs the kernel (`kernel.attend`)
instead, exactly as the compiled graph does after the pass. This is the test oracle for the compiled path.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernel import DEFAULT_BLOCK, attend, from_marker
from ..kernel.marker import MARKER_TENSORS, NoBudgetAttentionError
from ..rules.base import Rule
from .sdpa_args import bind, check

_active = threading.local()

# Ops that carry a candidate K/V through unchanged in content (repeat_kv, slicing, dtype/device moves).
_PASS_THROUGH = {
    torch.Tensor.__getitem__, torch.Tensor.expand, torch.Tensor.reshape, torch.reshape, torch.Tensor.view,
    torch.Tensor.contiguous, torch.Tensor.to, torch.Tensor.repeat_interleave, torch.repeat_interleave,
    torch.Tensor.unsqueeze, torch.unsqueeze,
}


def require_interceptor() -> "BudgetAttentionMode":
    mode = getattr(_active, "mode", None)
    if mode is None:
        raise RuntimeError(
            "a BudgetCache was used outside fxbudget: call the model returned by fxbudget.compile(...) "
            "(a plain forward would run SDPA over unordered slots and give wrong results)")
    return mode


class BudgetAttentionMode(TorchFunctionMode):
    """Replace SDPA over a BudgetCache's candidates with the kernel (`kernel.attend`), eagerly."""

    def __init__(self, rule: Rule, window: int, sliding_rule: Rule, block: int | None = DEFAULT_BLOCK,
                 measure: str = "auto"):
        super().__init__()
        self.rule, self.window, self.sliding_rule, self.block = rule, window, sliding_rule, block
        self.measure = measure  # the measure phase's form (`kernel.settings.measure_form`)
        self.pending: dict[int, int] = {}  # marker calls not (yet) consumed by an SDPA call: id -> layer

    def __enter__(self):
        self._prev = getattr(_active, "mode", None)
        _active.mode = self
        return super().__enter__()

    def __exit__(self, *exc):
        _active.mode = self._prev
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = bind(args, kwargs)
            call = getattr(bound["key"], "_fxbudget", None)
            if call is not None:
                return run_kernel(bound["query"], call, check(bound), self)
            for name in ("key", "value"):
                lost = getattr(bound[name], "_fxbudget_lost", None)
                if lost is not None:  # the compiled pass refuses the same graph (passes.sdpa.refuse_unbudgeted)
                    raise NoBudgetAttentionError(
                        f"layer {lost[0]}: scaled_dot_product_attention reads the BudgetCache's {name}s through "
                        f"`{lost[1]}`, an op fxbudget does not follow (it follows views, slicing, expand/reshape, "
                        ".to and repeat_interleave); refused rather than run that layer without its budget")
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and args:
            src = args[0]
            call = getattr(src, "_fxbudget", None)
            if call is not None and func in _PASS_THROUGH:
                out._fxbudget = call
            elif call is not None:  # the link to the cache is lost here: remember where, for the error above
                if out is src:  # an identity (`.float()` of fp32): a fresh view carries the mark, not the marker
                    with torch._C.DisableTorchFunctionSubclass():
                        out = out.view_as(out)
                out._fxbudget_lost = (call.layer, getattr(func, "__name__", str(func)))
            elif getattr(src, "_fxbudget_lost", None) is not None:
                out._fxbudget_lost = src._fxbudget_lost
        return out


@contextlib.contextmanager
def recording():
    """Collect `(query, MarkerCall, scale)` of every eager kernel call inside, in call order.

    The harness uses this to run one shared prefill and replay each layer's kernel call on other caches
    (`fxbudget.harness.branch`): in a call on an empty cache the layer's output does not depend on the rule.
    """
    prev = getattr(_active, "record", None)
    _active.record = calls = []
    try:
        yield calls
    finally:
        _active.record = prev


def run_kernel(query, call, scale, cfg: BudgetAttentionMode):
    """The kernel (`kernel.attend`) for one marker call, with the rule the layer uses (sliding layers keep their window)."""
    n = call.tensors[MARKER_TENSORS.index("k_new")].shape[2]
    kv_heads = call.tensors[0].shape[1]
    if n == 1 and query.dim() == 4 and query.shape[1] == kv_heads and query.shape[2] > 1:
        # transformers' eager decode packs a GQA query [b, q_heads, 1, d] as [b, kv_heads, group, d] (`pack_gqa`,
        # when it does not pass enable_gqa) and reshapes the output back by element order: unpack it here, instead of
        # setting TRANSFORMERS_SDPA_FORCE_GQA process-wide.
        query = query.reshape(query.shape[0], kv_heads * query.shape[2], 1, query.shape[3])
    if query.dim() != 4 or query.shape[2] != n or query.shape[1] % kv_heads:
        raise RuntimeError(
            f"SDPA query of shape {tuple(query.shape)} does not match layer {call.layer}'s cache call "
            f"(n={n}, kv_heads={kv_heads}); expected [batch, q_heads, n, head_dim]")
    cfg.pending.pop(id(call), None)
    record = getattr(_active, "record", None)
    if record is not None:
        record.append((query, call, scale))
    rule = cfg.sliding_rule if call.sliding else cfg.rule
    slots, new, const = from_marker(call.tensors)
    return attend(query, slots, new, const, rule=rule, budget=call.budget, keep=call.keep, pooled=call.pooled,
                  sliding=call.sliding, window=cfg.window, scale=scale, block=cfg.block, empty=call.empty,
                  measure=cfg.measure)
