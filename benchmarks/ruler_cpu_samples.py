"""How many paired samples would separate the best from the worst rule of the CPU RULER table
(benchmarks/results/ruler_cpu), by the report's paired test: a projection from the committed rows, not a measurement.

For each budget and metric (accuracy; answer log-likelihood per token), the best and worst rule by mean over all
tasks, their per-sample differences `d` (the report's pairing). For n samples, `DRAWS` seeded resamples of n values
of `d` (with replacement) are tested with the report's two-sided sign-flip test (`fxbudget.harness.stats`), the p
multiplied by the 4 comparisons with the top rule (an upper bound of the report's Holm-adjusted p). The table gives
the fraction of resamples separated at 0.05 per n, and the smallest n reaching 80%. It assumes that new samples
look like the committed ones (same task mix, same effect): a rough guide to the next run's size.

    python benchmarks/ruler_cpu_samples.py [--results DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from fxbudget.harness.stats import sign_flip_pvalue

SIZES = (12, 24, 48, 72, 96, 144, 192)
DRAWS = 200
COMPARISONS = 4  # five rules: the top against each of the other four
SEED = 0


def per_sample(rows):
    """{(budget, metric): {rule: {sample key: value}}} of the budgeted rows."""
    out = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["rule"] == "full":
            continue
        key = (r["task"], r["length"], r["sample"])
        out[(r["budget_fraction"], "accuracy")][r["rule"]][key] = r["score"]
        out[(r["budget_fraction"], "likelihood")][r["rule"]][key] = r["answer_logprob_mean"]
    return out


def projection(rows, comparisons: int = COMPARISONS, sizes=SIZES, draws: int = DRAWS, seed: int = SEED) -> list[dict]:
    """Per (budget, metric) of the budgeted `rows`: the best and worst rule by mean over their common samples, the
    samples now, the mean difference and its p x `comparisons` now, the fraction of `draws` resamples of each size
    in `sizes` separated (p x `comparisons` < 0.05), and `need`: the smallest size reaching 80% (None beyond)."""
    rng = np.random.default_rng(seed)
    out = []
    for (frac, metric), by_rule in sorted(per_sample(rows).items()):
        common = set.intersection(*(set(v) for v in by_rule.values()))
        keys = sorted(common)
        if len(by_rule) < 2 or not keys:
            continue
        means = {rule: float(np.mean([v[k] for k in keys])) for rule, v in by_rule.items()}
        best, worst = max(means, key=means.get), min(means, key=means.get)
        d = np.array([by_rule[best][k] - by_rule[worst][k] for k in keys])
        now = min(1.0, comparisons * sign_flip_pvalue(d))
        fractions = []
        for n in sizes:
            hits = sum(min(1.0, comparisons * sign_flip_pvalue(rng.choice(d, size=n), n_perm=2000)) < 0.05
                       for _ in range(draws))
            fractions.append(hits / draws)
        need = next((n for n, f in zip(sizes, fractions) if f >= 0.8), None)
        out.append({"budget": frac, "metric": metric, "best": best, "worst": worst, "n_now": len(keys),
                    "mean_d": float(d.mean()), "p_now": now, "fractions": fractions, "need": need})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results/ruler_cpu")
    ap.add_argument("--out", default="benchmarks/results/ruler_cpu_samples.md")
    args = ap.parse_args()
    rows = [json.loads(line) for line in (Path(args.results) / "results.jsonl").read_text().splitlines() if line]
    lines = ["# Samples to separate the best from the worst rule (projection)", "",
             f"`python benchmarks/ruler_cpu_samples.py` on {args.results}/results.jsonl ({len(rows)} rows); "
             f"{DRAWS} resamples per size, seed {SEED}; separated = sign-flip p x {COMPARISONS} < 0.05. A "
             "projection from the committed samples (their task mix and effects), not a measurement.", "",
             "| budget | metric | best | worst | n now | mean d now | p x 4 now | "
             + " | ".join(f"n={n}" for n in SIZES) + " | n for 80% |",
             "|---" * (8 + len(SIZES)) + "|"]
    for p in projection(rows):
        need = str(p["need"]) if p["need"] is not None else f"> {SIZES[-1]}"
        lines.append(f"| {p['budget']:.0%} | {p['metric']} | {p['best']} | {p['worst']} | {p['n_now']} | "
                     f"{p['mean_d']:+.3f} | {p['p_now']:.3f} | " + " | ".join(f"{f:.2f}" for f in p["fractions"])
                     + f" | {need} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
