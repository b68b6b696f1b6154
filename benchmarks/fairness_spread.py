"""Fairness spread: every registered rule through the one compiled kernel, same budget, same inputs, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/fairness_spread.py            # full run (~10 min on 2 CPU cores)
    OMP_NUM_THREADS=1 python benchmarks/fairness_spread.py --quick    # smoke run: budget 256, decode only

Layer level (14 query / 2 KV heads, head dim 64, fp32, RoPE theta 1e6 so rules that read the RoPE frequencies
work), a full BudgetCache so every call evicts; each rule compiled through fxbudget's backend with Inductor. A decode
step and a prefill chunk; all rules are timed round-robin (rotating the starting rule) and medians reported; the
spread is max/min over rules. `full` is skipped: it never evicts (fxbudget refuses a call that would overflow its
budget), so at a budget where the others evict it has no row.
"""

from __future__ import annotations

import argparse
import sys

from _common import (LayerCase, env_info, header_lines, interleaved, load_str, md_table, median_us,
                     setup_threads, tune_malloc, emit)

GOAL = 1.05  # issue 5: max/min latency across rules


def _sorts(rule) -> bool:
    """Whether a rule (or a base class of it) reorders candidates by position (`Signals.order`)."""
    import inspect

    for cls in type(rule).__mro__:
        try:
            if "sequence_order" in inspect.getsource(cls) and cls.__module__.startswith("fxbudget.rules.") \
                    and not cls.__module__.endswith(".base"):
                return True
        except (OSError, TypeError):
            pass
    return False


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

    rules = args.rules.split(",") if args.rules else [r for r in R.available()
                                                       if not getattr(R.get(r), "never_evicts", False)]
    skipped = [r for r in R.available() if getattr(R.get(r), "never_evicts", False)]
    info = env_info(args.device)
    phases = [("decode", 1)] + ([(f"prefill {args.chunk}", args.chunk)] if args.chunk else [])
    results, compile_s = {}, {}
    for phase, n in phases:
        steps = {}
        for rule in rules:
            case = LayerCase(rule, args.budget, n, device=args.device,
                             cudagraphs=args.cudagraphs and n == 1)
            steps[rule] = case.compiled()
            compile_s[(rule, phase)] = case.compile_s["budget"]
            print(f"compiled {rule} {phase}: {compile_s[(rule, phase)]:.1f} s", flush=True)
        r = args.reps if n == 1 else max(5, args.reps // 10)
        t = interleaved(steps, r, device=args.device)
        results[phase] = {k: median_us(v) for k, v in t.items()}
        print(phase, {k: round(v, 1) for k, v in results[phase].items()}, "load", load_str(), flush=True)

    lines = header_lines("Fairness spread: every rule through the same compiled kernel", info, load_after=load_str())
    lines += [f"Budget {args.budget}, 14 query / 2 KV heads, head dim 64, fp32, cache full (every call evicts); "
              f"Inductor; median of interleaved rounds. `{'`, `'.join(skipped)}` skipped: it never evicts.", ""]
    heads = ["rule"] + [f"{ph} (us)" for ph, _ in phases] + [f"{ph} / fastest" for ph, _ in phases]
    best = {ph: min(results[ph].values()) for ph, _ in phases}
    rows = [[rule] + [results[ph][rule] for ph, _ in phases] + [f"{results[ph][rule] / best[ph]:.3f}"
                                                               for ph, _ in phases] for rule in rules]
    lines += md_table(heads, rows)
    lines += [""]
    spreads = {}
    for ph, _ in phases:
        v = results[ph]
        hi, lo = max(v, key=v.get), min(v, key=v.get)
        spreads[ph] = v[hi] / v[lo]
        lines.append(f"- {ph}: max/min = **{spreads[ph]:.3f}** (slowest {hi}, fastest {lo}); goal <= {GOAL}: "
                     f"**{'met' if spreads[ph] <= GOAL else 'NOT met'}**")
    # Rules whose score does more than pointwise work on the kernel's per-candidate signals, and what that is.
    extra = {"keydiff": "reads every cached key (mean key and a cosine per candidate: two passes over the K cache)",
             "expected_attention": "per query head, a RoPE-averaged mean query dotted with every key, a rank-n "
                                   "covariance term and a softmax over the candidates: O(C x group x head_dim)"}
    extra.update({r: "pools scores over neighbouring positions, so it first sorts the candidates by position "
                     "(`Signals.order`: an argsort of B + n positions, a gather and a scatter; ATen calls that "
                     "Inductor does not fuse)" for r in rules if _sorts(R.get(r))})
    pointwise = [r for r in rules if r not in extra]
    for ph, _ in phases:
        if len(pointwise) > 1:
            v = {r: results[ph][r] for r in pointwise}
            ratio = max(v.values()) / min(v.values())
            lines.append(f"- {ph}, rules whose score is pointwise in the signals ({', '.join(pointwise)}): "
                         f"max/min = **{ratio:.3f}** ({'met' if ratio <= GOAL else 'NOT met'})")
    lines += ["", "## What this shows", "",
              "Every rule runs the same compiled kernel (attention, every signal, top-k eviction, write-back; "
              "`kernel_fingerprint` is equal across rules, tested); only the rule's scoring ops differ, so the "
              "spread is what the rules' own scores cost. Rules that score pointwise from the signals fuse into the "
              "kernel's loops and cost the same to within the line above. The others do more work by definition:", ""]
    lines += [f"- `{r}`: {why} ({' / '.join(f'{results[ph][r] / best[ph]:.2f}x' for ph, _ in phases)})."
              for r, why in extra.items() if r in rules]
    lines += ["", "That work belongs to the rule's formula, not to the kernel, so it was not hidden by moving it into "
              "the kernel (which would make every rule pay for it). The process uses `tune_malloc()` (glibc keeps "
              "freed pages): with default malloc the prefill chunk's temporaries are mmap'ed and unmapped on every "
              "call, and the page-fault cost depended on allocation order, not on the rule: the same three rules "
              "(`window`, `streamingllm`, `knorm`, identical work) took 26-29 ms in one order and 30-45 ms in another; "
              "with the tuning all three took 23.5 ms. Decode times grow with the number of rules in one run (each rule's "
              "cache competes for the CPU caches); the ratios are measured in one interleaved run."]
    emit(lines, args.out, args.quick, "fairness_spread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
