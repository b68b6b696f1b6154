"""transformers' QuantizedCache against fxbudget's slots at the same bytes (issue 58, item 5).

    OMP_NUM_THREADS=1 python benchmarks/quantized_cache.py            # the anchors, then fxbudget at their bytes
    python benchmarks/quantized_cache.py --report-only                # rewrite the report from the committed rows

**The anchor.** `transformers.QuantizedCache` keeps every token: its integer backend (`quanto`, optimum-quanto,
KIVI-style: per-channel groups of `q_group_size`, a float residual window of up to `residual_length` recent tokens
re-quantized when it fills) at 4 and 2 bits, and its `fp8` backend (e4m3, one scale per layer tensor) where the
installed transformers has it. Each runs the equal-bytes grid's samples (`equal_bytes.TASKS` at `equal_bytes.LENGTH`,
sample `i` of each task as round `i + 1` of the grid builds it), query-agnostic as the grid is: the context in one
call, the question in a second, then the answer's teacher-forced log-likelihood (`fxbudget.harness.likelihood`,
on a copy of the cache) and greedy decoding, scored as `compare` scores. Held bytes: every tensor the cache holds
after the prompt (codes, scales, zero-points, the residual), summed over the layers.

**At the same bytes.** Each anchor's median held bytes become a byte budget of `fxbudget compare` (`--budgets`, one
per anchor) with `int4` and `bfloat16` slots and `RULES`, on the same samples (rounds as the grid runs them): one
kernel spending the anchor's memory on fewer tokens, chosen by a rule. The report pairs each fxbudget cell with the
anchor whose bytes it spends (paired sign-flip test on answer log-likelihood per token; accuracy beside it) and gives
time per decoded token of each (eager kernel; the anchor dequantizes its whole cache every step).

Not done: kvpress composes its presses with `QuantizedCache` in its own venv (transformers 5.2, `benchmarks/peers`);
that pairing is not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import ROOT, env_info, header_lines, load_str  # noqa: E402
from benchlib.output import md_table  # noqa: E402
from equal_bytes import LENGTH, PER_TASK, PROTOCOL, SEED, TASKS, compare_command  # noqa: E402
from findings import _fmt_diff, _rows  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "quantized_cache"
ROWS = OUT / "anchor.jsonl"
ENV = OUT / "env.json"  # the machine and versions of the anchors' run
REPORT = ROOT / "benchmarks" / "results" / "quantized_cache.md"
ANCHORS = (("quanto", 4), ("quanto", 2), ("fp8", None))
STORAGES = ("int4", "bfloat16")
RULES = ("snapkv", "knorm")


def anchor_name(backend: str, nbits: int | None) -> str:
    return f"QuantizedCache {backend}" + (f" int{nbits}" if nbits else "")


def held_bytes(cache) -> int:
    """Bytes of every tensor the cache's layers hold (quantized codes, scales and zero-points, the residual)."""
    seen: set[int] = set()

    def size(x) -> int:
        if isinstance(x, (tuple, list)):
            return sum(size(y) for y in x)
        if not hasattr(x, "untyped_storage"):
            return 0
        if hasattr(x, "__tensor_flatten__"):  # a quanto QTensor: its inner tensors (codes, scale, shift)
            names, _ = x.__tensor_flatten__()
            return sum(size(getattr(x, n)) for n in names)
        ptr = x.untyped_storage().data_ptr()
        if ptr in seen or x.numel() == 0:
            return 0
        seen.add(ptr)
        return x.untyped_storage().nbytes()

    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
            total += size(getattr(layer, name, None))
    return total


def _answer_logprobs(model, cache, last_logits, answer):
    """`[m]` teacher-forced log-probabilities of the answer, as `fxbudget.harness.likelihood` scores them (float32
    log-softmax, float64 sum), the cache left as it was: a quanto QTensor cannot be deep-copied, but a layer's
    update rebinds its attributes (never writes in place), so restoring them restores the cache."""
    import torch

    from fxbudget.cache.keyword import cache_kwargs
    from fxbudget.harness.likelihood import _logprobs  # the harness's own scoring of answer logits

    saved = [dict(layer.__dict__) for layer in cache.layers]
    logits = [last_logits[:, None].float()]
    if answer.shape[1] > 1:
        logits.append(model(input_ids=answer[:, :-1], use_cache=True, **cache_kwargs(model.forward, cache)).logits
                      .float())
    for layer, state in zip(cache.layers, saved):
        layer.__dict__.clear()
        layer.__dict__.update(state)
    return _logprobs(torch.cat(logits, dim=1), answer)


def sample_of(task: str, tok, i: int):
    """Sample `i` of `task` as the grid's rounds build it: round `i + 1` asks for `i + 1` samples (depths spread)."""
    from fxbudget.harness.tasks import make_samples

    return make_samples(task, tok, LENGTH, i + 1, seed=SEED)[i]


def run_anchor(model, tok, backend: str, nbits: int | None, task: str, i: int) -> dict:
    import torch
    from transformers import QuantizedCache

    from fxbudget.cache.keyword import cache_kwargs
    from fxbudget.harness.measure import eos_ids, greedy
    from fxbudget.harness.tasks import answer_ids, chat_ids, score

    sample = sample_of(task, tok, i)
    ctx, question = chat_ids(tok, sample)
    answer = answer_ids(tok, sample)
    cache = QuantizedCache(backend, model.config, **({"nbits": nbits} if nbits else {}))
    with torch.no_grad():
        t0 = time.perf_counter()
        model(input_ids=ctx, use_cache=True, logits_to_keep=1, **cache_kwargs(model.forward, cache))
        logits = model(input_ids=question, use_cache=True, logits_to_keep=1,
                       **cache_kwargs(model.forward, cache)).logits[:, -1]
        prefill_s = time.perf_counter() - t0
        held = held_bytes(cache)
        lp = _answer_logprobs(model, cache, logits, answer)
        t0 = time.perf_counter()
        ids, _ = greedy(model, cache, logits, sample.max_new_tokens, eos_ids(model, tok))
        decode_s = time.perf_counter() - t0
    prediction = tok.decode(ids, skip_special_tokens=True)
    return {"anchor": anchor_name(backend, nbits), "backend": backend, "nbits": nbits, "task": task,
            "length": LENGTH, "sample": i, "depth": sample.depth, "context_tokens": int(ctx.shape[1]),
            "kv_held_bytes": held, "prefill_s": prefill_s, "decode_s": decode_s, "output_tokens": len(ids),
            "answer_logprob_mean": float(lp.mean()), "prediction": prediction, "score": score(sample, prediction)}


def available_anchors(config) -> list[tuple[str, int | None]]:
    """The anchors this install builds for `config` (optimum-quanto for `quanto`; `fp8` from transformers 5.2x),
    each one that cannot be built said in a line."""
    from transformers import QuantizedCache

    out = []
    for backend, nbits in ANCHORS:
        try:
            QuantizedCache(backend, config, **({"nbits": nbits} if nbits else {}))
        except (ImportError, ValueError) as e:
            print(f"[quantized_cache] {anchor_name(backend, nbits)}: skipped: {str(e).splitlines()[0]} "
                  "(optimum-quanto: pip install 'flexbudget[anchors]')", file=sys.stderr)
            continue
        out.append((backend, nbits))
    return out


def run_anchors(per_task: int) -> None:
    import torch

    from fxbudget.models import load_default

    torch.manual_seed(0)
    model, tok = load_default(dtype=torch.float32)
    done = {(r["anchor"], r["task"], r["sample"]) for r in _read(ROWS)}
    OUT.mkdir(parents=True, exist_ok=True)
    if not ENV.is_file():
        ENV.write_text(json.dumps({**env_info(), "command": "python benchmarks/quantized_cache.py " +
                                   shlex.join(sys.argv[1:])}, indent=1) + "\n")
    for backend, nbits in available_anchors(model.config):
        for i in range(per_task):
            for task in TASKS:
                if (anchor_name(backend, nbits), task, i) in done:
                    continue
                row = run_anchor(model, tok, backend, nbits, task, i)
                with ROWS.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"[quantized_cache] {row['anchor']} {task} #{i}: {row['kv_held_bytes'] / 2**20:.2f} MiB held, "
                      f"score {row['score']:.2f}", file=sys.stderr)


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []


def anchor_budgets(rows: list[dict]) -> dict[str, str]:
    """{anchor: the byte budget (`KiB`, floor) of its median held bytes}."""
    import numpy as np

    return {a: f"{int(np.median([r['kv_held_bytes'] for r in rows if r['anchor'] == a])) // 1024}KiB"
            for a in sorted({r["anchor"] for r in rows})}


def run_fxbudget(per_task: int, parallel: int) -> None:
    """The fxbudget cells at the anchors' bytes, one folder per storage, `parallel` at once, in rounds."""
    budgets = sorted(set(anchor_budgets(_read(ROWS)).values()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for n in range(1, per_task + 1):
        procs = []
        for storage in STORAGES:
            cmd = compare_command(storage, n, rules=RULES, budgets=budgets, out=OUT / f"fxbudget_{storage}")
            print(f"[quantized_cache] fxbudget {shlex.join(cmd)}", file=sys.stderr)
            procs.append(subprocess.Popen([sys.executable, "-m", "fxbudget.cli", *cmd], cwd=ROOT, env=env))
            if len(procs) >= parallel:
                if procs.pop(0).wait() != 0:
                    raise SystemExit("[quantized_cache] fxbudget compare failed; rerun to resume")
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("[quantized_cache] fxbudget compare failed; rerun to resume")


def report() -> str:
    import numpy as np

    from fxbudget.checks import byte_size, size_label
    from fxbudget.harness.stats import paired_diff

    anchors = _read(ROWS)
    fx = [r for s in STORAGES for r in _rows(OUT / f"fxbudget_{s}")]
    budgets = anchor_budgets(anchors)
    env = json.loads(ENV.read_text()) if ENV.is_file() else None
    lines = header_lines("transformers' QuantizedCache against fxbudget at the same bytes", env,
                         command=env.get("command") if env else None)
    lines += ["<!-- generated by `python benchmarks/quantized_cache.py --report-only` from "
             "benchmarks/results/quantized_cache/: do not edit by hand -->", "",
             f"The embedded Qwen2.5-Coder-0.5B-Instruct in float32, the equal-bytes grid's samples ({len(TASKS)} "
             f"RULER tasks at {LENGTH} tokens, {PROTOCOL}). `QuantizedCache` keeps every token (quantized, plus a "
             "float residual of recent ones); fxbudget spends the same bytes on fewer entries in its slots, chosen by "
             "a rule (`benchmarks/quantized_cache.py`).", ""]
    key = lambda r: (r["task"], r["sample"])  # noqa: E731
    table = []
    for anchor, budget in budgets.items():
        mine = [r for r in anchors if r["anchor"] == anchor]
        a = {key(r): r for r in mine}
        table.append([f"**{anchor}**", "every token", size_label(int(np.median([r["kv_held_bytes"] for r in mine]))),
                      len(a), f"{np.mean([r['answer_logprob_mean'] for r in mine]):.3f}",
                      f"{np.mean([r['score'] for r in mine]):.2f}", "-",
                      f"{1000 * sum(r['decode_s'] for r in mine) / max(1, sum(r['output_tokens'] for r in mine)):.0f}"])
        for storage in STORAGES:
            for rule in RULES:
                cells = {key(r): r for r in fx if r.get("slot_dtype") == storage and r["rule"] == rule
                         and r.get("budget_bytes") == byte_size(budget)}
                common = sorted(set(cells) & set(a))
                if not common:
                    continue
                d = paired_diff([cells[k]["answer_logprob_mean"] for k in common],
                                [a[k]["answer_logprob_mean"] for k in common])
                rows = [cells[k] for k in common]
                table.append([f"fxbudget `{storage}` / `{rule}`", f"{rows[0]['budget']} entries",
                              size_label(int(np.median([r["kv_held_bytes"] for r in rows]))), len(common),
                              f"{np.mean([r['answer_logprob_mean'] for r in rows]):.3f}",
                              f"{np.mean([r['score'] for r in rows]):.2f}", f"{_fmt_diff(d)}, p = {d.p:.3g}",
                              f"{1000 * sum(r['decode_s'] for r in rows) / max(1, sum(r['output_tokens'] for r in rows)):.0f}"])
    lines += md_table(["cache", "holds", "held (median)", "samples", "answer log-likelihood per token", "accuracy",
                       "fxbudget minus the anchor (paired)", "decode ms per token"], table)
    threads = env.get("torch_threads", "?") if env else "?"
    lines += ["", "Each fxbudget cell spends its anchor's median held bytes (`--budgets` in KiB, floor; its own held "
              "bytes beside it, after decoding: the question and decoded tokens are held on top of the budget), on "
              "the anchor's samples; the paired difference is on answer log-likelihood per token (sign-flip test, "
              f"unadjusted). Decode time: greedy steps of each row (the anchors at {threads} torch threads, "
              "fxbudget's rows at one, fxbudget's eager kernel); the machine was shared (see the command), so the "
              "times are indicative, not a benchmark.", "",
              "Where the anchor differs from fxbudget's slots besides eviction: quanto quantizes keys per channel in "
              "groups of 64 with zero-points and keeps the latest tokens (up to 128) unquantized, fp8 keeps one "
              "scale per layer tensor; fxbudget's `int4` is symmetric absmax per entry and head, keys and values "
              "alike (`fxbudget.kernel.slot_storage`).", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--samples-per-task", type=int, default=PER_TASK)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--skip-anchors", action="store_true", help="only the fxbudget side (the anchors' rows exist)")
    args = ap.parse_args()
    if not args.report_only:
        print(f"[quantized_cache] load {load_str()}", file=sys.stderr)
        if not args.skip_anchors:
            run_anchors(args.samples_per_task)
        run_fxbudget(args.samples_per_task, args.parallel)
    REPORT.write_text(report())
    print(f"[quantized_cache] {REPORT.relative_to(ROOT)} written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
