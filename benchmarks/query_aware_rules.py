"""Issue 23, item 4: the new rules beside snapkv and expected_attention, query-aware, on the embedded model.

    OMP_NUM_THREADS=1 python benchmarks/query_aware_rules.py           # -> benchmarks/results/query_aware_rules.md
    OMP_NUM_THREADS=1 python benchmarks/query_aware_rules.py --quick   # one sample, three rules, printed only
    OMP_NUM_THREADS=1 python benchmarks/query_aware_rules.py --rules full,snapkv,expected_attention,defensivekv \
        --run-dir runs/query_aware_defensivekv --out benchmarks/results/query_aware_defensivekv.md

One `fxbudget compare` run (a fresh process, timed as a user waits for it, model assembly included) on the demo's
tasks and budgets (passkey and multi-key needle-in-a-haystack at ~1K tokens, four samples each, 12.5% and 25% of each
sample's context), the query-aware protocol only (the question's queries form the observation window: SnapKV's own
setting), one shared prefill per sample with the cache branched per rule and budget. Every rule runs at one
observation window, the demo's 32 (`chunkkv.window=32`: its kvpress default is 64; the kernel's window is one value per
comparison). The report's paired comparisons (sign-flip test over the 8 paired samples, Holm-adjusted over the
rivals of the best) are copied from the run's report.md; the run folder keeps everything (rerunning resumes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import ROOT, command_line, env_info, header_lines, load_str  # noqa: E402
from benchlib.output import emit  # noqa: E402

RULES = ["full", "snapkv", "expected_attention", "observed_attention", "chunkkv", "lagkv", "cur", "leverage",
         "compactor", "keydiff"]


def grid(rules: list[str]) -> list[str]:
    """The compare arguments of the comparison for `rules` (chunkkv's window set to the run's when it is there)."""
    return ["compare", "--tasks", "passkey,niah_multikey", "--lengths", "1000", "--rules", ",".join(rules),
            "--budgets", "12.5%,25%", "--samples", "4", "--protocol", "query-aware",
            *(["--param", "chunkkv.window=32"] if "chunkkv" in rules else [])]


QUICK = ["compare", "--tasks", "passkey", "--lengths", "1000", "--rules", "full,snapkv,chunkkv", "--budgets", "12.5%",
         "--samples", "1", "--protocol", "query-aware", "--param", "chunkkv.window=32"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one sample, three rules, printed only")
    p.add_argument("--rules", default=None, help=f"comma-separated (default {','.join(RULES)})")
    p.add_argument("--run-dir", default=None, help="the compare output folder (default runs/query_aware_rules)")
    p.add_argument("--out", default=None, help="the results file (default benchmarks/results/query_aware_rules.md)")
    a = p.parse_args()
    args = QUICK if a.quick else grid(a.rules.split(",") if a.rules else RULES)
    run_dir = Path(a.run_dir or ROOT / "runs" / ("query_aware_rules_quick" if a.quick else "query_aware_rules"))
    info = env_info("cpu")
    cmd = [sys.executable, "-m", "fxbudget.cli", *args, "--out", str(run_dir)]
    load_before, t = load_str(), time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall_s = time.perf_counter() - t
    load_after = load_str()
    shown = "OMP_NUM_THREADS=1 fxbudget " + " ".join(args)
    lines = header_lines("Query-aware comparison of issue 23's rules beside snapkv and expected_attention", info,
                         command_line(),
                         load_after)
    lines += [f"- Grid: `{shown}`", f"- Wall time {wall_s:.1f} s (model assembly included; rerunning resumes, so a "
              f"resumed run's wall time covers only the rows it ran); load average {load_before} before, "
              f"{load_after} after", "",
              "Everything below is the run's own report.md, headings one level down, without its plots (they stay "
              "in the run folder).", ""]
    report = [line for line in (run_dir / "report.md").read_text().splitlines()
              if not line.startswith("![") and line.lstrip("#").strip() != "plots"]
    lines += ["#" + line if line.startswith("#") else line for line in report]
    emit(lines, a.out, a.quick, "query_aware_rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
