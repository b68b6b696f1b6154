"""The per-call cost of issue 23's kernel signals (`window_max_attn`, `wov_norm`): the kernel with them against the
same kernel with both replaced by zeros (the kernel before them), side by side in one process, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/signal_cost.py           # -> benchmarks/results/signal_cost.md
    OMP_NUM_THREADS=1 python benchmarks/signal_cost.py --quick   # decode only, 20 rounds, printed only

fairness_spread's layer (14 query / 2 KV heads, head dim 64, fp32, a full cache: every call evicts, hidden 896 for
W_o), compiled through fxbudget's backend with Inductor. For each rule, two compiled steps: "new" is today's kernel;
"old" is traced with `window_max` and `value_out_norms` (`fxbudget.kernel_signals`) swapped for functions returning
zeros of the same shapes, so the kernel is otherwise identical (the signals are still stored and totalled, as before
them). Rounds are interleaved (rotating the starting step); times are medians [interquartile range] over rounds and
the ratio new / old is the median [interquartile range] of the per-round ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from _common import (LayerCase, emit, env_info, fmt_ratio, header_lines, interleaved, load_str, md_table,
                     paired_ratio, quartiles, setup_threads, tune_malloc)

RULES = ("tova", "snapkv", "h2o")  # a pointwise rule, a pooled window rule, the accumulating rule


@contextlib.contextmanager
def without_new_signals():
    """Trace the kernel with the two new signals replaced by zeros (what the kernel computed before them)."""
    import torch

    import fxbudget.kernel as K

    saved = K.window_max, K.value_out_norms

    def no_window_max(blk, queries, qpos, weights, w, R, slots):
        b, h = queries.shape[:2]
        return queries.new_zeros(b, h, slots + blk.k_new.shape[2])

    def no_wov(v, wo, group, acc, traced=False, block=None):
        return torch.zeros(v.shape[:3], dtype=acc, device=v.device)

    K.window_max, K.value_out_norms = no_window_max, no_wov
    try:
        yield
    finally:
        K.window_max, K.value_out_norms = saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (0 = decode only)")
    p.add_argument("--reps", type=int, default=100, help="decode rounds (prefill: reps/10, at least 5)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    setup_threads(1)
    tune_malloc()
    if a.quick:
        a.chunk, a.reps = 0, 20
    rules = a.rules.split(",")
    info = env_info("cpu")
    phases = [("decode", 1)] + ([(f"prefill {a.chunk}", a.chunk)] if a.chunk else [])
    rows = []
    for phase, n in phases:
        steps = {}
        for rule in rules:
            with without_new_signals():
                steps[(rule, "old")] = LayerCase(rule, a.budget, n).compiled()
            steps[(rule, "new")] = LayerCase(rule, a.budget, n).compiled()
            print(f"compiled {rule} {phase}", flush=True)
        t = interleaved(steps, a.reps if n == 1 else max(5, a.reps // 10))
        for rule in rules:
            old, new = (quartiles([1e6 * x for x in t[(rule, k)]]) for k in ("old", "new"))
            rows.append([rule, phase, f"{old[1]:.1f} [{old[0]:.1f}-{old[2]:.1f}]",
                         f"{new[1]:.1f} [{new[0]:.1f}-{new[2]:.1f}]",
                         fmt_ratio(paired_ratio(t[(rule, "new")], t[(rule, "old")])), f"{new[1] - old[1]:.1f}"])
        print(phase, "load", load_str(), flush=True)
    lines = header_lines("Per-call cost of the window-max and W_o-value-norm signals (issue 23)", info,
                         load_after=load_str())
    lines += [f"Budget {a.budget}, 14 query / 2 KV heads, head dim 64, hidden 896, fp32, cache full; Inductor; "
              f"rounds interleaved. old = the kernel with `window_max_attn` and `wov_norm` computed as zeros; "
              f"new = today's kernel. Times: median [interquartile range] over rounds (us); ratio: median "
              f"[interquartile range] of the per-round new / old.", ""]
    lines += md_table(["rule", "call", "old (us)", "new (us)", "new / old", "new - old (us)"], rows)
    emit(lines, a.out, a.quick, "signal_cost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
