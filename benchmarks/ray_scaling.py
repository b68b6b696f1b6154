"""Scale-out: one comparison grid run serially, then on Ray workers (`fxbudget compare --ray`); same rows.

    OMP_NUM_THREADS=1 python benchmarks/ray_scaling.py [--workers 2] [--samples 6] [--tokens 1000] [--device D] [--dtype T]
        [--quick] [--out ...]

The embedded model, passkey samples of ~`--tokens` context tokens, rules x budgets below, eager kernel, shared
prefill, on the device and dtype `fxbudget compare` defaults to (a visible GPU in bfloat16, else the CPU in
float32; `--device`, `--dtype`); one torch thread everywhere.
- serial: `Runner` in this process, as `fxbudget compare` runs it: model load, each rule's kernel fingerprint traced
  (timed apart here; a plain run does it during its first sample), then every sample in turn.
- Ray: a local Ray of `--workers` CPUs started here, then `RayRunner` (what `--ray` runs): `--workers` actors of one
  CPU and one thread each, each loading the model once, the fingerprints traced once (rules split over the workers);
  this process only plans and writes.
Reported: wall seconds of each part, the speed-up in total (goal >= 1.7x with 2 workers on 2 cores) and for the rows
alone, the overhead per sample (from handing a sample to a worker until its last row is back, minus the worker's own
time for it) and whether every row equals the serial run's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

from benchlib.env import ROOT, env_info, header_lines, load_str, setup_threads, tune_malloc
from benchlib.output import emit, md_table

# What must not depend on where a row ran (timings and the process's environment may).
SAME = ("prediction", "score", "output_tokens", "kv_allocated_bytes", "kv_held_bytes", "kernel_fingerprint",
        "layer_budgets", "shared_prefill", "n_tokens", "depth", "headroom", "window", "rule_params",
        "protocol", "budget", "budget_fraction", "answer_logprob", "answer_logprob_mean")
RULES = "full,streamingllm,snapkv,knorm,tova"
BUDGETS = "128,256,512"


def _rows(out: Path) -> dict:
    from fxbudget.harness.results import read_rows

    return {r["key"]: r for r in read_rows(out / "results.jsonl")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2, help="Ray workers (one CPU, one thread each)")
    p.add_argument("--samples", type=int, default=6, help="passkey samples (units of work)")
    p.add_argument("--tokens", type=int, default=1000, help="context length")
    p.add_argument("--rules", default=RULES)
    p.add_argument("--budgets", default=BUDGETS)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, as "
                   "`fxbudget compare`; on a GPU each Ray worker holds an equal share of the visible GPUs)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on a GPU, float32 on the CPU (as `fxbudget compare`)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 samples of 300 tokens, 2 rules, 1 budget; "
                   "prints, writes nothing")
    p.add_argument("--out", default=None, help="default: benchmarks/results/ray_scaling.md")
    args = p.parse_args()
    if args.quick:
        args.samples, args.tokens, args.rules, args.budgets = 2, 300, "full,snapkv", "128"
    setup_threads(1)
    tune_malloc()
    from fxbudget.models.devices import resolve

    place = resolve(args.device, args.dtype)  # an absent GPU or a bad name stops here, before any model work
    info = env_info(place.device)

    import ray
    import torch

    from fxbudget.harness.ray_runner import RayOptions, RayRunner
    from fxbudget.harness.runner import REFERENCE, Grid, Runner
    from fxbudget.models import load_model
    from fxbudget.rules import get

    grid = Grid(tasks=["passkey"], lengths=[args.tokens], rules=args.rules.split(","),
                budgets=[int(b) for b in args.budgets.split(",")], samples=args.samples)
    tmp = Path(tempfile.mkdtemp(prefix="ray_scaling-"))

    loads = [load_str()]  # at the start of each part and at the end: the machine may be shared
    t0 = time.perf_counter()
    model, tok, name = load_model(None, progress=False, device=place.device, dtype=place.dtype)
    serial_start = time.perf_counter() - t0
    runner = Runner(model, tok, name, grid, tmp / "serial", progress=False)
    t = time.perf_counter()  # what a serial run does on its first sample, apart (the Ray side does it at start)
    for rule in grid.rules:
        if rule != REFERENCE:
            runner._fingerprint(get(rule, **grid.rule_params.get(rule, {})))
    serial_fingerprints = time.perf_counter() - t
    serial_start += serial_fingerprints
    t = time.perf_counter()
    runner.run()
    serial_run = time.perf_counter() - t
    del model, tok, runner
    gc.collect()

    loads.append(load_str())
    t0 = time.perf_counter()
    gpus = torch.cuda.device_count() if place.device != "cpu" else 0
    ray.init(num_cpus=args.workers, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"py_modules": [str(ROOT / "fxbudget")]})
    ray_init = time.perf_counter() - t0
    options = RayOptions(workers=args.workers, gpus_per_worker=min(1.0, gpus / args.workers) if gpus else 0.0)
    dist = RayRunner(None, grid, tmp / "ray", progress=False, options=options, dtype=place.dtype)
    t = time.perf_counter()
    dist.run()
    ray_total = time.perf_counter() - t
    ray.shutdown()
    loads.append(load_str())
    ray_start = ray_init + dist.startup_s
    ray_run = ray_total - dist.startup_s

    serial_rows, ray_rows = _rows(tmp / "serial"), _rows(tmp / "ray")
    same = set(serial_rows) == set(ray_rows) and all(
        {f: serial_rows[k].get(f) for f in SAME} == {f: ray_rows[k].get(f) for f in SAME} for k in serial_rows)
    overhead = [driver - own for driver, own in dist.unit_seconds]
    own = [own for _, own in dist.unit_seconds]
    end_to_end = (serial_start + serial_run) / (ray_start + ray_run)
    rows_only = serial_run / ray_run
    prompt = statistics.median(r["prompt_tokens"] for r in serial_rows.values())

    lines = header_lines(f"Scale-out: serial vs {args.workers} Ray workers (comparison grid)", info,
                         load_after=loads[-1]) + [
        f"Embedded model, passkey, {args.samples} samples of ~{args.tokens} context tokens (prompt median "
        f"{prompt:.0f} tokens), rules {args.rules} x budgets {args.budgets}: {len(serial_rows)} rows, "
        f"{len(serial_rows) // args.samples} per sample; {place.device}, {place.dtype}; eager kernel, shared "
        "prefill, query-agnostic. Serial: one "
        f"process, 1 thread. Ray {ray.__version__}: a local Ray of {args.workers} CPUs, {args.workers} workers of 1 "
        "CPU and 1 thread, each loading the model once; the driver only plans and writes.", "",
        *md_table(["seconds", "serial", f"Ray, {args.workers} workers"], [
            ["start: Ray / load the model (Ray: the workers, in parallel) / trace the kernel fingerprints (Ray: the "
             "rules split over the workers)", f"- / {serial_start - serial_fingerprints:.1f} / "
             f"{serial_fingerprints:.1f}", f"{ray_init:.1f} / {dist.startup_s - dist.fingerprint_s:.1f} / "
             f"{dist.fingerprint_s:.1f}"],
            ["rows: first sample to last row", f"{serial_run:.1f}", f"{ray_run:.1f}"],
            ["total", f"{serial_start + serial_run:.1f}", f"{ray_start + ray_run:.1f}"],
        ]), "",
        f"- speed-up, total: **{end_to_end:.2f}x** (goal >= 1.7x: {'met' if end_to_end >= 1.7 else 'NOT met'}); "
        f"rows only: {rows_only:.2f}x",
        f"- overhead per sample (handed to a worker until its last row is back, minus the worker's own time): median "
        f"{1e3 * statistics.median(overhead):.0f} ms, max {1e3 * max(overhead):.0f} ms; a worker's own time per "
        f"sample: median {statistics.median(own):.1f} s (serial: {serial_run / args.samples:.1f} s per sample)",
        f"- every row equal to the serial run's ({', '.join(SAME)}): {same}",
        f"- load average (1/5/15 min) at the start of the serial part {loads[0]}, of the Ray part {loads[1]}, at the "
        f"end {loads[2]} (2 cores)",
        f"- results: {tmp}",
    ]
    emit(lines, args.out, args.quick, "ray_scaling")


if __name__ == "__main__":
    main()
