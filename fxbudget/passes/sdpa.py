"""The SDPA pass: locate every SDPA node fed by a BudgetCache marker, splice in the budget-attention kernel.

For each `scaled_dot_product_attention` node of a Dynamo graph, the key argument is walked back (through repeat_kv's
views, slicing, dtype moves) to the `fxbudget::candidates` marker emitted by `BudgetCache.update`. The node is then
replaced by the kernel's three phases (`measure`, `rule_region`, `evict`), each traced to core aten ops with `make_fx`
and inlined; rule ops are tagged `node.meta["fxbudget_region"] = "rule"` (what `kernel_fingerprint` abstracts). The
marker, the repeat_kv chain and the mask then have no users and are removed; in-place state updates are kept.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..cache import MARKER_TENSORS  # importing cache also registers the marker op
from ..kernel import SIGNAL_NAMES, evict, measure, rule_region
from ..rules.base import Rule

log = logging.getLogger("fxbudget")

MARKERS = (torch.ops.fxbudget.candidates, torch.ops.fxbudget.candidates.default)
REGION_KEY = "fxbudget_region"
_VIEW_METHODS = {"expand", "reshape", "view", "contiguous", "to", "repeat_interleave", "unsqueeze", "__getitem__"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.unsqueeze, torch.repeat_interleave}


@dataclass
class RewriteReport:
    rewritten: list[str] = field(default_factory=list)  # the rewritten SDPA nodes
    untouched: list[str] = field(default_factory=list)  # SDPA nodes not fed by a BudgetCache (cross-attention, ...)


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention


def find_marker(node: fx.Node, index: int, max_hops: int = 16) -> fx.Node | None:
    """The marker whose output `index` (0 = keys, 1 = values) reaches `node` through view-like ops only."""
    for _ in range(max_hops):
        if not isinstance(node, fx.Node):
            return None
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and node.args[0].target in MARKERS:
            return node.args[0] if node.args[1] == index else None
        passes = (node.op == "call_method" and node.target in _VIEW_METHODS) or \
                 (node.op == "call_function" and node.target in _VIEW_FUNCTIONS)
        if not passes or not node.args:
            return None
        node = node.args[0]
    return None


def _example(node: fx.Node) -> torch.Tensor:
    ev = node.meta.get("example_value")
    if not isinstance(ev, torch.Tensor):
        raise RuntimeError(f"fxbudget: graph node {node.name} has no example tensor; cannot trace the kernel")
    if any(not isinstance(s, int) for s in (*ev.shape, *ev.stride())):
        raise RuntimeError("fxbudget: dynamic shapes reached the SDPA pass; compile with dynamic=False")
    return ev


def _splice(gm: fx.GraphModule, sub: fx.GraphModule, inputs: list[fx.Node], before: fx.Node, region: str):
    """Copy `sub`'s ops into `gm` before `before`, its placeholders bound to `inputs`; returns its outputs."""
    env: dict[fx.Node, fx.Node] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], inputs))
    graph = gm.graph
    with graph.inserting_before(before):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                return pytree.tree_map(lambda x: env[x] if isinstance(x, fx.Node) else x, n.args[0])
            if n.op == "get_attr":  # tensor constants created inside the kernel
                name = f"_fxbudget_const{len([a for a in dir(gm) if a.startswith('_fxbudget_const')])}"
                setattr(gm, name, getattr(sub, n.target))
                new = graph.get_attr(name)
            else:
                new = graph.node_copy(n, lambda x: env[x])
            new.meta[REGION_KEY] = region
            env[n] = new
    raise AssertionError("traced kernel has no output")


def _trace(fn, fakes, mode: FakeTensorMode) -> fx.GraphModule:
    with mode:
        return make_fx(fn, tracing_mode="real")(*fakes)


_MEASURE_ARGS = ("q", "k_slots", "v_slots", "pos_slots", "state", "norms", "k_new", "v_new", "new_pos", "inv_freq")
_EVICT_SIGNALS = ("pos", "acc_attn", "key_norm", "value_norm")
_EVICT_ARGS = ("k_slots", "v_slots", "pos_slots", "state", "norms", "totals", "k_new", "v_new")


@dataclass
class KernelTrace:
    """The kernel's three phases traced to aten graphs for one layer configuration."""

    measure: fx.GraphModule
    rule: fx.GraphModule
    evict: fx.GraphModule


def trace_kernel(ev: dict[str, torch.Tensor], rule: Rule, *, budget: int, keep: int, sliding: int, window: int,
                 scale: float | None) -> KernelTrace:
    """Trace `measure`, `rule_region` and `evict` on fake tensors shaped like the example values `ev`."""
    mode = FakeTensorMode()
    with mode:
        fake = {k: torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
                for k, v in ev.items()}
    phase1 = functools.partial(measure, window=window, sliding=sliding, scale=scale)
    phase2 = functools.partial(rule_region, rule, budget, min(window, fake["k_new"].shape[2]))
    phase3 = functools.partial(evict, keep=keep)
    with mode:
        _, f_totals, *f_signals = phase1(*[fake[a] for a in _MEASURE_ARGS])
        f_score = phase2(*f_signals)
    f_sig = dict(zip(SIGNAL_NAMES, f_signals))
    return KernelTrace(
        _trace(phase1, [fake[a] for a in _MEASURE_ARGS], mode),
        _trace(phase2, f_signals, mode),
        _trace(phase3, [f_score, *[f_sig[a] for a in _EVICT_SIGNALS], f_totals, *[fake[a] for a in _EVICT_ARGS]],
               mode))


def rewrite(gm: fx.GraphModule, rule: Rule, window: int, sliding_rule: Rule) -> RewriteReport:
    """Replace every marker-fed SDPA node of `gm` in place; returns what was rewritten and what was left alone."""
    report = RewriteReport()
    traces: dict[tuple, KernelTrace] = {}  # layers of one model share shapes: trace once per configuration
    for node in [n for n in gm.graph.nodes if is_sdpa(n)]:
        args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args))
        args.update(node.kwargs)
        marker = find_marker(args["key"], 0)
        if marker is None or find_marker(args["value"], 1) is not marker:
            report.untouched.append(node.name)
            continue
        if args.get("dropout_p", 0.0):
            raise RuntimeError("fxbudget: SDPA with dropout (training mode?) cannot use a budget cache; call .eval()")
        graph_in = {**dict(zip(MARKER_TENSORS, marker.args)), "q": args["query"]}
        budget, keep, sliding = marker.args[len(MARKER_TENSORS):]
        ev = {name: _example(n) for name, n in graph_in.items()}
        key = (tuple((k, tuple(v.shape), tuple(v.stride()), v.dtype, v.device) for k, v in ev.items()),
               budget, keep, sliding, args.get("scale"))
        if key not in traces:
            traces[key] = trace_kernel(ev, sliding_rule if sliding else rule, budget=budget, keep=keep,
                                       sliding=sliding, window=window, scale=args.get("scale"))
        kt = traces[key]

        # Splice each phase before the SDPA node, feeding its outputs to the next phase.
        out, totals, *signals = _splice(gm, kt.measure, [graph_in[a] for a in _MEASURE_ARGS], node, "measure")
        score = _splice(gm, kt.rule, signals, node, "rule")
        sig = dict(zip(SIGNAL_NAMES, signals))
        _splice(gm, kt.evict, [score, *[sig[a] for a in _EVICT_SIGNALS], totals, *[graph_in[a] for a in _EVICT_ARGS]],
                node, "evict")
        report.rewritten.append(node.name)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)

    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    gm.recompile()
    if report.untouched:
        log.warning("fxbudget: %d SDPA call(s) not fed by a BudgetCache left unchanged: %s",
                    len(report.untouched), ", ".join(report.untouched))
    return report


def _is_impure(node: fx.Node) -> bool:
    # Dynamo records in-place tensor methods (e.g. the cache's `seen.add_`) as call_method nodes with no users.
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") \
            and not node.target.startswith("__"):
        return True
    return node.is_impure()
