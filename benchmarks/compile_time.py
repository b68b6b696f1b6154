"""Compile time of the embedded model for one rule: prefill-chunk graph + decode graph, cold and warm, by route.

    OMP_NUM_THREADS=1 python benchmarks/compile_time.py [--routes regional,nested,whole] [--device cpu]
    python benchmarks/compile_time.py --quick      # smoke run: a tiny random Qwen2, regional only, printed only

Routes (`fxbudget.compile(model, rule, budget, chunk_size, backend="inductor")`, then its compiled runner is):
- `regional` (what fxbudget ships, `fxbudget.compiler.regions`): each decoder layer runs a `torch.compile`d region; layers of
  one configuration share its code object, hence one graph; the outer loop is eager.
- `nested`: the whole forward traced by Dynamo, each decoder layer wrapped in `torch.compiler.nested_compile_region`
  (one `invoke_subgraph` subgraph reused by every layer); the SDPA pass rewrites the subgraph. Benchmark-only code.
- `whole`: the whole forward as one graph, every layer traced, rewritten and lowered again (fxbudget before regions).
Each route runs in two fresh processes sharing a new Inductor cache directory: the first is cold, the second warm.
A process prefills 2 chunks (one chunk graph), then decodes; compile seconds = first call minus a second call of the
same shape on a fresh cache. Inductor compiles in-process (TORCHINDUCTOR_COMPILE_THREADS=1), so the CPU seconds
(process + its compiler subprocesses) are the whole compile cost; on a loaded machine they are the steadier number.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from benchlib.env import ROOT, header_lines, load_str, setup_threads, tune_malloc
from benchlib.timing import sync
from benchlib.output import emit, md_table
from benchlib.cases import bench_model


def _cpu() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _nested_runner(forward, model, rule, graphs):
    """The `nested` route: whole-forward Dynamo trace, decoder layers as nested compile regions."""
    import torch
    from torch import fx

    from fxbudget.compiler.backend import inductor, kernel_window
    from fxbudget.cache.keyword import NAMES as CACHE_NAMES
    from fxbudget.passes.sdpa import rewrite
    from fxbudget.compiler.regions import LayerCacheView, whole_model_forward
    from fxbudget.rules import get

    def backend(gm, example_inputs, **kwargs):
        subs = {id(getattr(gm, n.target)): getattr(gm, n.target) for n in gm.graph.nodes
                if n.op == "get_attr" and isinstance(getattr(gm, n.target), fx.GraphModule)}
        for sub in subs.values():  # one subgraph module shared by the layers' invoke_subgraph calls
            rewrite(sub, rule, kernel_window(rule), get("window"))
            graphs.append(sub)
        return inductor(gm, example_inputs)

    region = torch.compiler.nested_compile_region(
        lambda layer, name, view, *args, **kwargs: type(layer).forward(layer, *args, **{name: view}, **kwargs))
    for i, layer in enumerate(model.model.layers):
        def fwd(*args, _layer=layer, _i=i, **kwargs):
            name = next(k for k in CACHE_NAMES if kwargs.get(k) is not None)  # `cache` from transformers 5.24
            return region(_layer, name, LayerCacheView(kwargs.pop(name).layers[_i]), *args, **kwargs)

        layer.forward = fwd
    return whole_model_forward(forward, backend)


def _child(a) -> dict:
    import torch

    import fxbudget
    from fxbudget.compiler.backend import make_backend
    from fxbudget.cache.keyword import output_cache
    from fxbudget.compiler.regions import whole_model_forward

    setup_threads(1)
    tune_malloc()
    model = bench_model(a.quick)
    model = model.to(a.device)
    ids = torch.randint(0, 500, (1, 2 * a.chunk), generator=torch.Generator().manual_seed(0)).to(a.device)
    m = fxbudget.compile(model, rule=a.rule, budget=a.budget, chunk_size=a.chunk, backend="inductor")
    bf = m.forward
    if a.route == "whole":
        bf._run = whole_model_forward(bf.original, make_backend(a.rule, on_graph=bf.graphs.append))
    elif a.route == "nested":
        bf._run = _nested_runner(bf.original, model, bf.rule, bf.graphs)

    def clock(fn):
        sync(a.device)
        t, c = time.perf_counter(), _cpu()
        out = fn()
        sync(a.device)
        return out, time.perf_counter() - t, _cpu() - c

    res = {"route": a.route}
    with torch.no_grad():
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4, device=a.device))  # Inductor's one-time start-up
        out, w1, c1 = clock(lambda: m(input_ids=ids))
        cache, tok = output_cache(out), out.logits[:, -1:].argmax(-1)
        _, w2, c2 = clock(lambda: m(input_ids=tok, past_key_values=cache))
        _, w3, c3 = clock(lambda: m(input_ids=ids))  # the same shapes again: no compile
        _, w4, c4 = clock(lambda: m(input_ids=tok, past_key_values=cache))
    res.update(prefill_s=w1 - w3, decode_s=w2 - w4, prefill_cpu_s=c1 - c3, decode_cpu_s=c2 - c4, graphs=len(bf.graphs),
               load=load_str())
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--routes", default="regional,nested,whole")
    p.add_argument("--rule", default="snapkv")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny random model, regional route, printed only")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["regional", "nested", "whole"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.routes, a.budget, a.chunk = "regional", 32, 32
    if a.child:
        a.route = a.child
        print(json.dumps(_child(a)))
        return 0
    setup_threads(1)
    info = header_lines("Compile time: prefill-chunk + decode graphs of one rule, cold and warm")
    rows = []
    for route in a.routes.split(","):
        cache_dir = tempfile.mkdtemp(prefix=f"fxbudget_compile_{route}_")
        for phase in ("cold", "warm"):
            print(f"[{time.strftime('%H:%M:%S')}] {route} {phase} (load {load_str()})", flush=True)
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHINDUCTOR_COMPILE_THREADS": "1",
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT),
                   "TRANSFORMERS_VERBOSITY": "error"}
            cmd = [sys.executable, __file__, "--child", route, "--rule", a.rule, "--budget", str(a.budget),
                   "--chunk", str(a.chunk), "--device", a.device, *(["--quick"] if a.quick else [])]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
                raise RuntimeError(f"{route} {phase} failed (rc {proc.returncode})")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({**r, "phase": phase})
            print("  ", rows[-1], flush=True)
    model = "a tiny random Qwen2 (--quick)" if a.quick else "the embedded model (24 layers)"
    lines = info + [
        f"{model}, rule `{a.rule}`, budget {a.budget}, prefill chunks of {a.chunk}, device `{a.device}`. Goal (issue "
        "10): cold <= 30 s, warm <= 5 s for both graphs together, on the 2-core CPU.", "",
        *md_table(["route", "cache", "prefill-chunk graph s", "decode graph s", "together s", "CPU s together",
                   "graphs", "load at end"],
                  [[r["route"], r["phase"], f"{r['prefill_s']:.1f}", f"{r['decode_s']:.1f}",
                    f"{r['prefill_s'] + r['decode_s']:.1f}", f"{r['prefill_cpu_s'] + r['decode_cpu_s']:.1f}",
                    r["graphs"], r["load"]] for r in rows]),
    ]
    emit(lines, a.out, a.quick, "compile_time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
