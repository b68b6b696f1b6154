"""Overhead of budget attention: compiled budget kernel vs compiled plain SDPA over a static cache of the same size.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py            # full run (~5 min on 2 CPU cores)
    OMP_NUM_THREADS=1 python benchmarks/overhead.py --quick    # smoke run: budget 256, decode only

Layer level (14 query / 2 KV heads, head dim 64, fp32). Budget attention: a full BudgetCache layer compiled through
fxbudget's backend (SDPA pass + Inductor, snapkv): exact attention over the B slots and the n new tokens, the signals,
the rule, top-k eviction and the write-back. The ideal that never evicts: `index_copy_` of the call's K/V into a
static cache, then `F.scaled_dot_product_attention` (causal among the new tokens), compiled with Inductor, over
(a) B tokens ("the same number of tokens"), and for prefill chunks also (b) B + n tokens, which is the same attention
work as the budget kernel (it attends over its B slots plus the n new tokens before evicting n).
`--json` saves the numbers; `--before FILE` adds the saved numbers of an earlier kernel as a before/after column.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchlib.env import env_info, header_lines, load_str, setup_threads, tune_malloc
from benchlib.timing import fmt_ratio, interleaved, median_us, paired_ratio, quartiles, verdict
from benchlib.output import analysis_link, emit, md_table
from benchlib.cases import LayerCase

GOAL = 1.10  # issue 5: budget attention / static-cache SDPA


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="256,1024,4096", help="budgets (default 256,1024,4096)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size (default 256; 0 = decode only)")
    p.add_argument("--rule", default="snapkv", help="rule of the budget kernel (default snapkv)")
    p.add_argument("--reps", type=int, default=200, help="interleaved decode rounds (prefill: reps/20, at least 5)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--cudagraphs", action="store_true", help="CUDA only: CUDA graphs for decode (both sides)")
    p.add_argument("--quick", action="store_true", help="smoke run: budget 256, decode only, 30 reps")
    p.add_argument("--json", default=None, help="also save the rows as JSON here")
    p.add_argument("--before", default=None, help="JSON saved by an earlier run (e.g. the previous kernel)")
    p.add_argument("--before-label", default="before", help="column label for --before")
    p.add_argument("--out", default=None, help="markdown output (default benchmarks/results/overhead.md; "
                                               "--quick writes nothing unless given)")
    args = p.parse_args()
    setup_threads(1)
    tune_malloc()
    if args.quick:
        args.budgets, args.chunk, args.reps = "256", 0, 30
    info = env_info(args.device)
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        for phase, n in [("decode", 1)] + ([(f"prefill {args.chunk}", args.chunk)] if args.chunk else []):
            case = LayerCase(args.rule, budget, n, device=args.device, cudagraphs=args.cudagraphs and n == 1)
            steps = {"budget_attn": case.compiled(), "static_B": case.static_sdpa()}
            if n > 1:
                steps["static_B+n"] = case.static_sdpa(budget + n)
            r = args.reps if n == 1 else max(5, args.reps // 20)
            t = interleaved(steps, r, device=args.device)
            row = {"budget": budget, "phase": phase, "reps": r, **{k: median_us(v) for k, v in t.items()},
                   "iqr_us": {k: [1e6 * quartiles(v)[0], 1e6 * quartiles(v)[2]] for k, v in t.items()},
                   "compile_budget_s": case.compile_s["budget"]}
            row["ratio_B"] = row["budget_attn"] / row["static_B"]
            row["ratio_B_q"] = paired_ratio(t["budget_attn"], t["static_B"])  # per-round ratio quartiles
            if n > 1:
                row["ratio_Bn"] = row["budget_attn"] / row["static_B+n"]
                row["ratio_Bn_q"] = paired_ratio(t["budget_attn"], t["static_B+n"])
            print(row, "load", load_str(), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    before = {}
    if args.before:
        with open(args.before) as f:
            before = {(r["budget"], r["phase"]): r for r in json.load(f)}

    lines = header_lines("Overhead: compiled budget attention vs compiled plain SDPA over a static cache", info,
                         load_after=load_str())
    lines += [f"{args.rule}; 14 query / 2 KV heads, head dim 64, fp32; cache full, so every budget-attention call "
              "evicts; both sides compiled with Inductor; times: median [interquartile range] of interleaved rounds; ratios: median "
              "[interquartile range] of the per-round ratio.", ""]
    heads = ["budget", "call", "budget attention (us)", "static SDPA, B tokens (us)", "ratio vs B",
             "static SDPA, B+n tokens (us)", "ratio vs B+n"]
    if before:
        heads += [f"{args.before_label}: ratio vs B", f"{args.before_label}: budget attention (us)"]
    table = []

    def us(r, k):  # median [interquartile range]
        return f"{r[k]:.1f} [{r['iqr_us'][k][0]:.1f}-{r['iqr_us'][k][1]:.1f}]"

    for r in rows:
        row = [r["budget"], r["phase"], us(r, "budget_attn"), us(r, "static_B"), fmt_ratio(r["ratio_B_q"]),
               us(r, "static_B+n") if "static_B+n" in r else "-",
               fmt_ratio(r["ratio_Bn_q"]) if "ratio_Bn" in r else "-"]
        if before:
            b = before.get((r["budget"], r["phase"]))
            row += [f"{b['ratio_B']:.2f}", b["budget_attn"]] if b else ["-", "-"]
        table.append(row)
    lines += md_table(heads, table)
    dec = [r for r in rows if r["phase"] == "decode"]
    pre = [r for r in rows if r["phase"] != "decode"]
    lines += ["", f"Goal (issue 5): ratio vs B <= {GOAL} (per row: within noise when the ratio's interquartile "
              "range holds 1.0): " + "; ".join(f"B={r['budget']} {r['phase']} **{verdict(r['ratio_B_q'], GOAL)}**"
                                                 for r in rows) + "."]
    lines += analysis_link("overhead")
    emit(lines, args.out, args.quick, "overhead")
    return 0


if __name__ == "__main__":
    sys.exit(main())
