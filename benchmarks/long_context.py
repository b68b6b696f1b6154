"""One-call prefill at long context: fxbudget (eager kernel, Inductor) against the unmodified model (issue 9).

    OMP_NUM_THREADS=1 python benchmarks/long_context.py                    # 2K, 4K, 8K, 16K -> results/long_context.md
    OMP_NUM_THREADS=1 python benchmarks/long_context.py --quick            # 1K, 2K, eager sides only, printed
    python benchmarks/long_context.py --device cuda --dtype bfloat16 --lengths 32768,65536,131072 --out ...  # GPU

Each (side, length) runs in its own process: load the embedded model, page every weight in with a short forward, then
reset the memory high-water mark and run ONE prefill of `length` seeded random tokens with `logits_to_keep=1`.
"memory" is the peak above the paged-in model during that call (CPU: VmHWM after /proc/self/clear_refs minus the RSS
before it; CUDA: max_memory_allocated minus the memory allocated before it). Sides:
- `full`: the unmodified model (SDPA, transformers' DynamicCache): what fxbudget is compared with;
- `eager`: fxbudget's kernel without torch.compile (`backend=None`), one call, eviction after it (snapkv, budget 1024);
- `inductor`: the same under Inductor; it first runs the prefill once to compile (compile seconds reported apart), the
  timed call is the second;
- `chunked`: fxbudget eager with `chunk_size=512` (eviction after every chunk: another protocol; for reference).
Ratios are fxbudget / full at the same length, from this one run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import ROOT, command_line, env_info, header_lines, load_str, tune_malloc  # noqa: E402
from benchlib.output import emit, md_table  # noqa: E402

SIDES = ("full", "eager", "inductor", "chunked")
GOALS = "memory above the weights <= 1.5x the unmodified model's at every length; time <= 1.3x at 8K"


def _rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


class _Peak:
    """Peak memory of a block above what was held when it started (CPU: RSS high-water mark; CUDA: allocator)."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        import torch

        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = _rss()["VmRSS"]
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        peak = torch.cuda.max_memory_allocated() if self.device == "cuda" else _rss()["VmHWM"]
        self.mb = (peak - self.base) / 2**20


def _child(side: str, n: int, a) -> dict:
    import torch
    from transformers import DynamicCache

    import fxbudget
    from fxbudget.cache.keyword import cache_kwargs
    from fxbudget.models import load_default

    torch.set_num_threads(a.threads)
    tune_malloc()  # as `fxbudget compare` does, on both sides
    dtype = getattr(torch, a.dtype)
    model, _ = load_default(progress=False)
    model = model.to(device=a.device, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to(a.device)
    if side != "full":
        fxbudget.compile(model, rule="snapkv", budget=a.budget, backend="inductor" if side == "inductor" else None,
                         chunk_size=512 if side == "chunked" else None, block=a.block)

    def prefill(x):
        cache = model.forward.new_cache(1) if side != "full" else DynamicCache()
        with torch.no_grad():
            return model(input_ids=x, use_cache=True, logits_to_keep=1, **cache_kwargs(model.forward, cache)).logits

    prefill(ids[:, :64])  # pages in every weight, first-call overheads (eager); a short graph for inductor
    compile_s = None
    if side == "inductor":
        t = time.perf_counter()
        prefill(ids)  # compiles the graph of this length
        compile_s = time.perf_counter() - t
    with _Peak(a.device) as peak:
        logits = prefill(ids)
    return {"side": side, "n": n, "seconds": peak.seconds, "mb": peak.mb, "compile_run_s": compile_s,
            "token": int(logits[0, -1].argmax()), "load": load_str()}


def _run_child(side: str, n: int, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", side, str(n), *argv], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        return {"side": side, "n": n, "error": f"rc {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192,16384")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--block", type=int, default=None, help="the kernel's query block (default: automatic)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="1K and 2K, eager sides only, printed (a smoke run)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=2, metavar=("SIDE", "N"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(a.child[0], int(a.child[1]), a)))
        return 0
    if a.quick:
        a.lengths, a.sides = "1024,2048", "full,eager"
    lengths = [int(x) for x in a.lengths.split(",")]
    sides = a.sides.split(",")
    argv = ["--budget", str(a.budget), "--device", a.device, "--dtype", a.dtype, "--threads", str(a.threads)]
    if a.block:
        argv += ["--block", str(a.block)]
    tune_malloc()  # so the header states the children's setting
    info = env_info(a.device)
    results = {}
    for n in lengths:
        for side in sides:
            r = _run_child(side, n, argv)
            results[(side, n)] = r
            print(json.dumps(r), file=sys.stderr, flush=True)
    rows = []
    for n in lengths:
        full = results.get(("full", n), {})
        for side in sides:
            r = results[(side, n)]
            if "error" in r:
                rows.append([n, side, r["error"], "", "", "", "", ""])
                continue
            ratio = (lambda k: f"{r[k] / full[k]:.2f}" if side != "full" and full.get(k) else "")
            rows.append([n, side, f"{r['seconds']:.1f}", ratio("seconds"), f"{r['mb']:.0f}", ratio("mb"),
                         "" if r["compile_run_s"] is None else f"{r['compile_run_s']:.0f}",
                         "same" if side == "full" or r["token"] == full.get("token") else "differs" if full else ""])
    lines = header_lines("Long context: one-call prefill, fxbudget vs the unmodified model", info,
                         command_line(f"OMP_NUM_THREADS={a.threads} "), load_after=load_str())
    lines += [f"Embedded model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF dequantized), {a.dtype} on {a.device}; "
              f"snapkv, budget {a.budget}, kernel query block {a.block or 'automatic'}; seeded random tokens; one process per cell. "
              f"Goals (issue 9): {GOALS}.", "",
              *md_table(["tokens", "side", "prefill s", "time / full", "MB above weights", "memory / full",
                         "compile run s", "next token vs full"], rows)]
    emit(lines, a.out, a.quick, "long_context")
    return 0


if __name__ == "__main__":
    sys.exit(main())
