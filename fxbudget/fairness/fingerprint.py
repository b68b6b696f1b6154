"""The rewritten graphs of one traced forward (`inspect`), and the kernel fingerprint: one hash per kernel, with each
rule's ops abstracted, that `fxbudget inspect` prints and every `compare` row records."""

from __future__ import annotations

import contextlib
import hashlib

import torch
from torch import fx, nn

from ..compiler.backend import make_backend
from ..cache.budget_cache import BudgetCache
from ..cache.keyword import cache_kwargs
from ..checks import check_int
from ..compiler.forward import ATTN_IMPLEMENTATION, BudgetForward
from ..kernel import DEFAULT_BLOCK, check_block
from ..cache.for_model import model_cache
from ..passes.sdpa import INTS_KEY, REGION_KEY
from ..compiler.regions import compiled_forward, whole_model_forward
from ..kernel.settings import ALL_SIGNALS, MeasureSpec, signals_label
from ..kernel.signal_set import run_signals
from ..rules import Rule, get

# What the fingerprint is traced on, whatever the caller inspects: an 8-token call of zeros, with a query block of
# 4 (so the measure phase's loop over blocks is in it), then one decode step.
PROBE_TOKENS = 8
PROBE_BLOCK = 4
FINGERPRINT_COVERS = (f"one {PROBE_TOKENS}-token call (query block {PROBE_BLOCK}) and one decode step, every layer's "
                      "compiled region, the rule's ops masked; budget-derived sizes normalized")


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


def _traced(model, input_ids, rule, budget, cache, rule_params, block, head_pool, on_graph, signals=ALL_SIGNALS):
    """What both tracers run: the model's own forward, the eager-inner fxbudget backend calling `on_graph` with the
    kernel measuring `signals` (`kernel.signal_set.run_signals`: "all", None = the rule's, or a set), and `cache` or a
    fresh one in the layout `head_pool`."""
    check_block(block)
    fwd = model.forward.original if isinstance(model.forward, BudgetForward) else model.forward
    spec = MeasureSpec(signals=run_signals([get(rule, **rule_params)], signals))
    backend = make_backend(rule, inner="eager", on_graph=on_graph, block=block, measure=spec, **rule_params)
    if cache is None:
        cache = model_cache(model, backend.rule, budget, input_ids.shape[0], head_pool=head_pool)
    return fwd, backend, cache


def captured_graphs(model, input_ids, rule, budget, cache, rule_params, *, block: int | None = DEFAULT_BLOCK,
                    head_pool: bool | None = None, signals=ALL_SIGNALS) -> list[fx.GraphModule]:
    """The rewritten graph of one forward on `input_ids`, every layer in one graph (what `inspect` reports per
    layer), on `cache` or a fresh one in the layout `head_pool` (`fxbudget.compile`'s), measuring `signals`."""
    graphs: list[fx.GraphModule] = []
    fwd, backend, cache = _traced(model, input_ids, rule, budget, cache, rule_params, block, head_pool, graphs.append,
                                  signals)
    run = whole_model_forward(fwd, backend)
    with torch.no_grad(), _maskless_attention(model):
        run(input_ids=input_ids, use_cache=True, **cache_kwargs(fwd, cache))
    return graphs


def layer_graphs(model, input_ids, rule, budget, cache, rule_params, *, block: int,
                 head_pool: bool | None, signals=ALL_SIGNALS) -> list[fx.GraphModule]:
    """What the fingerprint hashes: for a call on `input_ids` and one decode step after it, each decoder layer's
    rewritten graph in layer order, as `fxbudget.compile` runs them (one compiled region per layer configuration,
    so layers of one configuration list the same graph, traced once: a 24-layer model costs two Dynamo traces of one
    layer, not of the whole model). A model without a list of decoder layers: its whole-model graph per call."""
    per_layer: list[fx.GraphModule] = []
    whole: list[fx.GraphModule] = []
    latest: dict[tuple, fx.GraphModule] = {}

    def on_layer(key):  # called after each layer's region ran; a graph compiled during it belongs to its key
        if whole:
            latest[key] = whole.pop()
        per_layer.append(latest[key])

    fwd, backend, cache = _traced(model, input_ids, rule, budget, cache, rule_params, block, head_pool, whole.append,
                                  signals)
    run = compiled_forward(model, fwd, backend, on_layer)
    with torch.no_grad(), _maskless_attention(model):
        run(input_ids=input_ids, use_cache=True, **cache_kwargs(fwd, cache))
        run(input_ids=input_ids[:, -1:], use_cache=True, **cache_kwargs(fwd, cache))
    return per_layer or whole


def inspect(model: nn.Module, input_ids: torch.Tensor, *, rule: str | Rule = "snapkv", budget: int = 1024,
            cache: BudgetCache | None = None, head_pool: bool | None = None, **rule_params) -> str:
    """The rewritten graph's Python code for one forward of `model` on `input_ids` (model left unmodified).

    Args:
        model: the unmodified model (an HF causal LM, or a module taking `input_ids=` and `cache=` or
            `past_key_values=`).
        input_ids: a sample input; its length fixes the shapes of the traced graph.
        rule, budget, **rule_params: as for `fxbudget.compile`.
        cache: the BudgetCache to trace with (default: a fresh one for the model's config, in the layout
            `head_pool`, as for `fxbudget.compile`).
    Returns:
        The code of the rewritten graph(s), as `torch.fx` prints it.
    """
    check_int("budget", budget)
    graphs = captured_graphs(model, input_ids, rule, budget, cache, rule_params, head_pool=head_pool)
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
    """sha256 over the graphs in order, each hashed once (a graph listed again, as layers sharing a compiled region
    list it, adds its digest again): their ops, order, data flow and arguments, each run of rule-region ops collapsed
    into one `<rule>` token.

    Integer arguments are hashed, with one normalization: in the spliced kernel (`measure` and `evict`), an int that
    grows with the layer's budget is hashed as `a*S+b` (S = the layer's slots). The pass finds them by tracing each
    layer's kernel twice, at its slots and keep and at one more of each (`passes.sdpa.trace_kernel`): the ints that
    change are budget-derived, and `a`, `b` come from the two values. So per-layer budgets (pyramidkv) and the run's
    budget hash alike, while a kernel that keeps, slices, reduces or selects differently does not. Everything else is
    literal: the call's length (the model's own ops outside the kernel carry it too: views, `arange`), the
    observation window, the head sizes, dims. Fingerprints therefore compare rules at one input length and one
    window (`kernel_fingerprint` fixes the length). Two layers whose budgets sit on different sides of the call's
    length hash differently: `evict` writes `min(n, S)` rows."""
    h, digests = hashlib.sha256(), {}
    for gm in graphs:
        if id(gm) not in digests:
            one = hashlib.sha256()
            _hash_graph(one, gm)
            digests[id(gm)] = one.digest()
        h.update(digests[id(gm)])
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


def probe_ids(model: nn.Module, batch: int = 1) -> torch.Tensor:
    """The input every fingerprint is traced on: `PROBE_TOKENS` zeros per row, on the model's device."""
    return torch.zeros(batch, PROBE_TOKENS, dtype=torch.long, device=next(model.parameters()).device)


def kernel_fingerprint(model: nn.Module, input_ids: torch.Tensor | None = None, *, rule: str | Rule = "snapkv",
                       budget: int = 1024, cache: BudgetCache | None = None, block: int | None = None,
                       head_pool: bool | None = None, signals=ALL_SIGNALS, slot_dtype: str = "model",
                       **rule_params) -> str:
    """Hash of the rewritten graphs with the rule's ops abstracted: equal for every rule means one shared kernel.

    The one definition, printed by `fxbudget inspect` and recorded by every `compare` row: with `input_ids=None`
    (the default) it is traced on `probe_ids(model)` (`FINGERPRINT_COVERS`: an 8-token call with a query block of 4,
    so the measure phase's loop over blocks is in it, then one decode step). Budget-derived sizes are normalized
    (see `graph_fingerprint`), so rules with per-layer budgets compare too, and any budget of at least 8 gives the
    same value.

    Args:
        model: as for `inspect`. input_ids: another traced input (its length is part of the hash; then the block
            defaults to half its length). rule, budget, cache, **rule_params: as for `inspect`.
        block: the query block (default: `PROBE_BLOCK` for the probe, half the length otherwise).
        head_pool: the cache layout, as for `fxbudget.compile` (None: pooled iff the rule is head-adaptive). A run
            that compares a head-adaptive rule runs every rule pooled: one fingerprint for all of them, and not the
            unpooled layout's.
        signals: the kernel's signal set (a kernel setting of the run: `kernel.signal_set.run_signals`): "all"
            (default: every signal, the kernel every rule can run), None (what `rule` reads, as `fxbudget.compile`
            measures) or a set. A set other than "all" is named in the hash (`signal_set_fingerprint`), so two
            sets never share a fingerprint; "all" hashes the graphs alone, as before the set existed.
        slot_dtype: how the traced cache stores keys and values (`kernel.slot_storage`; a kernel setting): a
            quantized storage traces its dequantize and quantize ops, so its fingerprint is its own.
    Returns:
        A hex sha256 string.
    """
    check_int("budget", budget)
    if input_ids is None:
        input_ids, block = probe_ids(model), PROBE_BLOCK if block is None else block
    block = max(2, (input_ids.shape[1] + 1) // 2) if block is None else block
    chosen = run_signals([get(rule, **rule_params)], signals)
    if cache is None and slot_dtype != "model":
        cache = model_cache(model, get(rule, **rule_params), budget, input_ids.shape[0], head_pool=head_pool,
                            slot_dtype=slot_dtype)
    return signal_set_fingerprint(graph_fingerprint(layer_graphs(model, input_ids, rule, budget, cache, rule_params,
                                                                 block=block, head_pool=head_pool, signals=chosen)),
                                  chosen)


def signal_set_fingerprint(graphs_hash: str, signals) -> str:
    """The fingerprint of graphs hashing to `graphs_hash` under the signal set `signals`: the hash itself for every
    signal (the rows of runs before the set existed pool with "all" runs'), else sha256 of it and the set's label."""
    label = signals_label(signals)
    if label == ALL_SIGNALS:
        return graphs_hash
    return hashlib.sha256(f"{graphs_hash}|signals:{label}".encode()).hexdigest()
