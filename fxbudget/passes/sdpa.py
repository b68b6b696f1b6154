"""The SDPA pass: locate every SDPA node fed by a BudgetCache marker, splice in the budget-attention kernel.

For each `scaled_dot_product_attention` node of a Dynamo graph, the key argument is walked back (through repeat_kv's
views, slicing, dtype moves) to the `fxbudget::candidates` marker emitted by `BudgetCache.update`. The node is then
replaced by the kernel's three phases (`kernel.pipeline`: `measure_phase`, `rule_phase`, `evict_phase`, the functions
the eager path runs), each traced to core aten ops with `make_fx` on the kernel's named state and inlined; rule ops are tagged `node.meta["fxbudget_region"] = "rule"` (what `kernel_fingerprint` abstracts). The
marker and the repeat_kv chain then have no users and are removed; in-place state updates are kept.

Each spliced kernel node also carries its integer arguments in `node.meta["fxbudget_ints"]`, those that grow with the
layer's budget written as `BudgetInt` (what `graph_fingerprint` hashes instead of the raw values).
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from ..kernel import marker  # noqa: F401  (importing it registers the marker op)
from ..kernel import DEFAULT_BLOCK, MARKER_TENSORS, evict_phase, from_marker, layout, measure_phase, rule_phase
from ..kernel.marker import NoBudgetAttentionError
from ..kernel.contract import RuleContractError, rule_name, storage_id, written_args
from ..rules.base import Rule
from .sdpa_args import bind, check

log = logging.getLogger("fxbudget")

MARKERS = (torch.ops.fxbudget.candidates, torch.ops.fxbudget.candidates.default)
REGION_KEY = "fxbudget_region"
INTS_KEY = "fxbudget_ints"
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


def _walk_stop(node: fx.Node, max_hops: int = 16) -> fx.Node:
    """The node where `find_marker`'s walk back from `node` stops (the first op it does not follow)."""
    for _ in range(max_hops):
        passes = isinstance(node, fx.Node) and node.args and isinstance(node.args[0], fx.Node) and (
            (node.op == "call_method" and node.target in _VIEW_METHODS)
            or (node.op == "call_function" and node.target in _VIEW_FUNCTIONS))
        if not passes:
            return node
        node = node.args[0]
    return node


def _markers_upstream(node: fx.Node) -> list[fx.Node]:
    """Every marker `node` depends on, through any ops."""
    seen, todo, found = set(), [node], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target in MARKERS:
            found.append(n)
            continue
        todo.extend(n.all_input_nodes)
    return found


def _op_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def refuse_unbudgeted(gm: fx.GraphModule, untouched: list[fx.Node]) -> None:
    """Refuse a graph where a BudgetCache's keys/values reach attention the pass did not rewrite: an SDPA call whose
    key or value comes from a marker through an op the pass does not walk (`.clone()`, `.float()`, ...), or a marker
    still used after the rewrite (attention computed without SDPA). Run after the rewrite and dead-code elimination.

    Raises:
        NoBudgetAttentionError: naming the layer(s) and the op where the link to the cache was lost.
    """
    for node in untouched:
        args = bind(node.args, node.kwargs)
        for name in ("key", "value"):
            stop = _walk_stop(args[name])
            markers = _markers_upstream(stop) if isinstance(stop, fx.Node) else []
            if markers:
                layers = sorted({m.args[len(MARKER_TENSORS)] for m in markers})
                raise NoBudgetAttentionError(
                    f"layer {', '.join(map(str, layers))}: scaled_dot_product_attention ({node.name}) reads the "
                    f"BudgetCache's {name}s through `{_op_name(stop)}`, an op fxbudget does not follow (it follows "
                    f"views, slicing, expand/reshape, .to and repeat_interleave); refused rather than run that layer "
                    "without its budget")
    left = [n for n in gm.graph.nodes if n.target in MARKERS]
    if left:
        users = sorted({_op_name(u) for m in left for g in m.users for u in g.users})
        raise NoBudgetAttentionError(
            f"layer {', '.join(str(m.args[len(MARKER_TENSORS)]) for m in left)}: the BudgetCache's keys/values "
            f"reach {', '.join(users) or 'other ops'} instead of scaled_dot_product_attention; fxbudget can only "
            "budget attention computed by SDPA")


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


def _trace(fn, args: tuple, mode: FakeTensorMode) -> fx.GraphModule:
    """`make_fx` of `fn(*args)`, `args` a pytree (the kernel's named state): the graph's placeholders are its
    leaves in `pytree.tree_flatten` order, which `_splice` binds the same way."""
    flat, spec = pytree.tree_flatten(args)

    def flat_fn(*leaves):
        return fn(*pytree.tree_unflatten(list(leaves), spec))

    # Outside Dynamo's tracing context: the kernel's own fake mode (and its shape environment) must be the one
    # make_fx finds, not the one of the graph being compiled.
    with torch._guards.tracing(None), mode:
        return make_fx(flat_fn, tracing_mode="real")(*flat)


@dataclass
class KernelTrace:
    """The kernel's three phases traced to aten graphs for one layer configuration."""

    measure: fx.GraphModule
    rule: fx.GraphModule
    evict: fx.GraphModule


@dataclass(frozen=True)
class BudgetInt:
    """An integer argument of a kernel op that grows with the layer's budget: `per_slot * slots + offset`."""

    per_slot: int
    offset: int

    def __repr__(self) -> str:
        return f"{self.per_slot}*S{self.offset:+d}"


def _ints(node: fx.Node) -> list[int]:
    """The node's integer arguments (bools excluded), args then kwargs, in `torch.fx.node.map_aggregate` order."""
    out: list[int] = []

    def visit(a):
        if isinstance(a, int) and not isinstance(a, bool):
            out.append(a)
        return a

    torch.fx.node.map_aggregate(node.args, visit)
    torch.fx.node.map_aggregate(node.kwargs, visit)
    return out


def _mark_budget_ints(base: fx.GraphModule, grown: fx.GraphModule, slots: int) -> None:
    """Store each node's ints in `meta[INTS_KEY]`, with those that change between `base` and `grown` (the same phase
    traced with one more slot and one more kept entry) as `BudgetInt`. If the two graphs differ in structure (a
    size-dependent code path), the ints stay literal: the fingerprint then differs across budgets, never hides a
    difference."""
    a, b = list(base.graph.nodes), list(grown.graph.nodes)
    same = len(a) == len(b) and all(x.op == y.op and x.target == y.target and len(_ints(x)) == len(_ints(y))
                                    for x, y in zip(a, b))
    for i, x in enumerate(a):
        ints = _ints(x)
        if same:
            ints = [v if w == v else BudgetInt(w - v, v - (w - v) * slots) for v, w in zip(ints, _ints(b[i]))]
        x.meta[INTS_KEY] = ints
        sub = getattr(base, x.target) if x.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):  # a higher-order op's body (measure's scan over query blocks)
            _mark_budget_ints(sub, getattr(grown, b[i].target) if same else sub, slots)


def _grown(t: torch.Tensor, dim: int) -> torch.Tensor:
    """An empty tensor like `t` (same dtype, device, stride order) with one more element along `dim`."""
    shape = list(t.shape)
    shape[dim] += 1
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))  # outermost first, as laid out in memory
    return torch.empty([shape[i] for i in order], dtype=t.dtype, device=t.device).permute(
        [order.index(i) for i in range(t.dim())])


def _check_pure(gm: fx.GraphModule, rule: Rule) -> None:
    """The traced rule region must not write a signal (a backstop: `rule_region` refuses it while tracing)."""
    inputs = {storage_id(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable and any(
                isinstance(a, fx.Node) and storage_id(a.meta["val"]) in inputs
                for a in written_args(node.target, node.args, node.kwargs)):
            raise RuleContractError(f"rule {rule_name(rule)!r} writes a signal tensor in place "
                                    f"({node.target}): a rule must be a pure function of the signals")


def _trace_phases(fake: dict, rule: Rule, *, budget: int, keep: int, sliding: int, window: int,
                  scale: float | None, block: int, mode: FakeTensorMode, pooled: bool = False,
                  empty: bool = False, measure: str = "auto") -> KernelTrace:
    lay = layout(pooled)
    q, (slots, new, const) = fake["q"], from_marker([fake[a] for a in MARKER_TENSORS])
    phase1 = functools.partial(measure_phase, lay, window=window, sliding=sliding, scale=scale, block=block,
                               traced=True, empty=empty, form=measure)
    # Pooled, the allocation step is part of the rule region (so uniform and adaptive runs share one fingerprint).
    phase2 = functools.partial(rule_phase, lay, rule, budget, window)
    phase3 = functools.partial(evict_phase, lay, keep=keep)
    # Each phase is traced once; the next phase is traced on the fake values of the previous one's outputs.
    traced_measure = _trace(phase1, (q, slots, new, const), mode)
    _, f_totals, f_signals = _output_values(traced_measure)
    traced_rule = _trace(phase2, (f_signals,), mode)
    f_score = _output_values(traced_rule)
    return KernelTrace(traced_measure, traced_rule,
                       _trace(phase3, (f_score, f_signals, f_totals, slots, new), mode))


def _output_values(gm: fx.GraphModule):
    """The fake values a traced graph returns (make_fx records them as node metadata)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return pytree.tree_map(lambda x: x.meta["val"] if isinstance(x, fx.Node) else x, out)


_SLOT_TENSORS = ("keys", "values", "pos", "state", "norms", "owner")  # slot dim 2


def trace_kernel(ev: dict[str, torch.Tensor], rule: Rule, *, budget: int, keep: int, sliding: int, window: int,
                 scale: float | None, block: int | None = DEFAULT_BLOCK, pooled: bool = False,
                 budget_ints: bool = True, empty: bool = False, measure: str = "auto") -> KernelTrace:
    """Trace `measure`, `rule_region` and `evict` on fake tensors shaped like the example values `ev`.

    With `budget_ints`, `measure` and `evict` are traced a second time with one more slot and `keep + 1`, to find
    which of their integer arguments grow with the budget (`_mark_budget_ints`, what `graph_fingerprint` hashes);
    without, the graphs are the same and carry no `INTS_KEY` (a compiled forward never hashes them).
    """
    # Every shape is static (the scan over query blocks included); a shape environment is what make_fx expects.
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fake = {k: torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
                for k, v in ev.items()}
        grown = {k: _grown(v, 2) if k in _SLOT_TENSORS else v for k, v in fake.items()}
    kt = _trace_phases(fake, rule, budget=budget, keep=keep, sliding=sliding, window=window, scale=scale,
                       block=block, mode=mode, pooled=pooled, empty=empty, measure=measure)
    _check_pure(kt.rule, rule)
    if not budget_ints:
        return kt
    big = _trace_phases(grown, rule, budget=budget + 1, keep=keep + 1, sliding=sliding, window=window, scale=scale,
                        block=block, mode=mode, pooled=pooled, empty=empty, measure=measure)
    slots = ev["keys"].shape[2]
    _mark_budget_ints(kt.measure, big.measure, slots)
    _mark_budget_ints(kt.evict, big.evict, slots)
    return kt


def rewrite(gm: fx.GraphModule, rule: Rule, window: int, sliding_rule: Rule,
            block: int | None = DEFAULT_BLOCK, budget_ints: bool = True,
            layer_rules: Mapping[int, Rule] | None = None, measure: str = "auto") -> RewriteReport:
    """Replace every marker-fed SDPA node of `gm` in place; returns what was rewritten and what was left alone.
    `budget_ints`: mark the kernel's budget-derived ints for `graph_fingerprint` (`trace_kernel`).
    `layer_rules`: a rule per cache layer index in place of `rule` (sliding layers keep `sliding_rule`): the tests
    build every rule's layer into one graph, so Inductor compiles them once, not once per rule.
    `measure`: the measure phase's form (`kernel.settings.measure_form`; "auto": flex on CUDA, blocks elsewhere)."""
    report = RewriteReport()
    untouched: list[fx.Node] = []
    traces: dict[tuple, KernelTrace] = {}  # layers of one model share shapes: trace once per configuration
    for node in [n for n in gm.graph.nodes if is_sdpa(n)]:
        args = bind(node.args, node.kwargs)
        marker = find_marker(args["key"], 0)
        if marker is None or find_marker(args["value"], 1) is not marker:
            report.untouched.append(node.name)
            untouched.append(node)
            continue
        mask = args["attn_mask"]
        scale = check(args, mask_dtype=_example(mask).dtype if isinstance(mask, fx.Node) else None)
        graph_in = {**dict(zip(MARKER_TENSORS, marker.args)), "q": args["query"]}
        layer, budget, keep, sliding, pooled, empty = marker.args[len(MARKER_TENSORS):]
        ev = {name: _example(n) for name, n in graph_in.items()}
        layer_rule = sliding_rule if sliding else (layer_rules or {}).get(layer, rule)
        key = (tuple((k, tuple(v.shape), tuple(v.stride()), v.dtype, v.device) for k, v in ev.items()),
               budget, keep, sliding, scale, pooled, empty, id(layer_rule))
        if key not in traces:
            traces[key] = trace_kernel(ev, layer_rule, budget=budget, keep=keep,
                                       sliding=sliding, window=window, scale=scale, block=block, pooled=pooled,
                                       budget_ints=budget_ints, empty=empty, measure=measure)
        kt = traces[key]

        # Splice each phase before the SDPA node, feeding its outputs to the next phase (the same pytrees of graph
        # nodes as the traces' fake tensors: `_trace` flattens both alike).
        slots, new, const = from_marker([graph_in[a] for a in MARKER_TENSORS])
        flat = lambda *tree: pytree.tree_flatten(tree)[0]  # noqa: E731
        out, totals, signals = _splice(gm, kt.measure, flat(graph_in["q"], slots, new, const), node, "measure")
        score = _splice(gm, kt.rule, flat(signals), node, "rule")
        _splice(gm, kt.evict, flat(score, signals, totals, slots, new), node, "evict")
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        report.rewritten.append(layer)

    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    refuse_unbudgeted(gm, untouched)
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
