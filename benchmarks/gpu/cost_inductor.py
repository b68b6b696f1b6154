"""Inductor's own byte counts of the kernel's three phases lowered for a (fake) sm_90, one layer of the Llama-3.1-8B
shapes in bfloat16: what `python benchmarks/gpu/cost.py inductor` runs (needs `.venv-cuda`: torch 2.14.1+cu130,
`tests/fake_cuda.py`).

Each phase is traced the way the SDPA pass traces it (`passes.sdpa.trace_kernel`, on fake tensors: nothing is
allocated, so real lengths trace as fast as small ones), its outputs flattened, and lowered by `fake_cuda.lower`
(Triton source only, no cubins). After each graph's codegen, Inductor's `GraphLowering.count_bytes()` (what fills
`torch._inductor.metrics.num_bytes_accessed` and `nodes_num_elem` when its metrics log is on) is read per scheduler
node. The scan over query blocks lowers to a while-loop whose body is its own subgraph, counted once by Inductor:
its bytes are multiplied here by the loop's trip count (`key_scan`'s step count for the call's block and tiles).

`run_decode` (`python benchmarks/gpu/cost.py decode-counts`) lowers the decode steps a deployment runs (evicting,
appending into head-room, an interval's evicting step) for a fake sm_90 and gfx942, batch 1 and 8: kernels and
launches per layer, the three phases as one graph and each alone (tests/test_decode_codegen.py pins them).
"""

from __future__ import annotations

import json
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _fake_inputs(n: int, S: int, shp: dict, batch: int = 1, slot_dtype: str = "model"):
    """A layer's marker tensors (bf16 model), its slots stored as `slot_dtype` (`kernel.slot_storage`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxbudget.kernel.slot_storage import slot_shape

    b, H, h, d = batch, shp["H"], shp["h"], shp["d"]
    bf, i64 = torch.bfloat16, torch.long
    storage, width = slot_shape(slot_dtype, d)
    with FakeTensorMode():
        return dict(
            keys=torch.empty(b, h, S, width, dtype=storage or bf),
            values=torch.empty(b, h, S, width, dtype=storage or bf),
            pos=torch.empty(b, h, S, dtype=i64), state=torch.empty(b, h, S), norms=torch.empty(b, h, S, 3),
            totals=torch.empty(b, h, 9), owner=torch.empty(b, h, S, dtype=torch.int32),
            k_new=torch.empty(b, h, n, d, dtype=bf), v_new=torch.empty(b, h, n, d, dtype=bf),
            new_pos=torch.empty(b, n, dtype=i64), inv_freq=torch.empty(d // 2), wo=torch.empty(h, d, H // h * d),
            q=torch.empty(b, H, n, d, dtype=bf))


def _flat_outputs(gm):
    """compile_fx wants a flat tuple of outputs; a phase returns a pytree (measure: a tuple with a dict)."""
    import torch
    from torch.utils import _pytree as pytree

    out = next(x for x in gm.graph.nodes if x.op == "output")
    out.args = (tuple(x for x in pytree.tree_flatten(out.args[0])[0] if isinstance(x, torch.fx.Node)),)
    gm.recompile()
    return gm


def lower_case(kind: str, n: int, S: int, shp: dict, window: int, rule: str) -> dict:
    """One call (a one-call prefill of `n` tokens on an empty cache of `S` slots, or a decode step over `S` full
    slots) lowered phase by phase; Inductor's byte count per phase."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_cuda
    import torch
    from torch._inductor.graph import GraphLowering

    from fxbudget.kernel.key_scan import padded_blocks, tile_blocks
    from fxbudget.kernel.settings import auto_block
    from fxbudget.passes.sdpa import trace_kernel
    from fxbudget.rules import get

    block = auto_block(shp["H"], n, torch.device("cuda"))  # the block the kernel picks on CUDA (batch 1)
    R = min(block, n)
    nb = -(-n // R)
    c = tile_blocks(R, nb)
    steps = padded_blocks(nb, c) // 2 if n > R else 0
    kt = trace_kernel(_fake_inputs(n, S, shp), get(rule), budget=S, keep=S, sliding=0, window=window, scale=None,
                      block=block, budget_ints=False, empty=kind == "prefill")
    graphs: list[tuple[str, object]] = []
    orig = GraphLowering.codegen, GraphLowering.codegen_subgraph

    def codegen(self, *a, **k):
        r = orig[0](self, *a, **k)
        graphs.append((getattr(self, "name", None) or "main", self.count_bytes()))
        return r

    def codegen_subgraph(self, parent):
        r = orig[1](self, parent)
        graphs.append((getattr(self, "name", None) or "sub", self.count_bytes()))
        return r

    phases = {}
    GraphLowering.codegen, GraphLowering.codegen_subgraph = codegen, codegen_subgraph
    try:
        for phase in ("measure", "rule", "evict"):
            gm = _flat_outputs(getattr(kt, phase))
            specs = [x.meta["val"] for x in gm.graph.nodes if x.op == "placeholder"]
            graphs.clear()
            t = time.perf_counter()
            low = fake_cuda.lower(gm, specs, sm=90, cubins=False)
            parts = []
            for name, (total, counts, runtimes) in graphs:
                loop = name.startswith("while_loop_body")
                trip = steps if loop else 1
                if loop and not steps:
                    raise RuntimeError(f"{kind} n={n}: a loop body but no scan steps")
                parts.append(dict(graph=name, trip=trip, bytes=total, nodes=[
                    dict(node=node.get_name(), type=type(node).__name__, bytes=elems * 4)
                    for node, elems in counts if elems], est_runtime_ms=sum(r for _, r in runtimes)))
            phases[phase] = dict(bytes=sum(p["bytes"] * p["trip"] for p in parts), kernels=len(low.kernels),
                                 externs=low.externs, fallbacks=low.fallbacks, graphs=parts,
                                 lower_s=round(time.perf_counter() - t, 1))
    finally:
        GraphLowering.codegen, GraphLowering.codegen_subgraph = orig
    return dict(kind=kind, n=n, S=S, block=R, tile_blocks=c, steps=steps, phases=phases)


def run(cases: list[tuple[str, int, int]], shp: dict, window: int, rule: str, out: Path,
        fused: tuple[int, ...] = (), *, value_dim: int) -> None:
    import torch
    import triton

    rows = []
    for kind, n, S in cases:
        t = time.perf_counter()
        rows.append(lower_case(kind, n, S, shp, window, rule))
        print(f"[gpu_cost inductor] {kind} n={n} S={S}: " + ", ".join(
            f"{p} {v['bytes'] / 1e9:.3f} GB ({v['kernels']} kernels)" for p, v in rows[-1]["phases"].items())
            + f" in {time.perf_counter() - t:.0f} s", flush=True)
    fused_rows = []
    for n in fused:
        fused_rows.append(lower_fused(n, shp, value_dim))
        print(f"[gpu_cost inductor] fused prefill n={n}: {fused_rows[-1]['bytes'] / 1e9:.3f} GB "
              f"({fused_rows[-1]['kernels']} kernels)", flush=True)
    # `decode-counts` writes its own key into the same file: keep it (and whatever else is there).
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update(
        note="Inductor's GraphLowering.count_bytes() per phase, one layer, batch 1, bf16, lowered for a fake sm_90 "
             "(tests/fake_cuda.py); loop bodies multiplied by their trip count. Written by "
             "`python benchmarks/gpu/cost.py inductor`.",
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(), rule=rule,
        window=window, shapes=shp, cases=rows, fused=fused_rows)
    out.write_text(json.dumps(data, indent=1) + "\n")


def lower_fused(n: int, shp: dict, value_dim: int) -> dict:
    """The shipped fused form's two flex_attention calls (`fxbudget/kernel/flex_measure.py`'s `flex_attend`, with the
    8B's GQA) on a one-call prefill of `n` tokens (a multiple of its block: the folded queries are a view), captured
    by Dynamo and lowered for a fake sm_90: Inductor's byte count. The queries are folded per KV head (its group's
    query heads' rows end to end, no `enable_gqa`); the forward returns each folded row's log-sum-exp; the transposed
    call takes each KV head's keys as queries and the folded queries as keys, its score minus the row's log-sum-exp
    (at the row's own index), under the transposed causal mask, its values `value_dim` zeros per row (allocated in
    the graph, as `flex_attend` does); its log-sum-exp per key is the key's column sum. The masks are plain causal
    ones (not `flex_attend`'s position reads) and the window block is not part of it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_cuda
    import torch
    from torch._inductor.graph import GraphLowering
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    H, h, d = shp["H"], shp["h"], shp["d"]
    g = H // h
    captured = {}

    def grab(gm, ex):
        captured["gm"], captured["ex"] = gm, ex
        return gm.forward

    def two_calls(q, k, v, bm, bm_t):
        qf = q.reshape(1, h, g * n, d)  # query head j*g+i of KV head j: rows i*n.. of its fold
        out, aux = flex_attention(qf, k, v, block_mask=bm, return_aux=AuxRequest(lse=True))
        lse = aux.lse  # [1, h, g n]: per folded row
        _, aux_t = flex_attention(k, qf, qf.new_zeros(1, h, g * n, value_dim), block_mask=bm_t,
                                  score_mod=lambda s, b, hh, ki, qi: s - lse[b, hh, qi],
                                  return_aux=AuxRequest(lse=True))
        return out, aux_t.lse.exp()

    q = torch.zeros(1, H, n, d, dtype=torch.bfloat16)
    k = torch.zeros(1, h, n, d, dtype=torch.bfloat16)
    bm = create_block_mask(lambda b, hh, qi, ki: (qi % n) >= ki, 1, None, g * n, n, device="cpu")
    bm_t = create_block_mask(lambda b, hh, ki, qi: (qi % n) >= ki, 1, None, n, g * n, device="cpu")
    torch.compile(two_calls, backend=grab, fullgraph=True)(q, k, k.clone(), bm, bm_t)
    graphs = []
    orig = GraphLowering.codegen

    def codegen(self, *a, **kw):
        r = orig(self, *a, **kw)
        graphs.append(self.count_bytes())
        return r

    GraphLowering.codegen = codegen
    try:
        t = time.perf_counter()
        low = fake_cuda.lower(captured["gm"], captured["ex"], sm=90, cubins=False)
    finally:
        GraphLowering.codegen = orig
    nodes = [dict(node=node.get_name(), type=type(node).__name__, bytes=elems * 4)
             for _, counts, _ in graphs for node, elems in counts if elems]
    return dict(kind="fused_prefill", n=n, value_dim=value_dim, bytes=sum(x[0] for x in graphs),
                kernels=len(low.kernels), externs=low.externs, fallbacks=low.fallbacks, nodes=nodes,
                lower_s=round(time.perf_counter() - t, 1))


# --- The decode step's kernels and launches (issue 57) -----------------------------------------------------------

# The decode steps a deployment runs. Evicting: interval 1, the layer's B slots full, one token in, one dropped
# (keep = B), the rule under test scoring. Appending: decode interval k = 64 between evictions, a step that writes
# into free head-room and drops nothing the rule chooses (keep = the slots, B + k - 1 of them; the shared frozen
# runner's graph, scored by the `window` rule: docs/DESIGN.md, "Decoding at an interval"). Interval-evicting: that
# interval's k-th step, B + k - 1 full slots and the token, back down to B (k dropped: a top-k).
DECODE_STEPS = {"evicting": dict(extra=0, keep_all=False), "appending": dict(extra=63, keep_all=True),
                "interval-evicting": dict(extra=63, keep_all=False)}
DECODE_ARCHS = ("sm_90", "gfx942")
_RUN = re.compile(r"^\s+(triton_\w+)\.run\(", re.M)
_CALL = re.compile(r"^\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?|aten\.\w+(?:\.\w+)?)\(", re.M)


def launches_of(source: list[str]) -> dict:
    """What the output code's `call` launches, in order of kinds: Triton kernel runs, extern kernels (cuBLAS/rocBLAS
    matmuls), ATen fallbacks (a top-k, a sort). Launches count every run (one kernel may run twice)."""
    code = "\n".join(source)
    runs, calls = _RUN.findall(code), _CALL.findall(code)
    return dict(launches=len(runs) + len(calls), triton_runs=len(runs), other_calls=sorted(calls),
                kernels=len(set(_KERNEL_DEF.findall(code))))


_KERNEL_DEF = re.compile(r"^(triton_\w+) = async_compile\.triton", re.M)


def lower_decode_step(step: str, B: int, batch: int, arch: str, shp: dict, window: int, rule: str, *,
                      phases: bool = True, slot_dtype: str = "model") -> dict:
    """One decode step of one layer (8B shapes, bf16) traced as the SDPA pass traces it and lowered for `arch`:
    the three phases as one graph (the row's counts) and, with `phases`, each phase alone (`phases`): Triton
    kernels, launches, Inductor's bytes."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_cuda
    import fake_hip
    from torch._inductor.graph import GraphLowering

    from fxbudget.passes.sdpa import trace_kernel
    from fxbudget.rules import get

    cfg = DECODE_STEPS[step]
    S = B + cfg["extra"]
    keep = S if cfg["keep_all"] else B
    ev = _fake_inputs(1, S, shp, batch=batch, slot_dtype=slot_dtype)
    rule_obj = get("window" if cfg["keep_all"] else rule)
    kt = trace_kernel(ev, rule_obj, budget=B, keep=keep, sliding=0, window=window, scale=None, block=None,
                      budget_ints=False)
    counted = []
    orig = GraphLowering.codegen

    def codegen(self, *a, **k):
        r = orig(self, *a, **k)
        counted.append(self.count_bytes()[0])
        return r

    graphs = {"measure": kt.measure, "rule": kt.rule, "evict": kt.evict} if phases else {}
    graphs["step"] = _trace_step(ev, rule_obj, B, keep, window)
    phases = {}
    GraphLowering.codegen = codegen
    try:
        for phase, gm in graphs.items():
            gm = _flat_outputs(gm)
            specs = [x.meta["val"] for x in gm.graph.nodes if x.op == "placeholder"]
            counted.clear()
            t = time.perf_counter()
            if arch.startswith("sm_"):
                low = fake_cuda.lower(gm, specs, sm=int(arch[3:]), cubins=False)
            else:
                low = fake_hip.lower(gm, specs, arch=arch, hsaco=False)
            phases[phase] = dict(**launches_of(low.source), bytes=sum(counted), fallbacks=low.fallbacks,
                                 externs=low.externs, lower_s=round(time.perf_counter() - t, 1))
    finally:
        GraphLowering.codegen = orig
    whole = phases.pop("step")
    return dict(step=step, B=B, S=S, keep=keep, batch=batch, arch=arch, rule="window" if cfg["keep_all"] else rule,
                slot_dtype=slot_dtype,
                kernels=whole["kernels"], launches=whole["launches"],
                bytes=whole["bytes"], fallbacks=whole["fallbacks"], externs=whole["externs"],
                other_calls=whole["other_calls"], lower_s=whole["lower_s"], phases=phases)


def _trace_step(ev: dict, rule, budget: int, keep: int, window: int):
    """The three phases traced as one graph, as the SDPA pass splices them into a layer's graph (one region:
    Inductor may fuse across the phases' boundaries), returning the attention output; the slots written in place."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import torch
    from fxbudget.kernel import MARKER_TENSORS, evict_phase, from_marker, layout, measure_phase, rule_phase
    from fxbudget.passes.sdpa import _trace

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fake = {k: torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
                for k, v in ev.items()}
    lay = layout(False)

    def step(q, slots, new, const):
        out, totals, signals = measure_phase(lay, q, slots, new, const, window=window, sliding=0, scale=None,
                                             block=None, traced=True)
        evict_phase(lay, rule_phase(lay, rule, budget, window, signals), signals, totals, slots, new, keep=keep)
        return out

    slots, new, const = from_marker([fake[a] for a in MARKER_TENSORS])
    return _trace(step, (fake["q"], slots, new, const), mode)


def run_decode(budgets, batches, shp: dict, window: int, rule: str, out: Path, archs=DECODE_ARCHS) -> list[dict]:
    """Every decode step, budget, batch and arch lowered; written into `out` under "decode_steps" (the rest of the
    file kept)."""
    rows = []
    for arch in archs:
        for step in DECODE_STEPS:
            for B in budgets:
                for batch in batches:
                    t = time.perf_counter()
                    rows.append(lower_decode_step(step, B, batch, arch, shp, window, rule))
                    r = rows[-1]
                    print(f"[gpu_cost inductor] decode {step} {arch} B={B} batch={batch}: {r['kernels']} kernels, "
                          f"{r['launches']} launches as one graph (phases alone: " + ", ".join(
                              f"{p} {v['kernels']}/{v['launches']}" for p, v in r["phases"].items())
                          + f"), {r['bytes'] / 1e6:.1f} MB in {time.perf_counter() - t:.0f} s", flush=True)
    data = json.loads(out.read_text()) if out.exists() else {}
    data["decode_steps"] = dict(
        note="One decode step of one layer (Llama-3.1-8B shapes, bf16), its three phases traced as one graph (as "
             "the SDPA pass splices them: the row's kernels, launches, bytes) and each phase lowered on its own "
             "(`phases`) for a fake device (tests/fake_cuda.py, tests/fake_hip.py; Triton source only): Triton kernels (distinct), "
             "launches (every kernel run and every extern/ATen call of the output code's `call`) and "
             "GraphLowering.count_bytes(). Written by `python benchmarks/gpu/cost.py decode-counts`.",
        rows=rows)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return rows


def run_slots(budgets, shp: dict, window: int, rule: str, out: Path, archs=DECODE_ARCHS,
              storages=("model", "float8_e4m3fn", "int8")) -> list[dict]:
    """The evicting decode step (batch 1) per slot storage, budget and arch, as one graph; written into `out` under
    "decode_slots" (the rest of the file kept): what quantized slots cost a GPU step in Inductor's bytes."""
    rows = []
    for arch in archs:
        for B in budgets:
            for storage in storages:
                rows.append(lower_decode_step("evicting", B, 1, arch, shp, window, rule, phases=False,
                                              slot_dtype=storage))
                r = rows[-1]
                print(f"[gpu_cost inductor] decode {storage} slots {arch} B={B}: {r['launches']} launches, "
                      f"{r['bytes'] / 1e6:.1f} MB, outside Triton {r['other_calls']}", flush=True)
    data = json.loads(out.read_text()) if out.exists() else {}
    data["decode_slots"] = dict(
        note="The evicting decode step (batch 1) of one layer (Llama-3.1-8B shapes, bf16 model) per slot storage "
             "(kernel/slot_storage.py), lowered as one graph for a fake device as decode_steps are. Written by "
             "`python benchmarks/gpu/cost.py decode-counts --slots`.",
        rows=rows)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return rows
