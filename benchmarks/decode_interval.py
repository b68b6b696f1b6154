"""Model-level decode step of every rule at decode interval 1 and 64 (issue 43 item 3), side by side, with the spread
across rules: what evicting every k-th step (kvpress DecodingPress's `compression_interval`) amortizes.

    OMP_NUM_THREADS=1 python benchmarks/decode_interval.py             # -> benchmarks/results/decode_interval.md
    OMP_NUM_THREADS=1 python benchmarks/decode_interval.py --smoke     # 2 rules, 2 steps, eager, printed: runs?

The embedded model (fp32). One one-call prefill of a `--context`-token passkey prompt on the eager kernel, branched
(`harness.branch`, bit-identical to a rule's own prefill) into one cache per rule and interval
(`new_cache(interval=k)`: budget + k - 1 slots), evicted down to the budget; then the rule's forward compiled with
`--backend` (Inductor by default) decodes. The steps between evictions run the
rule-free frozen runner, one per observation window, shared by every rule (`BudgetForward.share_frozen`), as
`fxbudget compare` runs them; the evicting steps run the rule's own decode graph. Timing: one untimed warm-up round
(the compiles), then `--rounds` rounds; in each round every (rule, interval) series, in a rotated order, restores its
post-prefill cache (`BudgetCache.restore`: the step count restarts, so the k-th step of the window evicts) and runs
`--steps` decode steps back to back (a multiple of every interval: each window holds steps / k evictions); its value
for the round is the mean step (the window's time / steps). Ratios are per round, so drift between rounds cancels:
interval 1 / interval k per rule, and per interval the slowest rule / the fastest (of that round's values).

Nothing here is a result until run on a quiet machine (2 shared cores are not one); the report holds only what its run
measured.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from benchlib.env import command_line, env_info, header_lines, load_str, setup_threads, tune_malloc
from benchlib.timing import fmt_ratio, quartiles
from benchlib.output import emit, md_table


def _rules(names: str | None) -> tuple[list[str], str]:
    """The rules timed (default: every registered rule that evicts during plain generation) and the skipped ones'
    line."""
    import fxbudget.rules as R

    skip = {}
    for r in R.available():
        rule = R.get(r)
        if getattr(rule, "never_evicts", False):
            skip[r] = "it never evicts"
        elif rule.replay_only:
            skip[r] = "it evicts only in its replay protocol"
    if names:
        return names.split(","), ""
    return [r for r in R.available() if r not in skip], "; ".join(f"`{r}` skipped: {why}" for r, why in skip.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens prefilled in one call (default 2048)")
    p.add_argument("--budget", type=int, default=256, help="B per layer and KV head (default 256)")
    p.add_argument("--intervals", default="1,64", help="decode intervals side by side (default 1,64)")
    p.add_argument("--steps", type=int, default=None, help="decode steps per series and round (default: the least "
                   "common multiple of the intervals)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--rules", default=None, help="comma-separated (default: every rule that evicts in generation)")
    p.add_argument("--backend", default=None, choices=["inductor", "aot_eager", "none"],
                   help="decode backend (default inductor; 'none': the eager kernel)")
    p.add_argument("--smoke", action="store_true", help="does it run: h2o and snapkv, context 128, budget 32, "
                   "intervals 1,64, 2 steps (no eviction at 64), 1 round, eager unless --backend; printed, never a "
                   "result")
    p.add_argument("--out", default=None, help="markdown output (default benchmarks/results/decode_interval.md; "
                   "--smoke writes nothing unless given)")
    a = p.parse_args()
    if a.smoke:
        a.context, a.budget, a.steps, a.rounds = 128, 32, 2, 1
        a.backend, a.rules = a.backend or "none", a.rules or "h2o,snapkv"
    a.backend = a.backend or "inductor"
    intervals = [int(k) for k in a.intervals.split(",")]
    steps = a.steps or math.lcm(*intervals)
    if not a.smoke and any(steps % k for k in intervals):
        p.error(f"--steps {steps} must be a multiple of every interval ({a.intervals}): each window must hold whole "
                "intervals")
    setup_threads(1)
    tune_malloc()
    import torch

    import fxbudget
    from fxbudget.compiler.backend import kernel_window
    from fxbudget.harness.branch import branch, shared_prefill
    from fxbudget.harness.tasks import chat_ids, passkey
    from fxbudget.models import load_default
    from fxbudget.rules import get

    info = env_info("cpu")
    rules, skipped = _rules(a.rules)
    backend = None if a.backend == "none" else a.backend
    model, tok = load_default(progress=False)
    ids = torch.cat(chat_ids(tok, passkey(tok, a.context, seed=0)), dim=1)[:, :a.context]
    forwards, caches, snaps, frozen, first = {}, {}, {}, {}, {}
    with torch.no_grad():
        shared = shared_prefill(model, ids)  # one eager prefill, branched into every cache (bit-identical to its own)
        token = shared.logits.argmax(-1, keepdim=True)  # [1, 1]: the first decoded token, fed every step
        for rule in rules:
            fxbudget.compile(model, rule=rule, budget=a.budget, backend=backend)
            forwards[rule] = model.forward
            forwards[rule].restore()
            if backend is not None:
                window = kernel_window(get(rule))
                if window not in frozen:
                    frozen[window] = fxbudget.frozen_runner(model, backend, window)
                forwards[rule].share_frozen(frozen[window])
            for k in intervals:
                cache = forwards[rule].new_cache(1, interval=k)
                branch(shared, cache, rule)
                caches[(rule, k)], snaps[(rule, k)] = cache, cache.snapshot()
        del shared
        print(f"[{time.strftime('%H:%M:%S')}] prefill branched into {len(caches)} caches (load {load_str()})",
              flush=True)

        def window_s(key) -> float:
            """`steps` decode steps of one series from its post-prefill cache; seconds per step."""
            rule, k = key
            fwd, cache = forwards[rule], caches[key]
            cache.restore(snaps[key])
            fwd.install()
            try:
                t = time.perf_counter()
                for _ in range(steps):
                    fwd(input_ids=token, past_key_values=cache, logits_to_keep=1)
                return (time.perf_counter() - t) / steps
            finally:
                fwd.restore()

        keys = [(rule, k) for rule in rules for k in intervals]
        for key in keys:  # the warm-up round: the compiles (rule decode graph, shared frozen runner's)
            t = time.perf_counter()
            window_s(key)
            first[key] = time.perf_counter() - t
            print(f"  warm-up {key}: {first[key]:.1f} s", flush=True)
        series = {key: [] for key in keys}
        for r in range(a.rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                series[key].append(window_s(key))
            print(f"[{time.strftime('%H:%M:%S')}] round {r + 1}/{a.rounds} (load {load_str()})", flush=True)

    ms = {key: quartiles([1e3 * x for x in v]) for key, v in series.items()}
    heads = ["rule"] + [f"interval {k}: ms / step" for k in intervals] + \
        [f"interval {intervals[0]} / interval {k}" for k in intervals[1:]]
    rows = []
    for rule in rules:
        rows.append([rule] + [f"{ms[(rule, k)][1]:.1f} [{ms[(rule, k)][0]:.1f}-{ms[(rule, k)][2]:.1f}]"
                              for k in intervals]
                    + [fmt_ratio(quartiles([x / y for x, y in zip(series[(rule, intervals[0])], series[(rule, k)])]))
                       for k in intervals[1:]])
    spread = []
    for k in intervals:  # per round: the slowest rule's mean step over the fastest's
        per_round = [max(series[(rule, k)][r] for rule in rules) / min(series[(rule, k)][r] for rule in rules)
                     for r in range(a.rounds)]
        slow = max(rules, key=lambda rule: ms[(rule, k)][1])
        fast = min(rules, key=lambda rule: ms[(rule, k)][1])
        spread.append(f"- interval {k}: slowest / fastest rule, per round = **{fmt_ratio(quartiles(per_round))}** "
                      f"(by median: slowest {slow} {ms[(slow, k)][1]:.1f} ms, fastest {fast} {ms[(fast, k)][1]:.1f} "
                      f"ms); the cache holds budget + {k - 1} slots, {steps // k} eviction(s) per {steps}-step window")
    lines = header_lines("Decode step at interval " + " vs ".join(map(str, intervals)) + " (embedded model)", info,
                         command_line("OMP_NUM_THREADS=1 "), load_after=load_str())
    lines += [f"Qwen2.5-Coder-0.5B-Instruct (fp32); budget {a.budget}; one-call prefill of a {ids.shape[1]}-token "
              f"passkey prompt (eager kernel, branched per rule); decode backend {a.backend}; {a.rounds} timed rounds "
              f"x {steps} steps per series after one warm-up round. Cells: mean ms per decode step, median [interquartile range] over "
              f"rounds; ratios: median [interquartile range] of the per-round ratio. "
              + (f"{skipped}." if skipped else ""), "",
              *md_table(heads, rows), "", *spread,
              "- warm-up round (s, compiles included): " + ", ".join(f"{r} @{k} {first[(r, k)]:.1f}"
                                                                     for r, k in keys)]
    if a.smoke:
        lines += ["", f"**Smoke run** ({steps} steps: at interval {max(intervals)} no step evicted): proves the script "
                  "runs, measures nothing."]
    emit(lines, a.out, a.smoke, "decode_interval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
