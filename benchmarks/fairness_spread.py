"""Fairness spread: every registered rule through the one compiled kernel, same budget, same inputs, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/fairness_spread.py            # full run (~10 min on 2 CPU cores)
    OMP_NUM_THREADS=1 python benchmarks/fairness_spread.py --quick    # smoke run: budget 256, decode only

Layer level (14 query / 2 KV heads, head dim 64, fp32, RoPE theta 1e6 so rules that read the RoPE frequencies
work), a full BudgetCache so every call evicts; each rule compiled through fxbudget's backend with Inductor. A decode
step and a prefill chunk; all rules are timed round-robin (rotating the starting rule); times are reported as median
and interquartile range, ratios as the quartiles of the per-round ratio, and a ratio whose range holds 1.0 is called
"within noise". The report holds only what this run measured; the analysis is hand-written beside it
(`results/fairness_spread.analysis.md`). `full` is skipped: it never evicts (fxbudget refuses a call that would overflow its
budget), so at a budget where the others evict it has no row.
"""

from __future__ import annotations

import argparse
import sys

from benchlib.env import env_info, header_lines, load_str, setup_threads, tune_malloc
from benchlib.timing import fmt_ratio, interleaved, median_us, paired_ratio, quartiles, verdict
from benchlib.output import analysis_link, emit, md_table
from benchlib.cases import LayerCase

GOAL = 1.05  # issue 5: max/min latency across rules


def _pointwise(rule) -> bool:
    """Whether a rule's score reads only per-candidate signals, with no sort, keys or queries (its own code says so:
    the rule class, or a base class of it in fxbudget.rules, uses none of them)."""
    import inspect

    for cls in type(rule).__mro__:
        if not cls.__module__.startswith("fxbudget.rules.") or cls.__module__.endswith(".base"):
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            return False
        if any(word in source for word in ("sequence_order", "s.keys", "s.queries", "s.k_slots", "s.k_new")):
            return False
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=1024, help="budget for every rule (default 1024)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size (default 256; 0 = decode only)")
    p.add_argument("--rules", default=None, help="comma-separated rules (default: all registered but full)")
    p.add_argument("--reps", type=int, default=100, help="interleaved decode rounds (prefill: reps/10, at least 5)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--cudagraphs", action="store_true", help="CUDA only: wrap the compiled graphs in CUDA graphs")
    p.add_argument("--quick", action="store_true", help="smoke run: budget 256, decode only, 20 reps")
    p.add_argument("--out", default=None, help="markdown output (default benchmarks/results/fairness_spread.md; "
                                               "--quick writes nothing unless given)")
    args = p.parse_args()
    setup_threads(1)
    tune_malloc()
    if args.quick:
        args.budget, args.chunk, args.reps = 256, 0, 20
    import fxbudget.rules as R

    # kvzip (replay_only) scores one replay call at a window of its own, not a decode step or a prefill chunk.
    skip = {}
    for r in R.available():
        if getattr(R.get(r), "never_evicts", False):
            skip[r] = "it never evicts"
        elif R.get(r).replay_only:
            skip[r] = "it evicts only in its replay protocol"
    rules = args.rules.split(",") if args.rules else [r for r in R.available() if r not in skip]
    skipped = "; ".join(f"`{r}` skipped: {why}" for r, why in skip.items())
    info = env_info(args.device)
    phases = [("decode", 1)] + ([(f"prefill {args.chunk}", args.chunk)] if args.chunk else [])
    times, compile_s = {}, {}
    for phase, n in phases:
        steps = {}
        for rule in rules:
            case = LayerCase(rule, args.budget, n, device=args.device,
                             cudagraphs=args.cudagraphs and n == 1)
            steps[rule] = case.compiled()
            compile_s[(rule, phase)] = case.compile_s["budget"]
            print(f"compiled {rule} {phase}: {compile_s[(rule, phase)]:.1f} s", flush=True)
        r = args.reps if n == 1 else max(5, args.reps // 10)
        times[phase] = interleaved(steps, r, device=args.device)  # seconds per round, rounds aligned across rules
        print(phase, {k: round(median_us(v), 1) for k, v in times[phase].items()}, "load", load_str(), flush=True)

    lines = header_lines("Fairness spread: every rule through the same compiled kernel", info, load_after=load_str())
    lines += [f"Budget {args.budget}, 14 query / 2 KV heads, head dim 64, fp32, cache full (every call evicts); "
              f"Inductor; {', '.join(f'{ph}: {len(times[ph][rules[0]])} interleaved rounds' for ph, _ in phases)}. "
              f"Times: median [interquartile range] over rounds. Ratios: median [interquartile range] of the per-round "
              f"ratio to the fastest rule (paired rounds, so drift between rounds cancels); a ratio whose range holds "
              f"1.0 is **within noise**. {skipped}.", ""]
    quart = {ph: {rule: quartiles([1e6 * x for x in t]) for rule, t in times[ph].items()} for ph, _ in phases}
    fastest = {ph: min(quart[ph], key=lambda rule: quart[ph][rule][1]) for ph, _ in phases}
    ratio = {ph: {rule: paired_ratio(times[ph][rule], times[ph][fastest[ph]]) for rule in rules} for ph, _ in phases}
    heads = ["rule"] + [f"{ph} (us)" for ph, _ in phases] + [f"{ph} / fastest" for ph, _ in phases]
    rows = [[rule] + [f"{quart[ph][rule][1]:.1f} [{quart[ph][rule][0]:.1f}-{quart[ph][rule][2]:.1f}]"
                      for ph, _ in phases]
            + [fmt_ratio(ratio[ph][rule]) for ph, _ in phases] for rule in rules]
    lines += md_table(heads, rows)
    lines += [""]
    pointwise = [r for r in rules if _pointwise(R.get(r))]
    for ph, _ in phases:
        slowest = max(rules, key=lambda rule: ratio[ph][rule][1])
        lines.append(f"- {ph}: slowest/fastest = **{fmt_ratio(ratio[ph][slowest])}** (slowest {slowest}, fastest "
                     f"{fastest[ph]}); goal <= {GOAL}: **{verdict(ratio[ph][slowest], GOAL)}**")
        if len(pointwise) > 1:  # the same spread among rules whose score is pointwise in the signals
            lo = min(pointwise, key=lambda rule: quart[ph][rule][1])
            hi = max(pointwise, key=lambda rule: quart[ph][rule][1])
            pr = paired_ratio(times[ph][hi], times[ph][lo])
            lines.append(f"- {ph}, rules whose score is pointwise in the signals ({', '.join(pointwise)}): "
                         f"slowest/fastest = **{fmt_ratio(pr)}** ({hi} / {lo}): **{verdict(pr, GOAL)}**")
    lines += [f"- compile (s): " + ", ".join(f"{rule} {ph} {compile_s[(rule, ph)]:.1f}" for ph, _ in phases
                                             for rule in rules)]
    lines += analysis_link("fairness_spread")
    emit(lines, args.out, args.quick, "fairness_spread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
