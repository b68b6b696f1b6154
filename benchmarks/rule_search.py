"""One real rule search on the embedded model (issue 14): `fxbudget search` at one budget, then its held-out verdict.

    OMP_NUM_THREADS=1 python benchmarks/rule_search.py [--samples 2] [--trials 20] [--holdout-samples 4] [--quick]

passkey + niah_multikey at 2K tokens, budget 256, query-agnostic protocol (the rule never sees the question), eager
kernel, one torch thread. The search fits the `weighted` family on `--samples` calibration samples per task
(generator seed 0) by the gold answer's log-likelihood, then compares the found rule with streamingllm, h2o, snapkv,
tova and knorm on `--holdout-samples` held-out samples per task (seed 1000). The summary
(benchmarks/results/rule_search.md) is `fxbudget search`'s own `search.md`: the command, the date and the load
average at the start and the end, wall times, the formula, calibration vs held-out, the paired verdict; the found
rule file is copied to benchmarks/results/ (`fxbudget compare --rule-file benchmarks/results/searched_b256.py ...`
loads it). The study lives in `--out` (rerunning resumes it; delete it for a fresh search). The default sizes fit
~25 minutes on a shared 2-core machine: 8 held-out paired samples are the fewest at which the paired test can
separate two of six rules at all, so the verdict is coarse. `--quick` is a smoke run (1 sample, 3 trials, 1 held-out
sample, written under runs/ only).
"""

from __future__ import annotations

import argparse
import os
import shutil

from benchlib.env import ROOT, setup_threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2, help="calibration samples per task")
    p.add_argument("--trials", type=int, default=20, help="completed trials in the study (the first 6: the family's "
                   "points equal to built-in rules)")
    p.add_argument("--holdout-samples", type=int, default=4, help="held-out samples per task")
    p.add_argument("--budget", type=int, default=256, help="KV entries per layer and KV head")
    p.add_argument("--out", default=None, help="the study's folder (default: runs/rule_search[_quick])")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 sample, 3 trials, 1 held-out sample")
    args = p.parse_args()
    setup_threads(1)
    if args.quick:
        args.samples, args.trials, args.holdout_samples = 1, 3, 1
    os.chdir(ROOT)  # paths in the summary and the rule file are relative to the checkout
    out = args.out or ("runs/rule_search_quick" if args.quick else "runs/rule_search")
    argv = ["search", "--tasks", "passkey,niah_multikey", "--lengths", "2000", "--protocol", "query-agnostic",
            "--budget", str(args.budget), "--samples", str(args.samples), "--trials", str(args.trials),
            "--holdout-samples", str(args.holdout_samples), "--threads", "1", "--out", out]
    if args.quick:
        argv += ["--note", "SMOKE RUN (benchmarks/rule_search.py --quick): sizes too small to show anything"]
    else:
        argv += ["--summary", "benchmarks/results/rule_search.md",
                 "--note", "Written by benchmarks/rule_search.py (the command below is what it ran)"]
    from fxbudget.cli import main as cli

    rc = cli(argv)
    if rc == 0 and not args.quick:
        found = f"searched_b{args.budget}.py"
        shutil.copyfile(os.path.join(out, found), os.path.join("benchmarks/results", found))
        print(f"copied the rule file to benchmarks/results/{found}")
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
