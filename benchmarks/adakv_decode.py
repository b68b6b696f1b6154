"""Decode step with AdaKV (head-pooled layout) against uniform allocation, eager kernel and Inductor, side by side.

    OMP_NUM_THREADS=1 python benchmarks/adakv_decode.py            # -> benchmarks/results/adakv_decode.md
    OMP_NUM_THREADS=1 python benchmarks/adakv_decode.py --quick    # smoke run (small budget, few rounds), printed

One process, the embedded model. Configurations (rule, layout): `snapkv` on the slots layout (uniform allocation,
today's kernel: the baseline), `snapkv` on the head-pool layout (uniform allocation on the pooled kernel: the
layout's own cost) and `adakv:snapkv` (head-adaptive, pooled). Each runs with the eager kernel (`backend=None`) and
with Inductor, in two decode modes: `streaming` (eviction every step: the allocation runs in every call) and
`frozen` (query-agnostic decode: head-room, nothing evicted). Every (configuration, backend, mode) gets its own
cache, a copy of that configuration's one-call prefill of a `--context`-token passkey prompt, so the cache is full
(B entries per KV head on average) when timing starts. Timing: rounds; in each round every series (in a rotated
order) is installed and runs `--inner` decode steps, each timed alone; a series' value for the round is the median
of its steps. Ratios are per round against `snapkv`/slots of the same backend and mode (median and interquartile
range over rounds), so machine drift between rounds cancels. Goal (issue 22): adakv <= 1.15x uniform.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

from benchlib.env import command_line, env_info, header_lines, load_str, setup_threads, tune_malloc
from benchlib.timing import fmt_ratio, paired_ratio, quartiles
from benchlib.output import analysis_link, emit, md_table

CONFIGS = (("snapkv", "slots"), ("snapkv", "head-pool"), ("adakv:snapkv", "head-pool"))
BACKENDS = ("eager", "inductor")
MODES = ("streaming", "frozen")
PARAMS = {"window": 64, "kernel": 5, "pooling": "avg"}
GOAL = 1.15


def _forward(model, rule: str, layout: str, backend: str | None, budget: int, headroom: int):
    import fxbudget

    fxbudget.compile(model, rule=rule, budget=budget, backend=backend, headroom=headroom,
                     head_pool=layout == "head-pool", **PARAMS)
    forward = model.forward
    forward.restore()
    return forward


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens prefilled in one call (default 2048)")
    p.add_argument("--budget", type=int, default=1024, help="B per layer and KV head (default 1024)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--inner", type=int, default=3, help="decode steps per series and round")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--quick", action="store_true", help="context 256, budget 128, 2 rounds, eager only, printed")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.quick:
        a.context, a.budget, a.rounds, a.inner, a.backends = 256, 128, 2, 2, "eager"
    setup_threads(1)
    tune_malloc()
    import torch

    from fxbudget.harness.tasks import chat_ids, passkey
    from fxbudget.models import load_default

    info = env_info("cpu")
    backends, modes = a.backends.split(","), a.modes.split(",")
    model, tok = load_default(progress=False)
    ids = torch.cat(chat_ids(tok, passkey(tok, a.context, seed=0)), dim=1)[:, :a.context]
    steps = 2 + a.rounds * a.inner  # one warm-up (compile) step, one spare
    headroom = -(-(steps + 1) // 64) * 64
    series, caches, forwards, setup_s = {}, {}, {}, {}
    token = None
    with torch.no_grad():
        for rule, layout in CONFIGS:
            eager = _forward(model, rule, layout, None, a.budget, headroom)
            eager.install()
            cache = eager.new_cache(1)
            t = time.perf_counter()
            out = eager(input_ids=ids, past_key_values=cache, logits_to_keep=1)
            eager.restore()
            setup_s[(rule, layout, "prefill")] = time.perf_counter() - t
            token = out.logits[:, -1:].argmax(-1) if token is None else token
            for backend in backends:
                fwd = eager if backend == "eager" else _forward(model, rule, layout, backend, a.budget, headroom)
                for mode in modes:
                    key = (rule, layout, backend, mode)
                    forwards[key], caches[key] = fwd, copy.deepcopy(cache)
                    series[key] = []
        print(f"[{time.strftime('%H:%M:%S')}] prefills done (load {load_str()}): "
              f"{ {k[0] + '/' + k[1]: round(v, 1) for k, v in setup_s.items()} }", flush=True)

        def step(key):
            fwd, cache = forwards[key], caches[key]
            fwd.install()
            try:
                ctx = cache.frozen() if key[3] == "frozen" else _Null()
                with ctx:
                    t = time.perf_counter()
                    fwd(input_ids=token, past_key_values=cache)
                    return time.perf_counter() - t
            finally:
                fwd.restore()

        first = {}
        for key in series:  # the first step of each series compiles its graph (Inductor): timed apart
            first[key] = step(key)
            print(f"  first step {key}: {first[key]:.1f} s", flush=True)
        step_ms = {k: [] for k in series}
        keys = list(series)
        for r in range(a.rounds):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            for key in order:
                ts = []
                fwd, cache = forwards[key], caches[key]
                fwd.install()
                try:
                    for _ in range(a.inner):
                        with cache.frozen() if key[3] == "frozen" else _Null():
                            t = time.perf_counter()
                            fwd(input_ids=token, past_key_values=cache)
                            ts.append(time.perf_counter() - t)
                finally:
                    fwd.restore()
                series[key].append(statistics.median(ts))
                step_ms[key] += [1e3 * x for x in ts]
            print(f"[{time.strftime('%H:%M:%S')}] round {r + 1}/{a.rounds} (load {load_str()})", flush=True)
        counts = {}
        for key, cache in caches.items():  # entries per KV head at the end: adakv spreads them unevenly
            c = torch.stack([cache.head_counts(i)[0] for i in range(len(cache.layers))]) \
                if hasattr(cache, "head_counts") else None
            counts[key] = None if c is None else (int(c.min()), int(c.max()))

    rows = []
    for backend in backends:
        for mode in modes:
            base = series[("snapkv", "slots", backend, mode)]
            for rule, layout in CONFIGS:
                key = (rule, layout, backend, mode)
                q = quartiles(step_ms[key])
                ratio = paired_ratio(series[key], base)
                verdict = "" if key[:2] != ("adakv:snapkv", "head-pool") else \
                    ("met" if ratio[1] <= GOAL else "NOT met")
                rows.append([backend, mode, rule, layout, f"{q[1]:.1f} [{q[0]:.1f}-{q[2]:.1f}]",
                             "1" if layout == "slots" else fmt_ratio(ratio), verdict,
                             f"{first[key]:.1f}", "-" if counts[key] is None else f"{counts[key][0]}-{counts[key][1]}"])
    lines = header_lines("AdaKV decode step vs uniform allocation (embedded model)", info,
                         command_line("OMP_NUM_THREADS=1 "), load_after=load_str())
    lines += [f"Qwen2.5-Coder-0.5B-Instruct (fp32, 24 layers, 2 KV heads); snapkv {PARAMS}, alpha 0.2; budget "
              f"{a.budget}, head-room {headroom}; one-call prefill of a {ids.shape[1]}-token passkey prompt (eager "
              f"kernel), then {a.rounds} rounds x {a.inner} decode steps per series ({__doc__.split('Timing: ')[1].split('Goal')[0].strip()})",
              "", f"Goal (issue 22): adakv:snapkv (head-pool) <= {GOAL}x snapkv (slots), compiled and eager.", "",
              *md_table(["backend", "decode", "rule", "layout", "ms / step, median [IQR]",
                         "vs snapkv slots, per round", "goal", "first step s (compile)",
                         "entries per KV head at the end (min-max)"], rows), *analysis_link("adakv_decode")]
    emit(lines, a.out, a.quick, "adakv_decode")
    return 0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
