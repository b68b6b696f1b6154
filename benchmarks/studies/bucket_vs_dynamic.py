"""Few graphs for calls of varying length: pad to a fixed bucket (static shapes) or mark the length dynamic?

    OMP_NUM_THREADS=1 python benchmarks/studies/bucket_vs_dynamic.py [--budget 1024] [--bucket 256] [--lengths 17,64,150,256]

The budget kernel of one attention layer (embedded model shapes, a full cache: every call evicts), compiled with
Inductor two ways: static shapes at the bucket length (a call of n tokens is padded to the bucket: pads are candidates
at position -1, so a padded call costs what a bucket-length call costs), and one graph with the call length marked
dynamic. Reported: compile seconds of each (fresh Inductor cache directory per variant, so both are cold), graphs
built, and the time per call at each length (the static graph at the bucket length, the dynamic graph at n).

The kernel is compiled directly here (no SDPA pass): the pass splices make_fx traces with concrete sizes and refuses
dynamic shapes, so this measures what Inductor would do with either choice, not a path fxbudget ships. The length
is marked with `maybe_mark_dynamic`: where the kernel's code specializes it (it indexes the call's last query as
`x[..., n - 1]`, and branches on `min(window, n)` and on k == 1 for top-k), Dynamo builds one graph per length, and
the table's "graphs built" says so. The rule is knorm: Dynamo cannot trace `Signals.order` (a cached_property with a
lock), which snapkv's pooling uses; the pass traces rules with make_fx, which can.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: benchlib
from benchlib.env import STUDY_RESULTS, header_lines, setup_threads, tune_malloc
from benchlib.timing import interleaved, median_us, timed
from benchlib.output import emit, md_table
from benchlib.cases import LayerCase, fresh_function


def _compile(dynamic: bool):
    import torch
    from torch._dynamo.utils import counters

    import fxbudget.kernel.rule_region
    from fxbudget.compiler.backend import kernel_window
    from fxbudget.kernel import PER_HEAD, LayerConstants, LayerSlots, NewTokens, evict_phase, measure_phase, rule_phase
    from fxbudget.rules import get

    rule = get("knorm")  # Dynamo cannot trace Signals.order (a cached_property with a lock), so no snapkv here
    window = kernel_window(rule)
    # Nor the rule contract's storage check (the SDPA pass enforces it while tracing with make_fx): knorm writes
    # nothing, and this benchmark compiles the kernel with Dynamo directly, so it runs without the check.
    fxbudget.kernel.rule_region.NoMutation = lambda rule, signals: contextlib.nullcontext()

    def kernel(q, k, v, new_pos, keys, values, pos, state, norms, totals, inv_freq, wo):
        # The three phases as the SDPA pass splices them (measure traced: no data-dependent branch).
        slots = LayerSlots(keys, values, pos, state, norms, totals, None)
        new = NewTokens(k, v, new_pos.expand(q.shape[0], -1))
        out, new_totals, signals = measure_phase(PER_HEAD, q, slots, new, LayerConstants(inv_freq, wo),
                                                 window=window, sliding=0, scale=None, block=None, traced=True)
        score = rule_phase(PER_HEAD, rule, keys.shape[2], window, signals)
        evict_phase(PER_HEAD, score, signals, new_totals, slots, new, keep=keys.shape[2])
        return out

    before = counters["stats"]["unique_graphs"]
    fn = torch.compile(fresh_function(kernel), fullgraph=True, dynamic=False if not dynamic else None)
    return fn, lambda: counters["stats"]["unique_graphs"] - before


def _args(case, n: int, dynamic: bool):
    import torch

    L = case.layer
    q, k, v = case.q[:, :, :n], case.k[:, :, :n], case.v[:, :, :n]
    new_pos = torch.arange(n) + int(L.seen)
    if dynamic:
        for t, d in ((q, 2), (k, 2), (v, 2), (new_pos, 0)):
            torch._dynamo.maybe_mark_dynamic(t, d)  # the kernel may still specialize it: then graphs > 1
    return (q, k, v, new_pos, L.keys, L.values, L.pos, L.state, L.norms, L.totals, L.inv_freq, L.wo)


def _child(variant: str, budget: int, bucket: int, lengths: list[int]) -> None:
    """In a fresh process: the cold compile of one variant (its own empty Inductor cache): the first call at every
    length, recompiles included. Prints JSON."""
    import json

    import torch

    case = LayerCase("knorm", budget, bucket)
    torch.compile(lambda x: x * 2 + 1)(torch.ones(4))  # Inductor's one-time start-up, outside the measurement
    fn, built = _compile(variant == "dynamic")
    with torch.no_grad():
        seconds = sum(timed(lambda n=n: fn(*_args(case, bucket if variant == "static" else n, variant == "dynamic")))
                      for n in lengths)
    print(json.dumps({"compile_s": seconds, "graphs": built()}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--bucket", type=int, default=256)
    p.add_argument("--lengths", default="17,64,150,256", help="call lengths (each <= bucket)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny smoke run (budget 64, bucket 32), printed only")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["static", "dynamic"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.budget, args.bucket, args.lengths, args.reps = 64, 32, "5,20,32", 3
    setup_threads(1)
    tune_malloc()
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) > args.bucket:
        p.error("every length must be <= the bucket")
    if args.child:
        _child(args.child, args.budget, args.bucket, lengths)
        return 0
    import json
    import subprocess
    import sys

    import torch

    info_lines = header_lines("Bucket padding vs a dynamic call length (one attention layer's budget kernel)")
    cold, dirs = {}, {}
    for variant in ("static", "dynamic"):  # cold compiles, each in a fresh process with an empty Inductor cache
        dirs[variant] = tempfile.mkdtemp(prefix=f"fxbudget_{variant}_")
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--budget", str(args.budget), "--bucket",
                              str(args.bucket), "--lengths", args.lengths],
                             env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": dirs[variant]}, capture_output=True,
                             text=True, check=True)
        cold[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    # Call times, both variants interleaved in this process (compiled again from the children's caches).
    case = LayerCase("knorm", args.budget, args.bucket)
    calls = {}
    for variant in ("static", "dynamic"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = dirs[variant]
        fn, _ = _compile(variant == "dynamic")
        for n in lengths:
            length, dyn = (args.bucket, False) if variant == "static" else (n, True)
            calls[f"{variant}/{n}"] = lambda fn=fn, length=length, dyn=dyn: fn(*_args(case, length, dyn))
    with torch.no_grad():
        for f in calls.values():  # any compile happens here, outside the timed rounds
            f()
        times = interleaved(calls, args.reps)
    us = {k: median_us(v) for k, v in times.items()}
    rows = [[n, f"{us[f'static/{n}']:.0f}", f"{us[f'dynamic/{n}']:.0f}",
             f"{us[f'dynamic/{n}'] / us[f'static/{n}']:.2f}"] for n in lengths]
    lines = info_lines + [
        f"Budget {args.budget} (a full cache: every call evicts), bucket {args.bucket}, knorm, one thread.", "",
        "| variant | cold compile (fresh process and cache) | graphs built |", "|---|---|---|",
        f"| static, padded to {args.bucket} | {cold['static']['compile_s']:.1f} s | {cold['static']['graphs']} |",
        f"| dynamic length | {cold['dynamic']['compile_s']:.1f} s | {cold['dynamic']['graphs']} |", "",
        "Compile: the first call at each length in order, recompiles included.", "",
        *md_table(["call length n", "static, padded (us)", "dynamic (us)", "dynamic / static"], rows),
    ]
    emit(lines, args.out, args.quick, "bucket_vs_dynamic", STUDY_RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
