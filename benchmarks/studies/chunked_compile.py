"""A new user's chunked compile: `generate` on two prompts through `fxbudget.compile(..., chunk_size=256)`, cold.

    OMP_NUM_THREADS=1 python benchmarks/studies/chunked_compile.py [--out benchmarks/results/chunked_compile.md]
    python benchmarks/studies/chunked_compile.py --quick      # smoke run: a tiny random Qwen2, printed only

The case of issue 30: the embedded model, rule snapkv, budget 256, `chunk_size=256`, `generate(max_new_tokens=4)` on
a 700-token prompt, then a 555-token one. Each backend runs in a fresh process with an empty Inductor cache
(`TORCHINDUCTOR_CACHE_DIR`; Inductor's own compile threads, as a user runs it, unless `--compile-threads`), one after
the other: `None`
(the eager kernel, no torch.compile) and `inductor`. The compile cost is the Inductor process's wall time minus the
eager one's, per prompt; the compiled process also reports its graphs (`model.forward.graphs`), Dynamo's recompiles
and graph breaks, and Dynamo's own compile-time breakdown (`torch._dynamo.utils.compile_times`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
import tempfile
import time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: benchlib
from benchlib.env import STUDY_RESULTS, ROOT, header_lines, load_str, setup_threads, tune_malloc
from benchlib.output import emit, md_table
from benchlib.cases import bench_model

PROMPTS = (700, 555)


def _child(a) -> dict:
    import torch

    import fxbudget

    setup_threads(1)
    tune_malloc()
    model = bench_model(a.quick)
    backend = None if a.child == "eager" else a.child
    m = fxbudget.compile(model, rule="snapkv", budget=a.budget, chunk_size=a.chunk, backend=backend)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (1, n), generator=gen) for n in a.prompts]
    res: dict = {"backend": a.child, "prompt_s": []}
    if backend is not None:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4))  # Inductor's one-time start-up, outside the timings
    for ids in prompts:
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
        res["prompt_s"].append(time.perf_counter() - t)
    if backend is not None:
        from torch._dynamo.utils import compile_times, counters

        res["graphs"] = len(m.forward.graphs)
        res["graph_shapes"] = sorted({str(tuple(n.meta["example_value"].shape)) for gm in m.forward.graphs
                                      for n in gm.graph.nodes if n.op == "placeholder"
                                      and isinstance(n.meta.get("example_value"), torch.Tensor)
                                      and n.meta["example_value"].dim() == 3})[:8]
        res["recompiles"] = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
        res["graph_breaks"] = sum(counters["graph_break"].values())
        res["frames"] = dict(counters["frames"])
        res["compile_times"] = compile_times(repr="csv", aggregate=True)
        res["compile_threads"] = torch._inductor.config.compile_threads
    res["load"] = load_str()
    return res


def _breakdown(times) -> list[list[str]]:
    """Dynamo's `compile_times(repr="csv", aggregate=True)`: (names, totals); the top entries, seconds."""
    names, totals = times
    rows = sorted(zip(names, totals), key=lambda x: -float(x[1]))
    return [[f"`{n}`", f"{float(t):.1f}"] for n, t in rows[:10]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=list(PROMPTS))
    p.add_argument("--quick", action="store_true", help="tiny random model, printed only")
    p.add_argument("--out", default=None)
    p.add_argument("--compile-threads", type=int, default=None,
                   help="TORCHINDUCTOR_COMPILE_THREADS (default: Inductor's own choice)")
    p.add_argument("--child", choices=["eager", "inductor"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.budget, a.chunk, a.prompts = 32, 32, [70, 55]
    if a.child:
        print(json.dumps(_child(a)))
        return 0
    setup_threads(1)
    info = header_lines("A new user's chunked compile: generate on two prompts, cold Inductor cache")
    runs = {}
    for backend in ("eager", "inductor"):
        print(f"[{time.strftime('%H:%M:%S')}] {backend} (load {load_str()})", flush=True)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="fxbudget_chunked_"),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT),
               "TRANSFORMERS_VERBOSITY": "error"}
        if a.compile_threads is not None:
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(a.compile_threads)
        cmd = [sys.executable, __file__, "--child", backend, "--budget", str(a.budget), "--chunk", str(a.chunk),
               "--prompts", ",".join(map(str, a.prompts)), *(["--quick"] if a.quick else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise RuntimeError(f"{backend} failed (rc {proc.returncode})")
        runs[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
        print("  ", {k: v for k, v in runs[backend].items() if k != "compile_times"}, flush=True)
    e, c = runs["eager"], runs["inductor"]
    model = "a tiny random Qwen2 (--quick)" if a.quick else "the embedded model (24 layers)"
    rows = [[f"prompt {i + 1} ({n} tokens)", f"{es:.1f}", f"{cs:.1f}", f"{cs - es:.1f}"]
            for i, (n, es, cs) in enumerate(zip(a.prompts, e["prompt_s"], c["prompt_s"]))]
    rows.append(["both", f"{sum(e['prompt_s']):.1f}", f"{sum(c['prompt_s']):.1f}",
                 f"{sum(c['prompt_s']) - sum(e['prompt_s']):.1f}"])
    lines = info + [
        f"{model}, rule `snapkv`, budget {a.budget}, `chunk_size={a.chunk}`, `generate(max_new_tokens=4)` on prompts "
        f"of {', '.join(map(str, a.prompts))} tokens; each backend in a fresh process, cold Inductor cache. Goal "
        "(issue 30): <= 30 s of compile, <= 3 graphs.", "",
        *md_table(["call", "eager kernel s", "inductor s", "compile s (difference)"], rows), "",
        f"Inductor: {c['graphs']} graphs (`model.forward.graphs`), {c['recompiles']} recompiles, "
        f"{c['graph_breaks']} graph breaks, Inductor compile threads {c['compile_threads']}; load at the end: eager {e['load']}, inductor {c['load']}.", "",
        "Dynamo's compile-time breakdown of the Inductor process (`torch._dynamo.utils.compile_times`, cumulative "
        "seconds, nested phases counted in their parents too):", "",
        *md_table(["phase", "s"], _breakdown(c["compile_times"])),
    ]
    emit(lines, a.out, a.quick, "chunked_compile", STUDY_RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
