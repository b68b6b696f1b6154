"""What `fxbudget inspect` prints: per layer, the SDPA calls found and rewritten; the kernel fingerprint; one
layer's kernel region (`measure`, the rule's ops, `evict`) as code, or the whole rewritten graph."""

from __future__ import annotations

import torch
from torch import fx, nn

from ..compiler.backend import REWRITE_KEY
from .fingerprint import FINGERPRINT_COVERS, captured_graphs, kernel_fingerprint
from ..kernel.settings import signals_label
from ..kernel.signal_set import run_signals
from ..cache.for_model import model_cache
from ..passes.sdpa import REGION_KEY
from ..rules import Rule, get


def kernel_regions(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The spliced kernel of each rewritten SDPA call, in graph order (the order of `RewriteReport.rewritten`)."""
    regions: list[list[fx.Node]] = []
    prev = None
    for node in gm.graph.nodes:
        phase = node.meta.get(REGION_KEY)
        if phase is None:
            prev = None
            continue
        if prev is None or (phase == "measure" and prev != "measure"):  # a new layer's kernel starts
            regions.append([])
        regions[-1].append(node)
        prev = phase
    return regions


RULE_BEGIN = "# ---- rule region: the rule's scoring ops (masked in the fingerprint) ----"
RULE_END = "# ---- end of the rule region ----"


def region_code(gm: fx.GraphModule, nodes: list[fx.Node]) -> str:
    """`nodes` as the code of a standalone graph: their outside inputs become arguments, values used after them
    are returned. The rule's ops (`REGION_KEY` "rule") are framed by `RULE_BEGIN` and `RULE_END` comment lines."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    graph = fx.Graph()
    env = {a: graph.placeholder(a.name) for a in inputs}
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in nodes if any(u not in inside for u in n.users)))
    code = fx.GraphModule(gm, graph).code.strip()
    rule_names = {env[n].name for n in nodes if n.meta.get(REGION_KEY) == "rule"}
    lines, in_rule = [], False
    for line in code.splitlines():
        name = line.strip().split(" = ", 1)[0] if " = " in line else None
        defines_rule = name is not None and any(v.strip() in rule_names for v in name.split(","))
        if defines_rule != in_rule and (defines_rule or line.strip()):
            indent = line[:len(line) - len(line.lstrip())]
            lines.append(indent + (RULE_BEGIN if defines_rule else RULE_END))
            in_rule = defines_rule
        lines.append(line)
    return "\n".join(lines)


def summary(model: nn.Module, input_ids: torch.Tensor, *, rule: str | Rule = "snapkv", budget: int = 64,
            layer: int | None = None, full: bool = False, cached: bool = False, signals="all", **rule_params) -> str:
    """The inspect report for one forward of `model` (left unmodified) on `input_ids`.

    Args:
        model: an HF causal LM using SDPA. input_ids: the traced input (its length fixes the graph's shapes).
        rule, budget, **rule_params: as for `fxbudget.compile`.
        layer: whose kernel region to print (default: the first full-attention layer).
        full: print the whole rewritten graph instead of one layer's region.
        signals: the kernel's signal set: "all" (default: every signal, the kernel every rule can run, whose
            fingerprint is the same for every rule), None (what the rule reads, as `fxbudget.compile` measures) or a
            set.
        cached: read the fingerprint from the on-disk cache (`fingerprint_cache`, as `compare` rows do) and say
            whether it was; default: traced here (a kernel changed only in memory is seen).
    Returns:
        Text: a table of layers, the totals, the fingerprint, then code.
    """
    rule = get(rule, **rule_params)
    cache = model_cache(model, rule, budget, input_ids.shape[0])
    chosen = run_signals([rule], signals)
    graphs = captured_graphs(model, input_ids, rule, budget, cache, {}, signals=chosen)
    lines = [f"# rule {rule}, budget {budget}, {input_ids.shape[1]} traced tokens",
             f"# signal set (what the kernel measures, one per run): {signals_label(chosen)}",
             "# layer  attention  kept slots  SDPA rewritten"]
    rewritten, untouched, regions = [], [], []
    for gm in graphs:
        report = gm.meta[REWRITE_KEY]
        rewritten += report.rewritten
        untouched += report.untouched
        regions += kernel_regions(gm)
    for i, cache_layer in enumerate(cache.layers):
        kind = f"sliding {cache_layer.sliding}" if cache_layer.sliding else "full"
        lines.append(f"# {i:5d}  {kind:<9}  {cache_layer.budget:10d}  {rewritten.count(i):14d}")
    names = f" ({', '.join(untouched)})" if untouched else ""
    lines.append(f"# SDPA calls found: {len(rewritten) + len(untouched)}, rewritten: {len(rewritten)}, left unchanged "
                 f"(not fed by a BudgetCache): {len(untouched)}{names}")
    # The one definition of the fingerprint, the value `compare` records (its own trace, whatever was inspected).
    if cached:
        from .fingerprint_store import cache_dir, cached_kernel_fingerprint

        value, hit = cached_kernel_fingerprint(model, rule, budget=budget, compute=kernel_fingerprint, signals=chosen)
        note = f" (read from the cache in {cache_dir()})" if hit else " (traced)"
    else:
        value, note = kernel_fingerprint(model, rule=rule, budget=budget, signals=chosen), ""
    lines.append(f"# kernel fingerprint (rule ops masked): {value}{note}")
    lines.append(f"#   (what every compare row records as kernel_fingerprint: {FINGERPRINT_COVERS})")
    if full:
        lines.append("# the whole rewritten graph:")
        lines += [gm.code.strip() for gm in graphs]
        return "\n".join(lines)
    if layer is None:
        layer = next((i for i in rewritten if not cache.layers[i].sliding), rewritten[0] if rewritten else None)
    if layer not in rewritten:
        raise ValueError(f"layer {layer} has no rewritten attention; rewritten layers: {sorted(set(rewritten))}")
    gm = graphs[0] if len(graphs) == 1 else None
    if gm is None:
        raise ValueError("the forward traced into several graphs: use --full")
    lines.append(f"# layer {layer}'s kernel (measure, then the rule region between the marked lines, then evict); "
                 "--full prints the whole graph:")
    lines.append(region_code(gm, regions[rewritten.index(layer)]))
    return "\n".join(lines)
