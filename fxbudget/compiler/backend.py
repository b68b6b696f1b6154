"""The `fxbudget` Dynamo backend: run the SDPA pass, then hand the graph to Inductor (or aot_eager/eager)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx

from ..kernel import DEFAULT_BLOCK, DEFAULT_WINDOW
from ..kernel.flex_measure import check_backend
from ..kernel.marker import NoBudgetAttentionError
from ..passes.sdpa import rewrite
from ..rules import Rule, get

INNER_BACKENDS = ("inductor", "aot_eager", "eager")
REWRITE_KEY = "fxbudget_rewrite"  # gm.meta key of the pass's RewriteReport (layers rewritten, SDPA left alone)


def kernel_window(rule: Rule) -> int:
    """The observation window of a run: the rule's own `window` if it has one (an int >= 1), else the kernel default.

    Raises:
        ValueError: for a window that is not an int >= 1 (0 used to fall back to the default silently).
    """
    window = rule.window
    if window is None:
        return DEFAULT_WINDOW
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"rule {rule.name or type(rule).__name__!r}: window must be an int >= 1, "
                         f"got {window!r}")
    return window


def inductor(gm: fx.GraphModule, example_inputs, cudagraphs: bool = False):
    """Inductor on a rewritten graph, with the settings every fxbudget compile uses."""
    from torch._inductor.compile_fx import compile_fx

    # Locality reordering would move the attention-output matmul after the slot write-back, which then cannot
    # be done in place (a full copy of the K/V cache per call); the kernel's own op order is already good.
    patches = {"reorder_for_locality": False}
    if cudagraphs:
        patches["triton.cudagraphs"] = True
    return compile_fx(gm, example_inputs, config_patches=patches)


def make_backend(rule: str | Rule = "snapkv", *, inner: str = "inductor",
                 on_graph: Callable[[fx.GraphModule], None] | None = None, cudagraphs: bool = False,
                 block: int | None = DEFAULT_BLOCK, observation_window: int | None = None, budget_ints: bool = True,
                 measure: str = "auto",
                 **rule_params):
    """A Dynamo backend that rewrites SDPA for `rule` and compiles with `inner`.

    Args:
        rule: rule name or instance. inner: "inductor" (default), "aot_eager" or "eager" (same semantics, for
            debugging). on_graph: called with each rewritten graph before `inner` compiles it.
        cudagraphs: with "inductor" on CUDA, wrap the compiled graph in CUDA graphs (what `mode="reduce-overhead"`
            does for the plain inductor backend; `mode=` cannot be combined with a custom backend). The cache tensors
            are mutated in place, so mark them with `torch._dynamo.mark_static_address` first, or Inductor skips
            CUDA graphs for the graph.
        block: queries per block of the kernel's measure phase (a kernel setting: one value per comparison).
        measure: the measure phase's form, "auto", "blocks" or "flex" (`kernel.settings.measure_form`).
        observation_window: the kernel's observation window (default: the rule's, `kernel_window(rule)`); not
            `window=`, which stays a rule parameter (snapkv's window).
        budget_ints: mark the budget-derived ints of each kernel for `graph_fingerprint` (a second trace of the
            kernel per layer configuration: about a sixth of an aot_eager compile of a tiny model). False for
            graphs that are compiled and never hashed; the graphs are the same.
        **rule_params: hyperparameters for a named rule.
    Returns:
        A callable `(gm, example_inputs, **kwargs) -> compiled forward` for `torch.compile(backend=...)`.
    """
    if inner not in INNER_BACKENDS:
        raise ValueError(f"backend must be one of {INNER_BACKENDS}, got {inner!r}")
    rule = get(rule, **rule_params)
    window = kernel_window(rule) if observation_window is None else observation_window
    sliding_rule = get("window")

    def fxbudget_backend(gm: fx.GraphModule, example_inputs, **kwargs):
        report = rewrite(gm, rule, window, sliding_rule, block, budget_ints=budget_ints, measure=measure)
        check_backend(gm, inner)  # the flex form under Inductor on a CPU: refused by name
        gm.meta[REWRITE_KEY] = report  # what `fxbudget inspect` summarizes
        if not report.rewritten:
            raise NoBudgetAttentionError(
                "fxbudget found no scaled_dot_product_attention fed by a BudgetCache in the traced graph "
                f"({len(report.untouched)} SDPA call(s) not fed by one). Is the model's attention implementation "
                "'sdpa' and does it read keys/values from past_key_values.update()?")
        if on_graph is not None:
            on_graph(gm)
        if inner == "eager":
            return gm.forward
        if inner == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, example_inputs)
        return inductor(gm, example_inputs, cudagraphs=cudagraphs)

    fxbudget_backend.rule, fxbudget_backend.window = rule, window
    return fxbudget_backend


@torch._dynamo.register_backend(name="fxbudget")
def fxbudget(gm: fx.GraphModule, example_inputs, rule: str | Rule = "snapkv", inner: str = "inductor", **kwargs):
    """`torch.compile(model, backend="fxbudget")`: the SDPA rewrite for `rule` (default snapkv), then Inductor."""
    return make_backend(rule, inner=inner)(gm, example_inputs)
