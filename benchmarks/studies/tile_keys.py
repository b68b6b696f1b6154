"""The folded scan's key-tile width (`key_scan.TILE_KEYS`) under Inductor: each width compiled in one process, timed
interleaved against the others and the unmodified model.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/studies/tile_keys.py [--lengths 2048,4096,8192,16384] [--widths 64,512]
    OMP_NUM_THREADS=1 python benchmarks/studies/tile_keys.py --quick      # 1024 tokens, printed only

The one-layer Qwen2 of `key_scan.py` (the embedded model's attention shapes), float32, snapkv, budget 1024, the
automatic query block, one prefill on a fresh cache (the empty-slot graph). Per length, one process compiles
`fxbudget.compile(model, backend="inductor")` once per width (`TILE_KEYS` set before the compile: the rewrite reads
it at trace time), then runs the widths and `full` (eager SDPA) in turn, `--repeat` rounds; best and median kept. The
ratios are measured side by side in one process, so the machine's drift between rounds hits every column alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: benchlib

from benchlib.env import STUDY_RESULTS, ROOT, env_info, header_lines, load_str  # noqa: E402
from benchlib.output import emit, md_table  # noqa: E402


def cell(tokens: int, widths: list[int], repeat: int) -> dict:
    import torch

    import fxbudget
    import fxbudget.kernel.key_scan as key_scan
    from fxbudget.kernel import auto_block
    from key_scan import _model

    torch.set_num_threads(1)
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(1))
    runs, first, last = {}, {}, {}
    for w in widths:
        with _tile_keys(w):  # the first call compiles: the kernel reads the width when it is traced
            runs[str(w)] = fxbudget.compile(_model(tokens), rule="snapkv", budget=1024, backend="inductor")
            t0 = time.perf_counter()
            with torch.no_grad():
                last[str(w)] = runs[str(w)](input_ids=ids, logits_to_keep=1).logits[0, -1]
            first[str(w)] = time.perf_counter() - t0
    runs["full"] = _model(tokens)
    times = {k: [] for k in runs}
    for _ in range(repeat):
        for k, run in runs.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                out = run(input_ids=ids, logits_to_keep=1).logits[0, -1]
            times[k].append(time.perf_counter() - t0)
            last.setdefault(k, out)
    R = auto_block(runs["full"].config.num_attention_heads, tokens, "cpu")  # batch 1 x query heads rows
    nb = -(-tokens // R)
    tiles = {}
    for w in widths:
        with _tile_keys(w):
            tiles[str(w)] = key_scan.tile_blocks(R, nb) * R
    return {"tokens": tokens, "block": R, "times": times, "first": first, "tile": tiles,
            "max_diff": {k: float((v - last["full"]).abs().max()) for k, v in last.items()}}


@contextlib.contextmanager
def _tile_keys(width: int):
    """`key_scan.TILE_KEYS` set to `width` inside the block (the kernel reads it when it is traced)."""
    import fxbudget.kernel.key_scan as key_scan

    saved, key_scan.TILE_KEYS = key_scan.TILE_KEYS, width
    try:
        yield
    finally:
        key_scan.TILE_KEYS = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--widths", default="64,512")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        widths = [int(x) for x in args.widths.split(",")]
    except ValueError:
        sys.exit("--lengths and --widths must be comma-separated ints")
    if any(w < 1 for w in widths) or any(n < 64 for n in lengths) or args.repeat < 1:
        sys.exit("--widths must be >= 1, --lengths >= 64 tokens, --repeat >= 1")
    if args.cell:
        print("CELL " + json.dumps(cell(int(args.cell), widths, args.repeat)), flush=True)
        return
    if args.quick:
        lengths, args.repeat = [1024], 1
    info = env_info()
    rows = []
    for n in lengths:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, __file__, "--cell", str(n), "--widths", args.widths,
                            "--repeat", str(args.repeat)], env=env, capture_output=True, text=True)
        line = next((x for x in r.stdout.splitlines() if x.startswith("CELL ")), None)
        if line is None:
            sys.exit(f"{n} tokens failed:\n{r.stderr[-3000:]}")
        res = json.loads(line[5:])
        full = min(res["times"]["full"])
        for k, ts in res["times"].items():
            rows.append([n, res["block"], k, res["tile"].get(k, ""), f"{min(ts):.2f}", f"{statistics.median(ts):.2f}",
                         f"{min(ts) / full:.2f}", f"{res['first'][k]:.1f}" if k in res["first"] else "",
                         f"{res['max_diff'][k]:.1e}"])
        print("\n".join(" | ".join(map(str, row)) for row in rows[-len(res["times"]):]), flush=True)
    lines = header_lines("The folded scan's key-tile width under Inductor (one layer, one core)", info,
                         load_after=load_str()) + [
        "One-layer Qwen2 with the embedded model's attention shapes (14 query heads, 2 KV heads, head dim 64), fp32, "
        "snapkv, budget 1024, one prefill on a fresh cache. `TILE_KEYS` = the width asked for; `tile` = the new "
        f"tokens per key tile it gives at that length (`key_scan.tile_blocks`). {args.repeat} interleaved rounds per "
        "length in one process; `full` = the unmodified model (eager SDPA). First call = compile + one prefill.", "",
        *md_table(["tokens", "query block", "TILE_KEYS", "tile", "best s", "median s", "best / full", "first call s",
                   "logits vs full (max abs)"], rows)]
    emit(lines, args.out, args.quick, "tile_keys", STUDY_RESULTS)


if __name__ == "__main__":
    main()
