"""`fxbudget compare --backend inductor` against the eager kernel on `make demo`'s grid (issue 10, item 3).

    OMP_NUM_THREADS=1 python benchmarks/compiled_compare.py           # -> benchmarks/results/compiled_compare.md
    OMP_NUM_THREADS=1 python benchmarks/compiled_compare.py --quick   # one sample, two rows per protocol, printed

Runs `python -m fxbudget.demo` twice from scratch, one after the other, each in a fresh process and output folder:
the eager kernel, then `--backend inductor` with an empty Inductor cache directory, so every compile is cold. Wall
times are what a user waits for (model assembly included). Rows are matched by (task, sample, protocol, rule,
budget); predictions, scores and answer log-likelihoods are compared; compile seconds are the rows' `compile_s`
(Dynamo's own clock: tracing and Inductor) summed per run. Goal (issue 10): the same predictions, wall time including
every compile <= 1.5x the eager run's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import command_line, env_info, header_lines  # noqa: E402
from benchlib.output import emit, md_table  # noqa: E402
from demo_readme import run_demo  # noqa: E402

from fxbudget.harness.results import read_rows  # noqa: E402

GOAL = 1.5
QUICK = ["--samples", "1", "--tasks", "passkey", "--rules", "full,snapkv", "--budgets", "25%"]
MATCH = ("task", "sample", "protocol", "rule", "budget")


def run(out: Path, backend: str | None, extra: list[str], inductor_cache: Path) -> dict:
    """One `python -m fxbudget.demo` run into `out` (`demo_readme.run_demo`): its wall seconds, the load around it
    and its rows."""
    wall = run_demo(out, extra + (["--backend", backend] if backend else []),
                    env={"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)})
    return {"backend": backend or "eager", "wall_s": wall["wall_s"], "load_before": wall["load_before"],
            "load_after": wall["load_after"], "rows": read_rows(out / "results.jsonl")}


def compare(a: dict, b: dict) -> tuple[list[str], float]:
    """Markdown lines comparing run `b` with run `a`, and b's wall time over a's."""
    rows_a = {tuple(r[k] for k in MATCH): r for r in a["rows"]}
    rows_b = {tuple(r[k] for k in MATCH): r for r in b["rows"]}
    common = sorted(rows_a.keys() & rows_b.keys(), key=str)
    same_pred = [k for k in common if rows_a[k]["prediction"] == rows_b[k]["prediction"]]
    same_score = [k for k in common if rows_a[k]["score"] == rows_b[k]["score"]]
    gaps = [abs(rows_a[k]["answer_logprob"] - rows_b[k]["answer_logprob"]) for k in common
            if rows_a[k].get("answer_logprob") is not None and rows_b[k].get("answer_logprob") is not None]
    ratio = b["wall_s"] / a["wall_s"]
    lines = md_table(
        ["backend", "wall s (compiles included)", "rows", "compile s (sum of rows)", "load before", "load after"],
        [[r["backend"], f"{r['wall_s']:.1f}", len(r["rows"]), f"{sum(x['compile_s'] for x in r['rows']):.1f}",
          r["load_before"], r["load_after"]] for r in (a, b)])
    lines += ["", f"- Wall time {b['backend']} / {a['backend']}: **{ratio:.2f}x** (goal <= {GOAL}: "
              f"{'met' if ratio <= GOAL else 'NOT met'}).",
              f"- Rows in both runs: {len(common)} (only {a['backend']}: {len(rows_a.keys() - rows_b.keys())}, only "
              f"{b['backend']}: {len(rows_b.keys() - rows_a.keys())}).",
              f"- Same prediction: **{len(same_pred)} of {len(common)}**; same score: {len(same_score)} of "
              f"{len(common)}.",
              f"- Answer log-likelihood, largest |difference| over {len(gaps)} rows: "
              f"{max(gaps, default=float('nan')):.2e} nats."]
    differ = [k for k in common if k not in same_pred]
    if differ:
        lines += ["", "Rows whose predictions differ:", ""]
        lines += md_table(list(MATCH) + [a["backend"], b["backend"]],
                          [[*k, repr(rows_a[k]["prediction"]), repr(rows_b[k]["prediction"])] for k in differ[:20]])
    return lines, ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor", help="the compiled backend (default inductor)")
    p.add_argument("--quick", action="store_true", help="a small grid (one sample, full and snapkv), printed only")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    extra = QUICK if a.quick else []
    info = env_info("cpu")
    with tempfile.TemporaryDirectory(prefix="fxb-compiled-compare-") as tmp:
        tmp = Path(tmp)
        runs = [run(tmp / "eager", None, extra, tmp / "inductor-cache-eager"),
                run(tmp / a.backend, a.backend, extra, tmp / f"inductor-cache-{a.backend}")]
    lines = header_lines("compare on make demo's grid: compiled against the eager kernel", info, command_line(),
                         runs[-1]["load_after"])
    grid = " ".join(["python -m fxbudget.demo", *extra])
    lines += [f"Grid: `{grid}` (eager), then the same with `--backend {a.backend}` and an empty Inductor cache "
              "directory; one run after the other, each from scratch in its own process.", ""]
    body, _ = compare(*runs)
    emit(lines + body, a.out, a.quick, "compiled_compare")
    return 0


if __name__ == "__main__":
    sys.exit(main())
