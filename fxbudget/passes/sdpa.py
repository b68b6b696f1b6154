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
    rewritten: list[int] = field(default_factory=list)  # layer index of each rewritten SDPA node
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


def _fake_like(mode: FakeTensorMode, node: fx.Node) -> torch.Tensor:
    ev = node.meta.get("example_value")
    if not isinstance(ev, torch.Tensor):
        raise RuntimeError(f"fxbudget: graph node {node.name} has no example tensor; cannot trace the kernel")
    if any(not isinstance(s, int) for s in (*ev.shape, *ev.stride())):
        raise RuntimeError("fxbudget: dynamic shapes reached the SDPA pass; compile with dynamic=False")
    with mode:
        return torch.empty_strided(tuple(ev.shape), tuple(ev.stride()), dtype=ev.dtype, device=ev.device)


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


def rewrite(gm: fx.GraphModule, rule: Rule, window: int, sliding_rule: Rule) -> RewriteReport:
    """Replace every marker-fed SDPA node of `gm` in place; returns what was rewritten and what was left alone."""
    report = RewriteReport()
    for node in [n for n in gm.graph.nodes if is_sdpa(n)]:
        args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args))
        args.update(node.kwargs)
        marker = find_marker(args["key"], 0)
        if marker is None or find_marker(args["value"], 1) is not marker:
            report.untouched.append(node.name)
            continue
        if args.get("dropout_p", 0.0):
            raise RuntimeError("fxbudget: SDPA with dropout (training mode?) cannot use a budget cache; call .eval()")
        m = dict(zip(MARKER_TENSORS, marker.args))
        layer, budget, keep, sliding = marker.args[len(MARKER_TENSORS):]
        layer_rule = sliding_rule if sliding else rule
        mode = FakeTensorMode()
        fake = {name: _fake_like(mode, node_) for name, node_ in m.items()}
        fake["q"] = _fake_like(mode, args["query"])
        measure_args = ("q", "k_slots", "v_slots", "pos_slots", "state", "norms", "k_new", "v_new", "new_pos")
        evict_args = ("k_slots", "v_slots", "pos_slots", "state", "norms", "totals", "k_new", "v_new")
        graph_in = {**m, "q": args["query"]}
        w = min(window, fake["k_new"].shape[2])
        phase1 = functools.partial(measure, window=window, sliding=sliding, scale=args.get("scale"))
        phase2 = functools.partial(rule_region, layer_rule, budget, w)

        # Trace each phase on fake tensors, splice it before the SDPA node, feed its outputs to the next phase.
        with mode:
            f_out, f_totals, *f_signals = phase1(*[fake[a] for a in measure_args])
            f_score = phase2(*f_signals)
        out, totals, *signals = _splice(gm, _trace(phase1, [fake[a] for a in measure_args], mode),
                                        [graph_in[a] for a in measure_args], node, "measure")
        score = _splice(gm, _trace(phase2, f_signals, mode), signals, node, "rule")
        sig, f_sig = dict(zip(SIGNAL_NAMES, signals)), dict(zip(SIGNAL_NAMES, f_signals))
        from_signals = ("pos", "acc_attn", "key_norm", "value_norm")
        phase3 = functools.partial(evict, keep=keep)
        _splice(gm, _trace(phase3, [f_score, *[f_sig[a] for a in from_signals], f_totals,
                                    *[fake[a] for a in evict_args]], mode),
                [score, *[sig[a] for a in from_signals], totals, *[graph_in[a] for a in evict_args]],
                node, "evict")

        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        report.rewritten.append(layer)

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
