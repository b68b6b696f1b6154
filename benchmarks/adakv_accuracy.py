"""AdaKV's accuracy on the demo's query-aware grid: `adakv:snapkv` and `adakv:expected_attention` beside `snapkv` and
`expected_attention`, with the paired test of each adaptive rule against its uniform rule.

    OMP_NUM_THREADS=1 python benchmarks/adakv_accuracy.py                 # -> benchmarks/results/adakv_accuracy.md
    OMP_NUM_THREADS=1 python benchmarks/adakv_accuracy.py --samples 2     # fewer samples per task (faster)
    python benchmarks/adakv_accuracy.py --from-run runs/adakv_accuracy    # only the report, from an earlier run

The grid is `make demo`'s (`fxbudget.demo`: passkey and niah_multikey at ~1K tokens, budgets 12.5% and 25% of each
sample's context, `--samples` per task) in the query-aware protocol, with the rules above and the unmodified model
(`full`) as reference, run by `fxbudget compare` (eager kernel, one shared prefill per sample). The run holds a
head-adaptive rule, so every rule of it runs on the head-pooled layout (one kernel fingerprint; the rows record
`allocation` and `layout`). The paired test: per budget, over the samples both rules ran, the mean of
`adaptive - uniform` for the score and for the answer log-likelihood per token, its 95% interval and the sign-flip
p-value (`fxbudget.harness.stats.paired_diff`, the report's own test). The run's report, summary and rows are kept
in `benchmarks/results/adakv_accuracy/`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import ROOT, command_line, env_info, header_lines, load_str  # noqa: E402
from benchlib.output import analysis_link, md_table, write_md  # noqa: E402

PAIRS = (("adakv:snapkv", "snapkv"), ("adakv:expected_attention", "expected_attention"))
RULES = "full," + ",".join(r for pair in PAIRS for r in pair)
KEEP = ("report.md", "summary.csv", "paired.csv", "results.jsonl", "run.json")


def compare_args(samples: int, out: str) -> list[str]:
    """The `fxbudget compare` arguments: the demo's grid, query-aware only, the AdaKV rules beside the uniform."""
    return ["compare", "--tasks", "passkey,niah_multikey", "--lengths", "1000", "--rules", RULES,
            "--budgets", "12.5%,25%", "--samples", str(samples), "--protocol", "query-aware", "--out", out]


def paired_lines(rows: list[dict]) -> list[str]:
    """The paired table: adaptive minus uniform per budget, score and likelihood (the report's statistics)."""
    from fxbudget.harness.grouping import budget_label, logprob_delta, reference_logprobs, sample_id
    from fxbudget.harness.stats import paired_diff

    refs = reference_logprobs(rows)
    out = []
    for ada, uni in PAIRS:
        for b in sorted({budget_label(r) for r in rows if r["rule"] == uni}, key=str):
            a = {sample_id(r): r for r in rows if r["rule"] == ada and budget_label(r) == b}
            u = {sample_id(r): r for r in rows if r["rule"] == uni and budget_label(r) == b}
            both = sorted(set(a) & set(u), key=str)
            if not both:
                continue
            acc = paired_diff([a[s]["score"] for s in both], [u[s]["score"] for s in both])
            lp = [(logprob_delta(a[s], refs), logprob_delta(u[s], refs)) for s in both]
            lp = [x for x in lp if None not in x]
            lk = paired_diff([x[0] for x in lp], [x[1] for x in lp]) if lp else None
            mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
            out.append([f"{ada} - {uni}", b, len(both),
                        f"{mean([a[s] for s in both], 'score'):.3f} vs {mean([u[s] for s in both], 'score'):.3f}",
                        f"{acc.mean:+.3f} [{acc.lo:+.3f}, {acc.hi:+.3f}]", f"{acc.p:.3f}",
                        "-" if lk is None else f"{lk.mean:+.3f} [{lk.lo:+.3f}, {lk.hi:+.3f}]",
                        "-" if lk is None else f"{lk.p:.3f}",
                        sorted({str(a[s].get("layout")) for s in both} | {str(u[s].get("layout")) for s in both})])
    return md_table(["adaptive - uniform", "budget", "paired samples", "mean score (adaptive vs uniform)",
                     "score diff [95% interval]", "p (sign flip)", "log-lik/token diff (nats) [95% interval]",
                     "p (sign flip)", "layouts"], out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=4, help="samples per task (default 4, the demo's)")
    p.add_argument("--run", default=str(ROOT / "runs" / "adakv_accuracy"), help="the compare run's folder")
    p.add_argument("--from-run", default=None, help="run nothing: the report from this earlier run's folder")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adakv_accuracy.md"))
    a = p.parse_args()
    info, command = env_info("cpu"), command_line()
    run = Path(a.from_run or a.run)
    wall = None
    if a.from_run is None:
        args = compare_args(a.samples, str(run))
        load_before, t = load_str(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "fxbudget.cli", *args], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = {"command": "fxbudget " + " ".join(args), "wall_s": round(time.perf_counter() - t, 1),
                "load_before": load_before, "load_after": load_str(), "date": time.strftime("%Y-%m-%d %H:%M")}
        (run / "wall.json").write_text(json.dumps(wall, indent=1))
    elif (run / "wall.json").exists():
        wall = json.loads((run / "wall.json").read_text())
    from fxbudget.harness.report import accuracy_table, likelihood_table, load_rows

    rows = load_rows([run])
    keep = ROOT / "benchmarks" / "results" / "adakv_accuracy"
    keep.mkdir(parents=True, exist_ok=True)
    for name in KEEP + ("wall.json",):
        if (run / name).exists() and (run / name).resolve() != (keep / name).resolve():
            shutil.copy2(run / name, keep / name)
    # The plots (PNG) are not committed: the kept report.md drops their section, so its links all resolve.
    report = keep / "report.md"
    if report.exists():
        text = report.read_text().split("\n## plots\n")[0].rstrip("\n") + "\n"
        report.write_text(text)
    lines = header_lines("AdaKV on the demo's query-aware grid", info, command, load_after=load_str())
    if wall:
        lines += [f"- The grid: `{wall['command']}`, {wall['date']}, {wall['wall_s']} s wall, load average "
                  f"{wall['load_before']} before, {wall['load_after']} after.", ""]
    layouts = sorted({str(r.get("layout")) for r in rows if r["rule"] != "full"})
    prints = sorted({r["kernel_fingerprint"][:16] for r in rows if r.get("kernel_fingerprint")})
    lines += [f"Rows: {len(rows)}; budgeted rows' layouts: {layouts}; kernel fingerprints: {prints} (one = every "
              f"rule ran one kernel). Full report, summary and rows: [adakv_accuracy/](adakv_accuracy/report.md).", "",
              "## Paired: each head-adaptive rule minus its uniform rule, same samples", "",
              "Score: the fraction of expected answers found (0/1 per passkey sample); interval: discordant pairs "
              "(0/1) or the inverted sign-flip test; p: two-sided sign-flip permutation test. Log-likelihood: the "
              "gold answer's mean log-prob per token, each minus the unmodified model's on the same sample.", "",
              *paired_lines(rows), "", "## Accuracy (mean [95% interval] (samples))", "",
              accuracy_table(rows), "", "## Answer log-likelihood per token minus the unmodified model's", "",
              likelihood_table(rows) or "-", *analysis_link("adakv_accuracy")]
    write_md(a.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
