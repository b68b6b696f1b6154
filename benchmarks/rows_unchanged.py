"""Does today's code give the rows an earlier commit gives? (issue 29: "nothing else changes")

Runs the first `--samples` sample(s) of `--tasks` of the `make demo` grid (fxbudget.demo: ~1K tokens, full + five
rules at 12.5% and 25%, query-agnostic and query-aware) twice on this machine, one after the other: with the code of
`--base` (a temporary git worktree, imported through PYTHONPATH) and with the working tree; then compares the rows of
the same key: prediction and score exactly, the answer log-likelihood within `--tol` nats, the kernel fingerprint
exactly. Writes benchmarks/results/rows_unchanged.md and exits 1 on any difference.

    python benchmarks/rows_unchanged.py --base cef6246 [--samples 1] [--tasks passkey]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rows(path: Path) -> dict[str, dict]:
    return {r["key"]: r for r in map(json.loads, path.read_text().splitlines()) if r.get("key")}


def compare(old: dict[str, dict], new: dict[str, dict], tol: float,
            fields=("prediction", "score", "kernel_fingerprint")) -> tuple[list[str], int]:
    """Differences (one line each) between rows of the same key, and how many rows were compared."""
    diffs, n = [], 0
    for key, r in new.items():
        if key not in old:
            diffs.append(f"{key}: no committed row")
            continue
        o, n = old[key], n + 1
        for field in fields:
            if o.get(field) != r.get(field):
                diffs.append(f"{key}: {field} {o.get(field)!r} -> {r.get(field)!r}")
        a, b = o.get("answer_logprob"), r.get("answer_logprob")
        if (a is None) != (b is None) or (a is not None and abs(a - b) > tol):
            diffs.append(f"{key}: answer_logprob {a!r} -> {b!r}")
    return diffs, n


def _run(code: Path, out: Path, samples: int, tasks: str) -> float:
    """The demo grid's subset with the fxbudget of `code`, rows into `out`; seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fxbudget.demo", "--samples", str(samples), "--tasks", tasks,
                    "--out", str(out), "--quiet"], cwd=code, env={**os.environ, "PYTHONPATH": str(code)},
                   check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. the one before a change)")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--tasks", default="passkey")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/rows_unchanged.md"))
    ap.add_argument("--kernel-changed", action="store_true",
                    help="the kernel's graph changed on purpose: its fingerprint is reported per side (one each), "
                         "not counted as a difference")
    args = ap.parse_args()
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), base], cwd=ROOT, check=True)
        try:
            wall_base = _run(tree, Path(tmp) / "rows-base", args.samples, args.tasks)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        wall_head = _run(ROOT, Path(tmp) / "rows-head", args.samples, args.tasks)
        old, new = (_rows(Path(tmp) / d / "results.jsonl") for d in ("rows-base", "rows-head"))
    fields = ("prediction", "score") if args.kernel_changed else ("prediction", "score", "kernel_fingerprint")
    diffs, n = compare(old, new, args.tol, fields)
    import torch
    import transformers

    prints = sorted({r.get("kernel_fingerprint") for r in new.values() if r.get("kernel_fingerprint")})
    before = sorted({r.get("kernel_fingerprint") for r in old.values() if r.get("kernel_fingerprint")})
    lines = ["# Demo rows before and after", "",
             f"`python benchmarks/rows_unchanged.py --base {base} --samples {args.samples} --tasks {args.tasks}"
             f"{' --kernel-changed' if args.kernel_changed else ''}`: the "
             f"first {args.samples} sample(s) of {args.tasks} of the `make demo` grid, run with the code of {base} "
             f"({wall_base:.0f} s) and of {head} ({wall_head:.0f} s), one after the other on this machine (torch "
             f"{torch.__version__}, transformers {transformers.__version__}, one thread), compared row by row (same "
             f"key): prediction, score{'' if args.kernel_changed else ' and kernel fingerprint'} exactly, answer "
             f"log-likelihood within {args.tol:g} nats.", "", f"- rows compared: {n}",
             f"- kernel fingerprints of the run: {', '.join(p[:16] for p in prints)}"
             + (f" (of {base}'s run: {', '.join(p[:16] for p in before)}; the kernel's graph changed on purpose)"
                if args.kernel_changed else ""),
             f"- differences: {len(diffs)}"]
    lines += [f"  - {d}" for d in diffs[:50]]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
