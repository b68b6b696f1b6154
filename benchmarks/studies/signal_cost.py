"""The per-call cost of issue 23's kernel signals (`window_max_attn`, `wov_norm`): the kernel with them against the
same kernel with both replaced by zeros (the kernel before them), side by side in one process, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/studies/signal_cost.py             # -> benchmarks/studies/results/signal_cost.md
    OMP_NUM_THREADS=1 python benchmarks/studies/signal_cost.py --quick     # decode only, 20 rounds, printed only
    OMP_NUM_THREADS=1 python benchmarks/studies/signal_cost.py --profile   # torch.profiler of one call each, printed only

fairness_spread's layer (14 query / 2 KV heads, head dim 64, fp32, a full cache: every call evicts, hidden 896 for
W_o), compiled through fxbudget's backend with Inductor, and eager (`budget_attention` called directly). For each
rule, two steps: "new" is today's kernel; "old" runs with the three functions that compute the signals
(`attention.Block.window_max`, `kernel.signals.window_max` for traced calls of several query blocks, `value_out_norms`)
swapped for functions returning zeros of the same shapes, so the kernel is otherwise identical (the signals are still
stored and totalled, as before them). Rounds are interleaved (rotating the starting step); times are medians
[interquartile range] over rounds and the ratio new / old is the median [interquartile range] of the per-round ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: benchlib
from benchlib.env import STUDY_RESULTS, env_info, header_lines, load_str, setup_threads, tune_malloc
from benchlib.timing import fmt_ratio, interleaved, paired_ratio, quartiles
from benchlib.output import emit, md_table
from benchlib.cases import LayerCase

RULES = ("tova", "snapkv", "h2o")  # a pointwise rule, a pooled window rule, the accumulating rule


@contextlib.contextmanager
def without_new_signals():
    """Run (eager) or trace (compiled) the kernel with the two new signals replaced by zeros."""
    import torch

    import fxbudget.kernel.attention as A
    import fxbudget.kernel.measure as M
    import fxbudget.kernel.signals as S

    saved = M.window_max, S.value_out_norms, A.Block.window_max

    def no_window_max(blk, queries, qpos, weights, w):
        b, h = queries.shape[:2]
        return queries.new_zeros(b, h, blk.k_slots.shape[2] + blk.k_new.shape[2])

    def no_block_max(self, es, en, inv, in_window, r0, r1):
        return es.new_zeros(es.shape[:2] + es.shape[-1:]), en.new_zeros(en.shape[:2] + en.shape[-1:])

    def no_wov(v, wo, acc):
        return torch.zeros(v.shape[:3], dtype=acc, device=v.device)

    M.window_max, S.value_out_norms, A.Block.window_max = no_window_max, no_wov, no_block_max
    try:
        yield
    finally:
        M.window_max, S.value_out_norms, A.Block.window_max = saved


def _steps(rule: str, budget: int, n: int, mode: str) -> dict:
    """The old and new step of one rule and call length, compiled (Inductor) or eager."""
    if mode == "inductor":
        with without_new_signals():
            old = LayerCase(rule, budget, n).compiled()
        return {"old": old, "new": LayerCase(rule, budget, n).compiled()}
    eager_old = LayerCase(rule, budget, n).eager()

    def old():
        with without_new_signals():
            return eager_old()

    return {"old": old, "new": LayerCase(rule, budget, n).eager()}


def _profile(budget: int, chunk: int) -> None:
    """torch.profiler of one decode call and one prefill call (snapkv), eager and Inductor, old and new: the ops
    with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    for mode in ("eager", "inductor"):
        for phase, n in (("decode", 1), (f"prefill {chunk}", chunk)):
            steps = _steps("snapkv", budget, n, mode)
            for name, step in steps.items():
                for _ in range(3):
                    step()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step()
                print(f"=== {mode} {phase} {name}")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (0 = decode only)")
    p.add_argument("--reps", type=int, default=100, help="decode rounds (prefill: reps/10, at least 5)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--modes", default="inductor,eager")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    setup_threads(1)
    tune_malloc()
    if a.profile:
        _profile(a.budget, a.chunk or 256)
        return 0
    if a.quick:
        a.chunk, a.reps = 0, 20
    rules, modes = a.rules.split(","), a.modes.split(",")
    info = env_info("cpu")
    phases = [("decode", 1)] + ([(f"prefill {a.chunk}", a.chunk)] if a.chunk else [])
    rows = []
    for mode in modes:
        for phase, n in phases:
            steps = {}
            for rule in rules:
                for k, step in _steps(rule, a.budget, n, mode).items():
                    steps[(rule, k)] = step
                print(f"ready {mode} {rule} {phase}", flush=True)
            t = interleaved(steps, a.reps if n == 1 else max(5, a.reps // 10))
            for rule in rules:
                old, new = (quartiles([1e6 * x for x in t[(rule, k)]]) for k in ("old", "new"))
                rows.append([mode, rule, phase, f"{old[1]:.1f} [{old[0]:.1f}-{old[2]:.1f}]",
                             f"{new[1]:.1f} [{new[0]:.1f}-{new[2]:.1f}]",
                             fmt_ratio(paired_ratio(t[(rule, "new")], t[(rule, "old")])), f"{new[1] - old[1]:.1f}"])
            print(mode, phase, "load", load_str(), flush=True)
    lines = header_lines("Per-call cost of the window-max and W_o-value-norm signals (issue 23)", info,
                         load_after=load_str())
    lines += [f"Budget {a.budget}, 14 query / 2 KV heads, head dim 64, hidden 896, fp32, cache full; Inductor "
              f"(fxbudget's backend) and eager; rounds interleaved. old = the kernel with `window_max_attn` and "
              f"`wov_norm` computed as zeros; new = today's kernel (`window_max_attn` read off the attention blocks' "
              f"softmax, `wov_norm` = ||R v||_2 with W_o's per-head R factors laid out once). Times: median "
              f"[interquartile range] over rounds (us); ratio: median [interquartile range] of the per-round "
              f"new / old. The load average above is the machine's (other jobs shared its cores).", ""]
    lines += md_table(["mode", "rule", "call", "old (us)", "new (us)", "new / old", "new - old (us)"], rows)
    emit(lines, a.out, a.quick, "signal_cost", STUDY_RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
