"""The traced measure phase under Inductor: the folded key-tile scan (issue 30) against the level scan it replaces.

    OMP_NUM_THREADS=1 python benchmarks/studies/key_scan.py [--lengths 2048,4096] [--out benchmarks/studies/results/key_scan.md]
    OMP_NUM_THREADS=1 python benchmarks/studies/key_scan.py --quick      # 512 tokens, printed only

A one-layer model with the embedded model's attention shapes (Qwen2: hidden 896, 14 query heads, 2 KV heads, head
dim 64; MLP 256 wide, vocab 128) so that the prefill is mostly the measure phase. Each (scan, length) cell runs in
its own process, the two scans one after the other per length, on a fresh empty Inductor cache:
`fxbudget.compile(model, rule="snapkv", budget=1024, backend="inductor")`, one prefill of `length` seeded random
tokens to compile, then `--repeat` timed prefills (best kept); compile s = first call minus the best warm call.
`levels` is the level scan of commit LEVELS_REV (`fxbudget/block_scan.py` read from git and patched in where the kernel
calls `scan_blocks`); `fold` is this checkout's. The unmodified model (`full`, eager SDPA) is timed in the same way.
The graph's node count is the traced measure phase of the kernel at 2K and 16K tokens (fake tensors, no compile).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: benchlib

from benchlib.env import STUDY_RESULTS, ROOT, env_info, header_lines, load_str  # noqa: E402
from benchlib.output import emit, md_table  # noqa: E402

LEVELS_REV = "bf6d873"  # the last commit with the level scan
SCANS = ("full", "levels", "fold")


def _levels_module():
    src = subprocess.run(["git", "show", f"{LEVELS_REV}:fxbudget/block_scan.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType("fxbudget._levels_baseline")
    exec(compile(src, "block_scan@" + LEVELS_REV, "exec"), mod.__dict__)
    return mod


def _use_scan(scan: str) -> None:
    """Patch the level scan in wherever the kernel bound `scan_blocks` (`from .block_scan import scan_blocks`)."""
    if scan != "levels":
        return
    import fxbudget.block_scan as bs

    old = _levels_module().scan_blocks
    for mod in list(sys.modules.values()):
        if getattr(mod, "_scan_blocks", None) is bs.scan_blocks:
            mod._scan_blocks = old


def _model(tokens: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(num_hidden_layers=1, hidden_size=896, intermediate_size=256, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=tokens + 16,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


def cell(scan: str, tokens: int, repeat: int) -> dict:
    import torch

    import fxbudget

    torch.set_num_threads(1)
    model = _model(tokens)
    _use_scan(scan)
    if scan == "full":
        run = model
    else:
        run = fxbudget.compile(model, rule="snapkv", budget=1024, backend="inductor")
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(1))
    times, last = [], None
    for _ in range(1 + repeat):
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = run(input_ids=ids, logits_to_keep=1).logits
        times.append(time.perf_counter() - t0)
        last = logits[0, -1]
    warm = min(times[1:])
    return {"scan": scan, "tokens": tokens, "first_s": times[0], "warm_s": warm,
            "compile_s": None if scan == "full" else times[0] - warm, "argmax": int(last.argmax()),
            "logits": [float(x) for x in last[:8]]}


def node_counts(lengths=(2048, 16384)) -> dict:
    """Nodes of the traced measure phase (subgraphs included), per scan and length: fake tensors, nothing runs."""
    import torch

    from fxbudget import rules
    from fxbudget.kernel import auto_block
    from fxbudget.passes.sdpa import trace_kernel

    def count(gm):
        return sum(1 for _ in gm.graph.nodes) + sum(count(m) for m in gm.children()
                                                    if isinstance(m, torch.fx.GraphModule))

    out = {}
    for scan in ("levels", "fold"):
        import fxbudget.kernel.block_scan as bs
        import fxbudget.kernel.measure as kernel

        saved = kernel.scan_blocks
        if scan == "levels":
            kernel.scan_blocks = _levels_module().scan_blocks
        try:
            for n in lengths:
                b, h, g, d, S = 1, 2, 7, 64, 1024
                ev = dict(q=torch.empty(b, h * g, n, d), keys=torch.empty(b, h, S, d),
                          values=torch.empty(b, h, S, d), pos=torch.full((b, h, S), -1),
                          state=torch.empty(b, h, S), norms=torch.empty(b, h, S, 3), totals=torch.empty(b, h, 9),
                          owner=torch.zeros(b, h, S, dtype=torch.int32),
                          k_new=torch.empty(b, h, n, d), v_new=torch.empty(b, h, n, d),
                          new_pos=torch.arange(n).view(1, n), inv_freq=torch.empty(d // 2), wo=torch.empty(h, d, g * d))
                kt = trace_kernel(ev, rules.get("snapkv"), budget=S, keep=S, sliding=0, window=32, scale=None,
                                  budget_ints=False)
                out[f"{scan} {n}"] = {"nodes": count(kt.measure), "block": auto_block(b * h * g, n, "cpu")}
        finally:
            kernel.scan_blocks = saved
        assert bs.scan_blocks is not None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/studies/results/key_scan.md"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cell", nargs=3, metavar=("SCAN", "TOKENS", "REPEAT"), help=argparse.SUPPRESS)
    ap.add_argument("--nodes", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        print("CELL " + json.dumps(cell(args.cell[0], int(args.cell[1]), int(args.cell[2]))), flush=True)
        return
    if args.nodes:
        print("NODES " + json.dumps(node_counts()), flush=True)
        return
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        sys.exit(f"--lengths must be comma-separated ints, got {args.lengths!r}")
    if args.quick:
        lengths = [512]
    if any(n < 64 for n in lengths):
        sys.exit("--lengths: every length must be >= 64 tokens (several query blocks)")
    import torch

    torch.set_num_threads(1)
    info = env_info()

    def sub(*extra):
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                   TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="ks_ind_"),
                   PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, __file__, *extra], env=env, capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if line.startswith(("CELL ", "NODES ")):
                return json.loads(line.split(" ", 1)[1])
        raise RuntimeError(f"{extra} failed:\n{r.stderr[-3000:]}")

    nodes = sub("--nodes")
    print(f"nodes: {nodes}", flush=True)
    rows = []
    for n in lengths:
        by = {}
        for scan in SCANS:
            by[scan] = res = sub("--cell", scan, str(n), str(args.repeat))
            print(f"{n} {scan}: first {res['first_s']:.1f} s, warm {res['warm_s']:.2f} s, argmax {res['argmax']}",
                  flush=True)
        for scan in SCANS:
            r = by[scan]
            rows.append([n, scan, f"{r['warm_s']:.2f}", f"{r['warm_s'] / by['full']['warm_s']:.2f}",
                         f"{r['warm_s'] / by['levels']['warm_s']:.2f}" if scan != "full" else "",
                         "" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
                         "same" if r["argmax"] == by["full"]["argmax"] else "differs"])
    lines = header_lines("Traced measure phase: folded key tiles (issue 30) vs the level scan, Inductor, one core",
                         info, load_after=load_str()) + [
                         "A shared 2-core machine: other engineers' jobs ran during this run (the load above); the "
                         "two scans of a length ran one after the other, so their ratio is the steadier figure.", "",
                         "One-layer Qwen2 with the embedded model's attention shapes (14 query heads, 2 KV heads, head dim "
              "64), float32, snapkv, budget 1024, automatic query block; one process per cell, a fresh Inductor "
              f"cache each; `levels` = `fxbudget/block_scan.py` of {LEVELS_REV}. Best of {args.repeat} warm prefills.",
              "", *md_table(["tokens", "scan", "prefill s", "time / full", "time / levels", "compile s",
                            "next token vs full"], rows),
              "", "Traced measure-phase graph (nodes, subgraphs included; one layer's kernel, fake tensors):", "",
              *md_table(["scan", "tokens", "query block", "nodes"],
                       [[k.split()[0], k.split()[1], v["block"], v["nodes"]] for k, v in nodes.items()])]
    emit(lines, None if args.quick else args.out, args.quick, "key_scan", STUDY_RESULTS)


if __name__ == "__main__":
    main()
