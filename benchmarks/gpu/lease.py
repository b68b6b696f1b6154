"""One prepared GPU run for a short lease with no weights and no network (issue 51, items 1-2).

    python benchmarks/gpu/lease.py bundle --out .gpu-bundle          # here: wheels the GPU image may lack, checked size
    python benchmarks/gpu/lease.py install --bundle .gpu-bundle --target /tmp/lease-site   # there: no network
    PYTHONPATH=/tmp/lease-site:. python benchmarks/gpu/lease.py run --out "$OUT"            # there: <= 8 min
    python benchmarks/gpu/lease.py run --dry-run --out /tmp/dry    # every step at tiny sizes on the CPU (CI)

`benchmarks/gpu/run.sh` does the install and the run in one line. The run measures **correctness against the same model
unmodified, and cost**; the models are real architectures (benchmarks/configs/: the embedded Qwen2.5-0.5B's config,
Llama-3.1-8B's, Qwen2.5-7B's) with seeded random weights (`fxbudget.models.load_random`): accuracy needs real weights,
and none travel. Steps, each a subprocess with its own time box (a failing or timed-out step never stops the next),
each writing its rows to DIR/rows.jsonl as they are measured (the child's output goes to DIR/log.txt; DIR/summary.md
is rewritten after every step; 3 files in all):

- `env`: torch / transformers / triton / Python versions, the GPU and its free memory (printed first).
- `correct-fp32`, `correct-bf16` (Qwen2.5-0.5B config, `--correct-layers` layers, weights drawn on the CPU so both
  devices hold the same ones): a covering budget equals the unmodified model on the device (logits' max error,
  greedy tokens), with the eager kernel and the compiled one (`--backend`, Inductor); under a budget, the kept sets
  of `--kept-rules` (`SIGNAL_RULES`: one rule per signal; "all" for every evicting rule) on the device against the same weights on this machine's CPU (mean overlap, heads that differ, and
  how many of them sit on an exact or near tie at the cut: benchmarks/cross_device.py's `run_entry` and
  `compare_entries`), and the compiled kernel against the eager one on the device (`--inductor-rules`).
- `fingerprint`: one kernel fingerprint for every rule of `--fingerprint-rules` (`SIGNAL_RULES`) on the device (`fxbudget.kernel_fingerprint`, what
  `fxbudget inspect` prints), one row per rule.
- `tests`: `pytest -m cuda` on the test files that carry the mark (skipped where no `nvidia-smi`).
- `compare` (the main job, issue 55): `fxbudget compare --model random:CONFIG,layers=N` on the cost config with seeded
  weights and a byte-level tokenizer, `--compare-rules` x `--compare-budgets` x `--compare-lengths` passkey samples,
  once per `--compare-backends` (the eager kernel, Inductor): every result row's cost fields, the time per row and the
  report go into rows.jsonl (accuracy is meaningless: the report says so); one fingerprint per run is checked.
- `prefill-full`, `prefill-eager`, `prefill-compiled` (Llama-3.1-8B config, bf16, `--cost-layers` layers): one-call
  prefill at each of `--prefill-lengths`, the unmodified model under SDPA restricted to its flash and efficient
  backends, fxbudget's eager kernel and the compiled one (each of `--prefill-rules`, `--prefill-budget`): seconds and
  peak memory above the weights (benchmarks/long_context.py's `_Peak`), compile seconds apart.
- `decode` (same model): the decode step of fxbudget at each of `--decode-budgets` and `--decode-intervals` (1: a
  full cache, every step evicts; k > 1: the steps append into head-room, as between evictions), at each of
  `--decode-batches` (compiled, CUDA graphs on CUDA) against the full cache (transformers' DynamicCache at each of
  `--decode-contexts`, uncompiled, batch 1; StaticCache under `torch.compile(mode="reduce-overhead")` on CUDA over B
  entries, the kernel's own overhead, and over each context, what a budget saves): benchmarks/deploy_decode.py's
  cache fillers, interleaved steps, medians; compile seconds. Each storage of `--decode-slot-dtypes` but the first
  (issue 58: fp8 slots against the model's bf16 ones) adds, last (a time box cuts it first), the evicting step at the
  largest budget, batch 1, in that slot storage (`fxbudget.compile(slot_dtype=...)`): the same kernel reading its slots dequantized.
- `spread`: the decode step of `--spread-rules` (>= 10 rules) through the one compiled kernel at the 8B config's
  attention shapes in bf16 (benchmarks/benchlib's `LayerCase`, CUDA graphs on CUDA), interleaved: max/min.

`--measure-forms` (default "blocks,flex") names the kernel's measure-phase forms (issue 49) the prefill steps time,
each passed as `fxbudget.compile(measure=...)`; "default" is the kernel's own choice for the device and backend.
The compiled side skips "flex" (Inductor does not lower it yet) and decode times one form (a decode step runs the
block form whatever the setting).

`--dry-run` runs every step on `--device cpu` at tiny sizes (configs shrunk to 64 wide, a few tokens, `aot_eager` in
place of Inductor) so a script bug shows here, not in the lease. Dropped from the old benchmarks/gpu.sh: every step that needs
the embedded model's weights (compare on them, cross-device dumps against the committed CPU dumps, long context and compile
time of the embedded model); `benchmarks/gpu/run.sh --embedded` still runs them where the weights are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent  # benchmarks/gpu
BENCH = HERE.parent  # benchmarks/: the steps import its scripts (cross_device, long_context, benchlib, ...)
ROOT = BENCH.parent
CONFIGS = BENCH / "configs"
for _p in (BENCH, HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

STEPS = ("env", "correct-fp32", "correct-bf16", "fingerprint", "tests", "compare", "prefill-full", "prefill-eager",
         "prefill-compiled", "decode", "spread")
# Time boxes (seconds) on an H200, cold Inductor compiles included; they sum to <= 480 and the run's own deadline
# (--budget-s) cuts whatever is left when it is reached.
BOXES = {"env": 15, "correct-fp32": 50, "correct-bf16": 35, "fingerprint": 20, "tests": 30, "compare": 100,
         "prefill-full": 25, "prefill-eager": 70, "prefill-compiled": 60, "decode": 55, "spread": 20}
SPREAD_RULES = "knorm,random,streamingllm,window,h2o,snapkv,tova,keydiff,lagkv,cur,observed_attention"
# Rules that read different signals (attn, acc_attn, window_attn, last_attn, key norms, keys, values, wov_norm): the
# lease's kept-set and fingerprint checks. All 23 did not fit the first H200 run's boxes (each rule runs on the GPU
# and on the CPU); `make test` checks every rule on the CPU. "all" is still an option.
SIGNAL_RULES = "h2o,observed_attention,snapkv,tova,knorm,keydiff,cur,criticalkv"
# Sizes: the lease's, and the dry run's (every one a command-line option).
LEASE = dict(device="cuda", backend="inductor", correct_layers=4, correct_tokens=1024, correct_steps=8,
             correct_budget=256, kept_rules=SIGNAL_RULES, inductor_rules="knorm,snapkv,h2o",
             fingerprint_rules=SIGNAL_RULES,
             cost_config="llama-3.1-8b", cost_layers=2, prefill_lengths="8192,32768,131072", prefill_budget=1024,
             prefill_rules="snapkv",
             decode_budgets="1024,4096", decode_contexts="32768,131072", decode_steps=20, decode_intervals="1",
             decode_batches="1", decode_slot_dtypes="model,float8_e4m3fn",
             spread_rules=SPREAD_RULES, spread_budget=4096, spread_reps=50, tests_files="auto",
             compare_layers=2, compare_rules="snapkv,streamingllm,h2o,knorm", compare_budgets="256,1024",
             compare_lengths="8000,32000", compare_samples=2, compare_backends="none,inductor")
DRY = dict(LEASE, device="cpu", backend="aot_eager", correct_layers=2, correct_tokens=40, correct_steps=3,
           correct_budget=12, kept_rules="snapkv,knorm,h2o", inductor_rules="knorm", fingerprint_rules="snapkv,knorm",
           cost_layers=1, prefill_lengths="48,96", prefill_budget=16, decode_budgets="16,32", decode_contexts="64,128",
           decode_intervals="1,8", decode_batches="1,2", decode_slot_dtypes="model,int8",
           prefill_rules="snapkv,h2o",
           decode_steps=3, spread_rules="knorm,snapkv", spread_budget=32, spread_reps=3,
           compare_layers=1, compare_rules="snapkv,h2o", compare_budgets="32", compare_lengths="300",
           compare_samples=1, compare_backends="none,aot_eager")
DRY_BOXES = {k: 120 for k in STEPS}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # --dry-run's widths (the config's other values stay)
MAX_FILES = 8


# ------------------------------------------------------------------------------------------------------------------
# Shared by the parent and the steps
# ------------------------------------------------------------------------------------------------------------------

def _config(name: str, shrink: bool) -> dict:
    values = json.loads((CONFIGS / f"{name}.json").read_text())
    return {**values, **TINY} if shrink else values


class Rows:
    """Rows of one step, appended to DIR/rows.jsonl as they are measured (a step that dies keeps what it wrote)."""

    def __init__(self, path: str, step: str):
        self.path, self.step = path, step

    def __call__(self, kind: str, **values) -> dict:
        row = {"step": self.step, "kind": kind, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print(f"[{self.step}] {kind}: {json.dumps(values, default=str)[:400]}", flush=True)
        return row

    def key(self, text: str) -> None:
        """The step's key numbers for the summary table."""
        self("key", text=text)

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        """A correctness verdict: a failed one marks the step failed in the summary."""
        self("check", what=what, ok=bool(ok), detail=detail)
        return ok


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _rules(spec: str) -> list[str]:
    from fxbudget.rules import available, get

    if spec == "all":  # every rule that evicts in plain generation (kvzip only in its replay protocol)
        return [r for r in available() if not getattr(get(r), "never_evicts", False) and not get(r).replay_only]
    return [r for r in spec.split(",") if r]


def apply_measure_form(form: str) -> str:
    """`fxbudget.compile`'s `measure=` for a `--measure-forms` entry (issue 49): "default" is the kernel's own choice
    for the device and backend ("auto"), "blocks" and "flex" force a form (`kernel/settings.py`)."""
    from fxbudget.kernel.settings import check_measure

    measure = "auto" if form == "default" else form
    check_measure(measure)
    return measure


# ------------------------------------------------------------------------------------------------------------------
# Steps (each runs in its own process: `gpu/lease.py step NAME --rows FILE ...`)
# ------------------------------------------------------------------------------------------------------------------

def step_env(a, rows: Rows) -> None:
    import platform

    import torch
    import transformers

    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "absent"
    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": triton_v, "cuda_available": torch.cuda.is_available(), "device": a.device}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1))
    rows("env", **info)
    gpu = f"{info['gpu']}, {info['free_gib']} of {info['total_gib']} GiB free" if "gpu" in info else "no CUDA device"
    rows.key(f"torch {info['torch']}, transformers {info['transformers']}, triton {triton_v}, Python "
             f"{info['python']}; {gpu}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")


def _greedy(model, ids, steps: int):
    """Prefill then `steps` greedy steps on the model's own cache; (last logits of each call [steps+1, vocab], tokens)."""
    import torch

    from fxbudget.cache.keyword import cache_kwargs, output_cache

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, logits = output_cache(out), [out.logits[0, -1].float()]
        for _ in range(steps):
            tok = logits[-1].argmax().view(1, 1)
            out = model(input_ids=tok, use_cache=True, logits_to_keep=1, **cache_kwargs(model.forward, cache))
            logits.append(out.logits[0, -1].float())
    logits = torch.stack(logits)
    return logits, logits.argmax(-1)


def step_correct(a, rows: Rows) -> None:
    import torch

    import fxbudget
    from cross_device import compare_entries, run_entry
    from fxbudget.harness.branch import shared_prefill
    from fxbudget.models import load_random

    dtype = a.dtype
    cfg = _config("qwen2.5-0.5b", a.shrink)
    t = time.perf_counter()
    model = load_random(cfg, device=a.device, dtype=dtype, seed=a.seed, layers=a.correct_layers)
    rows("built", config="qwen2.5-0.5b", layers=a.correct_layers, dtype=dtype, device=a.device,
         seconds=round(time.perf_counter() - t, 1))
    n, steps, B = a.correct_tokens, a.correct_steps, a.correct_budget
    vocab = model.config.vocab_size
    ids_cpu = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(a.seed))
    ids = ids_cpu.to(a.device)
    tol = 1e-3 if dtype == "float32" else 0.1  # logits are O(1); bf16 keeps ~3 significant digits

    ref_logits, ref_tokens = _greedy(model, ids, steps)
    top2 = torch.topk(ref_logits, 2, dim=-1).values
    gap = float((top2[:, 0] - top2[:, 1]).min())

    def covering(backend):
        """A covering budget: the unmodified model's logits and greedy tokens."""
        name = backend or "eager"
        t = time.perf_counter()
        fxbudget.compile(model, rule="snapkv", budget=n + steps + 16, backend=backend)
        try:
            logits, tokens = _greedy(model, ids, steps)
        finally:
            model.forward.restore()
        err = float((logits - ref_logits).abs().max())
        same = bool(torch.equal(tokens, ref_tokens))
        rows("covering", backend=name, dtype=dtype, tokens=n, steps=steps, logits_max_err=err, tokens_identical=same,
             min_top2_gap=gap, seconds=round(time.perf_counter() - t, 1))
        # A differing token is excused only where the unmodified model's own top-2 gap is within the error.
        ok = rows.check(f"covering budget = unmodified ({name}, {dtype})", err <= tol and (same or gap <= 2 * err),
                        f"max err {err:.2e} (tol {tol}), tokens {'identical' if same else 'differ'}")
        rows.key(f"covering {name}: err {err:.1e}, tokens {'same' if same else 'DIFFER'}" + ("" if ok else " FAILED"))

    # Cheap checks first, the compiles last: a time box that cuts the step keeps the rows already written.
    covering(None)

    # Under a budget: kept sets on the device vs the same weights on this machine's CPU (eager kernel both).
    rules = _rules(a.kept_rules)
    with torch.no_grad():
        shared = shared_prefill(model, ids)
    dev = {r: run_entry(model, ids, r, B, steps, "eager", shared) for r in rules}
    del shared
    cpu_model = model if a.device == "cpu" else load_random(cfg, device="cpu", dtype=dtype, seed=a.seed,
                                                            layers=a.correct_layers)
    with torch.no_grad():
        shared = shared_prefill(cpu_model, ids_cpu)
    overlaps, unexplained = [], 0
    for r in rules:
        e = run_entry(cpu_model, ids_cpu, r, B, steps, "eager", shared)
        for x in (dev[r], e):
            x["length"] = n
        c = compare_entries(dev[r], e, tie=1e-6 if dtype == "float32" else 1e-2)
        overlaps.append(c["prefill_mean"])
        unexplained += c["unexplained"] or 0
        rows("kept_device_vs_cpu", rule=r, budget=B, dtype=dtype, **{k: c[k] for k in (
            "prefill_mean", "prefill_min", "decode_mean", "decode_min", "heads", "heads_differing", "exact_ties_a",
            "near_ties_a", "exact_ties_b", "near_ties_b", "unexplained", "tokens_agree", "first_diff",
            "gaps_at_diff")})
    del shared, cpu_model
    mean = sum(overlaps) / len(overlaps)
    ok = rows.check(f"kept sets {a.device} vs cpu ({dtype}): mean overlap >= 0.99", mean >= 0.99,
                    f"mean {mean:.4f} over {len(rules)} rules, min {min(overlaps):.4f}")
    rows.key(f"kept {a.device}/cpu mean {mean:.4f} min {min(overlaps):.4f} ({len(rules)} rules, {unexplained} "
             f"differing heads with no tie)" + ("" if ok else " FAILED"))

    covering(a.backend)

    # Compiled kernel vs eager kernel on the device, under the budget.
    comp = []
    for r in _rules(a.inductor_rules):
        t = time.perf_counter()
        e = run_entry(model, ids, r, B, steps, a.backend)
        e["length"] = n
        c = compare_entries(dev[r], e)
        comp.append(c["prefill_mean"])
        rows("kept_compiled_vs_eager", rule=r, budget=B, dtype=dtype, backend=a.backend,
             seconds_incl_compile=round(time.perf_counter() - t, 1), **{k: c[k] for k in (
                 "prefill_mean", "prefill_min", "decode_mean", "heads_differing", "tokens_agree", "first_diff")})
    if comp:
        ok = rows.check(f"kept sets {a.backend} vs eager ({dtype}): mean overlap >= 0.99", min(comp) >= 0.99,
                        f"min over rules of the mean {min(comp):.4f}")
        rows.key(f"{a.backend}/eager min {min(comp):.4f} ({len(comp)} rules)" + ("" if ok else " FAILED"))


def step_fingerprint(a, rows: Rows) -> None:
    """One kernel fingerprint for every rule, on the device (fp32, the correctness model): one row per rule as it
    is traced, so a time box that cuts the list keeps what was done."""
    import fxbudget
    from fxbudget.models import load_random

    model = load_random(_config("qwen2.5-0.5b", a.shrink), device=a.device, seed=a.seed, layers=a.correct_layers)
    prints = {}
    for r in _rules(a.fingerprint_rules):
        t = time.perf_counter()
        try:
            prints[r] = fxbudget.kernel_fingerprint(model, rule=r, budget=a.correct_budget)[:16]
        except Exception as exc:  # a rule refused on this model is reported, not fatal to the others
            prints[r] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
        rows("fingerprint", rule=r, fingerprint=prints[r], seconds=round(time.perf_counter() - t, 2))
    distinct = sorted(set(prints.values()))
    rows.check("one kernel fingerprint for every rule", len(distinct) == 1,
               f"{len(distinct)} distinct over {len(prints)} rules")
    rows.key(f"{len(distinct)} fingerprint(s) over {len(prints)} rules: {', '.join(d[:16] for d in distinct)}")


def step_tests(a, rows: Rows) -> None:
    files = a.tests_files.split(",") if a.tests_files != "auto" else sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "pytest.mark.cuda" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-ra", "-m", "cuda",
           *files]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-6000:] + proc.stderr[-3000:], flush=True)
    tail = [line for line in proc.stdout.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
    rows("pytest", files=files, rc=proc.returncode, last_line=tail[0], seconds=round(time.perf_counter() - t, 1))
    rows.key(tail[0][:100])
    # 5: nothing collected (every test deselected) is not a failure; skipped tests (no GPU) neither.
    rows.check("pytest -m cuda", proc.returncode in (0, 5), f"rc {proc.returncode}")


def _cost_model(a):
    from fxbudget.models import load_random

    t = time.perf_counter()
    model = load_random(_config(a.cost_config, a.shrink), device=a.device, dtype="bfloat16", seed=a.seed,
                        layers=a.cost_layers, generate_on="device")
    return model, round(time.perf_counter() - t, 1)


def step_compare(a, rows: Rows) -> None:
    """The main job on the device (issue 55, item 2): `fxbudget compare` end to end on the cost config with seeded
    weights (`--model random:CONFIG`, nothing travels but the tree), one run per backend (the eager kernel, then
    Inductor), each a subprocess of this step. Only rows.jsonl comes back: each result row (cost fields), the time per
    row and the report (text) are written into it; the run folders stay in a temporary directory. Accuracy is
    meaningless here, and the report says so."""
    config = Path(tempfile.mkdtemp(prefix="fxbudget_compare_")) / f"{a.cost_config}.json"
    config.write_text(json.dumps(_config(a.cost_config, a.shrink)))
    spec = f"random:{config},layers={a.compare_layers},seed={a.seed}"
    keep = ("rule", "budget", "length", "context_tokens", "sample", "protocol", "backend", "prefill_s", "decode_s",
            "compile_s", "kernel_fingerprint", "peak_mem_bytes", "kv_held_bytes", "kv_allocated_bytes", "score")
    keys = []
    for backend in a.compare_backends.split(","):
        soft = float(os.environ.get("GPU_LEASE_SOFT_DEADLINE", "inf"))
        if time.time() > soft:
            keys.append(f"{backend}: not started (the step's soft deadline)")
            continue
        out = config.parent / f"run-{backend}"
        cmd = [sys.executable, "-m", "fxbudget.cli", "compare", "--model", spec, "--device", a.device,
               "--dtype", "bfloat16" if a.device.startswith("cuda") else "float32", "--backend", backend,
               "--tasks", "passkey", "--lengths", a.compare_lengths, "--samples", str(a.compare_samples),
               "--rules", "full," + a.compare_rules, "--budgets", a.compare_budgets, "--max-new-tokens", "8",
               "--quiet", "--out", str(out)]
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
        got = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()] \
            if (out / "results.jsonl").exists() else []
        for r in got:
            rows("compare-row", **{k: r.get(k) for k in keep})
        report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
        closing = next((x for x in done.stderr.splitlines() if x.startswith("[fxbudget] done in ")), "")
        rows("compare-run", backend=backend, rc=done.returncode, wall_s=round(wall, 1), rows=len(got),
             s_per_row=round(wall / len(got), 2) if got else None, closing=closing,
             stderr_tail=done.stderr[-1500:] if done.returncode else "", report=report)
        prints = {r["kernel_fingerprint"] for r in got if r.get("kernel_fingerprint")}
        rows.check(f"compare --backend {backend} ran end to end", done.returncode == 0 and bool(got) and bool(report),
                   done.stderr.strip().splitlines()[-1][:300] if done.returncode and done.stderr.strip() else "")
        rows.check(f"compare --backend {backend}: one kernel fingerprint for every rule", len(prints) == 1,
                   ", ".join(sorted(p[:12] for p in prints)))
        rows.check(f"compare --backend {backend}: the report says accuracy is meaningless",
                   "**seeded random weights**" in report)
        keys.append(f"{backend}: {len(got)} rows in {wall:.0f} s ({wall / max(len(got), 1):.1f} s/row)")
    rows.key("; ".join(keys))


def step_prefill(a, rows: Rows, side: str) -> None:
    import torch
    from transformers import DynamicCache

    import fxbudget
    from fxbudget.cache.keyword import cache_kwargs
    from long_context import _Peak

    cuda = a.device.startswith("cuda")
    # Issue 56: a window-signal rule (snapkv) and one reading the all-query attention (h2o) price the signal set.
    runs = [("-", "-")] if side == "full" else [(f, r) for r in a.prefill_rules.split(",")
                                                for f in a.measure_forms.split(",")]
    for form, rule in runs:
        model, build_s = _cost_model(a)
        if side != "full":
            fxbudget.compile(model, rule=rule, budget=a.prefill_budget, measure=apply_measure_form(form),
                             backend=a.backend if side == "compiled" else None, progress=False)

        def prefill(x):
            cache = model.forward.new_cache(1) if side != "full" else DynamicCache()
            with torch.no_grad():
                return model(input_ids=x, use_cache=True, logits_to_keep=1, **cache_kwargs(model.forward, cache))

        def attention():  # the unmodified model: SDPA's flash or efficient backend only (no silent math fallback)
            if side != "full" or not cuda:
                import contextlib
                return contextlib.nullcontext()
            from torch.nn.attention import SDPBackend, sdpa_kernel
            return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])

        gen = torch.Generator().manual_seed(a.seed)
        with attention():
            prefill(torch.randint(0, 100, (1, 64), generator=gen).to(a.device))  # first-call overheads
            for n in (int(x) for x in a.prefill_lengths.split(",")):
                ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(a.device)
                row = {"side": side, "form": form, "rule": rule, "tokens": n, "layers": a.cost_layers,
                       "config": a.cost_config,
                       "budget": a.prefill_budget if side != "full" else None, "build_s": build_s}
                try:
                    if side == "compiled":
                        t = time.perf_counter()
                        prefill(ids)
                        _sync(a.device)
                        row["compile_run_s"] = round(time.perf_counter() - t, 2)
                    with _Peak("cuda" if cuda else "cpu") as peak:
                        prefill(ids)
                    row.update(seconds=peak.seconds, peak_mb_above=round(peak.mb, 1))
                except torch.OutOfMemoryError as exc:
                    row.update(error=f"out of memory: {str(exc)[:160]}")
                except RuntimeError as exc:  # e.g. SDPA refusing flash and efficient: this length fails, not the rest
                    row.update(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                rows("prefill", **row)
                del ids
                if cuda:
                    torch.cuda.empty_cache()
        del model
    got = [json.loads(x) for x in Path(rows.path).read_text().splitlines()]
    got = [r for r in got if r["step"] == rows.step and r["kind"] == "prefill"]
    rows.key("; ".join(("" if r.get("rule", "-") == "-" else f"{r['rule']} ")
                       + f"{r['tokens'] // 1024 if r['tokens'] >= 1024 else r['tokens']}"
                       f"{'K' if r['tokens'] >= 1024 else ''} "
                       + (r["error"][:20] if "error" in r else f"{r['seconds']:.3f}s {r['peak_mb_above']:.0f}MB")
                       for r in got))


def _mark_static(cache) -> None:
    """The cache's tensors as static addresses: CUDA graphs replay on them in place."""
    import torch

    for layer in cache.layers:
        for t in (layer.keys, layer.values, layer.pos, layer.state, layer.norms, layer.totals, layer.seen,
                  layer.inv_freq):
            torch._dynamo.mark_static_address(t)


def step_decode(a, rows: Rows) -> None:
    """Each side is timed as soon as it is set up (cheapest first: the uncompiled full caches, then fxbudget's
    compiled budgets, then the compiled full caches), its row written at once: a time box that cuts the step keeps
    the sides done. deploy_decode.py interleaves its sides against CPU load drift; a leased GPU runs this alone."""
    import statistics

    import torch
    from transformers import DynamicCache, StaticCache

    import fxbudget
    from benchlib.timing import timed
    from deploy_decode import _fill_budget, _fill_hf
    from fxbudget.cache.keyword import cache_kwargs

    cuda = a.device.startswith("cuda")
    gen = torch.Generator().manual_seed(a.seed)
    contexts = [int(x) for x in a.decode_contexts.split(",")]
    intervals = [int(x) for x in a.decode_intervals.split(",")]
    batches = [int(x) for x in a.decode_batches.split(",")]
    out = []

    def measure(form, name, step, **extra):
        times = [step() for _ in range(2 + a.decode_steps)][2:]  # 2 warm-up steps dropped
        ms = 1e3 * statistics.median(times)
        out.append((name, ms))
        rows("decode", form=form, side=name, ms=ms, steps=len(times), layers=a.cost_layers, config=a.cost_config,
             **extra)

    # A decode step (one query: its own window block) runs today's form whatever the setting (kernel/flex_measure.py):
    # one form is timed. Per batch: the full caches, then fxbudget at each budget and interval (issue 57: an interval
    # k > 1 times the appending steps, every timed step lands in head-room), then the compiled full caches.
    form = a.measure_forms.split(",")[0]
    apply_measure_form(form)
    model, build_s = _cost_model(a)
    with torch.no_grad():
        for batch in batches:
            nxt = torch.full((batch, 1), 3, device=a.device)
            at = f" x{batch}" if batch > 1 else ""
            for ctx in contexts if batch == 1 else []:  # DynamicCache: the uncompiled reference, batch 1 only
                d = DynamicCache()
                _fill_hf(d, model, ctx, gen)

                def dyn_step(d=d, c=ctx, nxt=nxt):
                    for layer in d.layers:  # back to `c` tokens: every step costs that of a `c`-token context
                        layer.keys, layer.values = layer.keys[..., :c, :], layer.values[..., :c, :]
                    kw = cache_kwargs(model.forward, d)
                    return timed(lambda: model(input_ids=nxt, use_cache=True, logits_to_keep=1, **kw), a.device)

                measure("-", f"DynamicCache {ctx}", dyn_step, build_s=build_s, batch=1)
                del d
            def fx_side(B, name, **setting):
                """fxbudget's compiled step at budget B (a full cache, every slot held), in `setting`'s kernel."""
                fwd = fxbudget.compile(model, rule="snapkv", budget=B, backend=a.backend, cudagraphs=cuda,
                                       progress=False, **setting).forward
                cache = fwd.new_cache(batch)
                _fill_budget(cache, 2 * B, gen)
                if cuda:
                    _mark_static(cache)

                def fx_step(fwd=fwd, cache=cache, nxt=nxt):
                    return timed(lambda: fwd(input_ids=nxt, past_key_values=cache, logits_to_keep=1), a.device)

                compile_s = fx_step()
                measure(form, name, fx_step, compile_s=round(compile_s, 2), graphs=len(fwd.graphs), cudagraphs=cuda,
                        batch=batch, budget=B, kv_bytes=cache.kv_bytes(), **setting)
                fwd.restore()

            for B in (int(x) for x in a.decode_budgets.split(",")):
                for k in intervals:
                    if k > 1 and a.decode_steps + 2 > k - 1:
                        rows.check(f"decode: interval {k} leaves room for {a.decode_steps + 2} appending steps", False,
                                   "raise --decode-intervals or lower --decode-steps")
                        continue
                    what = "evicting" if k == 1 else f"appending, interval {k}"
                    fx_side(B, f"fxbudget B={B}{at} {what}", interval=k)
            if cuda:
                for ctx in [*(int(x) for x in a.decode_budgets.split(",")), *contexts]:
                    # The full cache with CUDA graphs (deploy_decode.py's StaticCache side) over B entries (the
                    # kernel's own overhead) and over each context (what a budget saves).
                    static = StaticCache(config=model.config, max_cache_len=ctx + 64, max_batch_size=batch)
                    _fill_hf(static, model, ctx, gen, batch)
                    sfwd = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")

                    def st_step(static=static, sfwd=sfwd, c=ctx, nxt=nxt):
                        for layer in static.layers:
                            if int(layer.cumulative_length) > c + 32:
                                layer.cumulative_length.fill_(c)
                        kw = cache_kwargs(model.forward, static)
                        return timed(lambda: sfwd(input_ids=nxt, use_cache=True, logits_to_keep=1, **kw), a.device)

                    compile_s = st_step()
                    measure("-", f"StaticCache {ctx}{at}", st_step, compile_s=round(compile_s, 2), cudagraphs=True,
                            batch=batch)
                    del static, sfwd
            for storage in a.decode_slot_dtypes.split(",")[1:] if batch == 1 else []:
                B = max(int(x) for x in a.decode_budgets.split(","))  # the largest budget: where slot bytes weigh most
                fx_side(B, f"fxbudget B={B} evicting, {storage} slots", interval=1, slot_dtype=storage)
    del model
    if cuda:
        torch.cuda.empty_cache()
    rows.key("; ".join(f"{name} {ms:.2f}ms" for name, ms in out))


def step_spread(a, rows: Rows) -> None:
    import torch

    from benchlib.cases import LayerCase
    from benchlib.timing import interleaved, median_us, paired_ratio

    cfg = _config(a.cost_config, a.shrink)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    cuda = a.device.startswith("cuda")
    rules = _rules(a.spread_rules)
    steps = {}
    soft = float(os.environ.get("GPU_LEASE_SOFT_DEADLINE", "inf"))  # leave time to time the rules compiled
    for r in rules:
        if time.time() > soft and len(steps) >= 2:
            rows("spread_cut", rules_compiled=len(steps), rules_asked=len(rules))
            break
        case = LayerCase(r, a.spread_budget, 1, device=a.device, dtype=torch.bfloat16, heads=heads, kv_heads=kv,
                         head_dim=hd, rope_theta=float(cfg.get("rope_theta", 1e4)), cudagraphs=cuda)
        steps[r] = case.compiled(inner=a.backend)
        rows("spread_compile", rule=r, seconds=round(case.compile_s["budget"], 2))
    t = interleaved(steps, a.spread_reps, device=a.device)
    med = {r: median_us(v) for r, v in t.items()}
    lo, hi = min(med, key=med.get), max(med, key=med.get)
    q = paired_ratio(t[hi], t[lo])
    for r in steps:
        rows("spread", rule=r, us=med[r], budget=a.spread_budget, heads=heads, kv_heads=kv, head_dim=hd)
    rows("spread_ratio", slowest=hi, fastest=lo, ratio_quartiles=q, rules=len(steps))
    rows.key(f"decode max/min {q[1]:.2f} [{q[0]:.2f}-{q[2]:.2f}] ({hi}/{lo}, {len(steps)} rules, B={a.spread_budget})")


def run_step(a) -> int:
    import torch

    rows = Rows(a.rows, a.name)
    torch.manual_seed(a.seed)
    if a.name == "env":
        step_env(a, rows)
    elif a.name.startswith("correct-"):
        a.dtype = {"fp32": "float32", "bf16": "bfloat16"}[a.name.split("-")[1]]
        step_correct(a, rows)
    elif a.name == "fingerprint":
        step_fingerprint(a, rows)
    elif a.name == "tests":
        step_tests(a, rows)
    elif a.name == "compare":
        step_compare(a, rows)
    elif a.name.startswith("prefill-"):
        step_prefill(a, rows, a.name.split("-")[1])
    elif a.name == "decode":
        step_decode(a, rows)
    elif a.name == "spread":
        step_spread(a, rows)
    else:
        raise SystemExit(f"unknown step {a.name!r} (known: {', '.join(STEPS)})")
    return 0


# ------------------------------------------------------------------------------------------------------------------
# The run: one subprocess per step, time-boxed, summary last
# ------------------------------------------------------------------------------------------------------------------

def _size_args(a) -> list[str]:
    out = []
    for k in LEASE:
        if k == "device":
            continue
        out += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    return out


def _run_child(cmd: list[str], log, timeout: float, env: dict) -> tuple[str, float, int | None]:
    """Run one step in its own process group; on timeout kill the group (Inductor's compile workers too)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
        return ("ok" if rc == 0 else "failed"), time.perf_counter() - t, rc
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        return "timed out", time.perf_counter() - t, None


def _step_rows(path: Path, step: str) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if r.get("step") == step]


def _table(results: list[dict]) -> list[str]:
    lines = ["| step | status | seconds | key numbers |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {r['key'].replace('|', '/')} |")
    return lines


def _write_summary(out: Path, a, results: list[dict], started: float) -> list[str]:
    lines = [f"# GPU lease run ({'dry run, ' if a.dry_run else ''}device {a.device})", "",
             f"Command: `{' '.join(sys.argv)}`; {time.perf_counter() - started:.0f} s so far of a {a.budget_s} s "
             "budget. Random weights (seeded): correctness is against the same model unmodified; no accuracy. "
             "Every measured row: rows.jsonl; the steps' output: log.txt.", "", *_table(results)]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return lines


def cmd_run(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path, log_path = out / "rows.jsonl", out / "log.txt"
    for p in (rows_path, log_path, out / "summary.md"):
        p.unlink(missing_ok=True)
    started = time.perf_counter()
    deadline = started + a.budget_s
    boxes = DRY_BOXES if a.dry_run else BOXES
    steps = [s for s in a.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"--steps: unknown {', '.join(unknown)} (known: {', '.join(STEPS)})", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")
           or tempfile.mkdtemp(prefix="fxbudget_lease_inductor_")}
    if a.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(a.threads))
    base = [sys.executable, str(Path(__file__).resolve()), "step", "--rows", str(rows_path), "--device", a.device,
            "--seed", str(a.seed), "--measure-forms", a.measure_forms, *(["--shrink"] if a.dry_run else []),
            *_size_args(a)]
    results = []
    for s in steps:
        left = deadline - time.perf_counter()
        if left < 15:
            results.append({"step": s, "status": "skipped", "seconds": 0.0, "key": "the run's --budget-s is spent"})
            continue
        box = min(boxes[s] * a.box_scale, left - 5)
        at = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "a") as log:
            log.write(f"\n===== {s} (box {box:.0f} s) =====\n")
            log.flush()
            soft = {"GPU_LEASE_SOFT_DEADLINE": str(time.time() + 0.75 * box)}
            status, secs, rc = _run_child([*base[:3], s, *base[3:]], log, box, {**env, **soft})
        got = _step_rows(rows_path, s)
        keys = [r["text"] for r in got if r["kind"] == "key"]
        bad = [r["what"] for r in got if r["kind"] == "check" and not r["ok"]]
        if status == "ok" and bad:
            status = "failed"
        key = "; ".join(keys) or ""
        if bad:
            key += f" (failed: {'; '.join(bad)})"
        if status == "failed" and not keys:  # the error's last line, from the step's own output
            with open(log_path, "rb") as f:
                f.seek(at)
                tail = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
            key = f"rc {rc}: {tail[-1][:160] if tail else 'no output'} (log.txt)"
        if status == "timed out":
            key = f"stopped at {box:.0f} s; " + (key or f"{len(got)} rows written")
        results.append({"step": s, "status": status, "seconds": secs, "key": key})
        print(f"[{time.perf_counter() - started:5.0f} s] {s}: {status} in {secs:.0f} s. {key}", flush=True)
        if s == "env":  # the first lines printed: versions and the device
            print("\n".join(r["text"] for r in got if r["kind"] == "key"), flush=True)
        _write_summary(out, a, results, started)
    lines = _write_summary(out, a, results, started)
    files = sorted(p.name for p in out.iterdir())
    if len(files) > MAX_FILES:
        print(f"warning: {len(files)} files in {out} (at most {MAX_FILES} come back)", file=sys.stderr)
    print("\n" + "\n".join(lines[4:]))
    print(f"\n{len(results)} steps in {time.perf_counter() - started:.0f} s; files in {out}: {', '.join(files)}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


# ------------------------------------------------------------------------------------------------------------------
# The bundle (made here) and its install (there, no network)
# ------------------------------------------------------------------------------------------------------------------

ROOTS = ("transformers", "wonderwords", "pytest", "hypothesis")  # what the run imports beyond torch and numpy
NOT_BUNDLED = ("torch", "triton", "numpy", "setuptools", "pip", "wheel", "jinja2", "markupsafe", "networkx", "sympy",
               "mpmath",  # the image's own (torch's stack): never replaced
               "pyyaml",  # any transformers 5 has it (>= 5.1 asked)
               # Not imported by `import transformers`, fxbudget or the tests (transformers' CLI and the hub's
               # downloads use them; no network there): 10 MB of compiled wheels saved.
               "typer", "hf-xet")
PYTHONS = ("3.11", "3.12", "3.13", "3.14")
LIMIT_MIB = 64


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _closure() -> dict[str, str]:
    """{name: version} of ROOTS and their dependencies as installed here (the versions the tests ran with)."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo = list(ROOTS)
    while todo:
        name = _norm(todo.pop())
        if name in seen or name in NOT_BUNDLED or name.startswith("nvidia-"):
            continue
        dist = distribution(name)
        seen[name] = dist.version
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return seen


def _tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cmd_bundle(a) -> int:
    out = Path(a.out).resolve()
    wheels = out / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    pins = [f"{n}=={v}" for n, v in sorted(_closure().items())]
    print(f"bundling {len(pins)} packages: {' '.join(pins)}", flush=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), "--only-binary=:all:"]
    subprocess.run([*pip, *pins], check=True)  # this Python's wheels
    # Compiled wheels again for each CPython the image may run (manylinux x86_64); transformers 5.23 needs >= 3.11.
    binary = [w for w in wheels.glob("*.whl") if not w.name.endswith(("-none-any.whl", "-abi3-manylinux"))
              and "-abi3-" not in w.name and "-none-any" not in w.name]
    names = {_norm(w.name.split("-")[0]) for w in binary}
    for py in PYTHONS:
        for pin in (x for x in pins if _norm(x.split("==")[0]) in names):
            r = subprocess.run([*pip, "--python-version", py, "--implementation", "cp", "--platform",
                                "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64", "--platform",
                                "manylinux_2_17_x86_64", pin], capture_output=True, text=True)
            if r.returncode:
                print(f"no wheel of {pin} for CPython {py}", flush=True)
    (out / "requirements.txt").write_text("\n".join(pins) + "\n")
    bundle, tree = _dir_bytes(out), _tree_bytes()
    total = bundle + tree
    print(f"{out}: {bundle / 2**20:.1f} MiB ({len(list(wheels.iterdir()))} wheels); the working tree "
          f"{tree / 2**20:.1f} MiB; together {total / 2**20:.1f} MiB of the {LIMIT_MIB} MiB that travel")
    if total > LIMIT_MIB * 2**20:
        print(f"too large: {total / 2**20:.1f} MiB > {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


def cmd_install(a) -> int:
    """Install what the image lacks (or has too old) from the bundle's wheels into `--target`, no network: each pinned
    requirement already satisfied by the image is skipped. Needs only the standard library and `packaging`."""
    import zipfile
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    bundle, target = Path(a.bundle), Path(a.target)
    target.mkdir(parents=True, exist_ok=True)
    tags = set(sys_tags())
    wheels = {}
    for w in sorted((bundle / "wheels").glob("*.whl")):
        name, ver, _, wtags = parse_wheel_filename(w.name)
        if tags & set(wtags):
            wheels[_norm(name)] = (str(ver), w)
    pins = [Requirement(x) for x in (bundle / "requirements.txt").read_text().split()]
    chosen, kept = [], []
    for req in pins:
        name = _norm(req.name)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            have = None
        # The image's own copy stays when it satisfies what the pinned transformers (etc.) ask of it.
        if have is not None and name not in {_norm(r) for r in ROOTS[:2]} and _satisfies(name, have, pins, wheels):
            kept.append(f"{name} {have}")
            continue
        if have is not None and name in {_norm(r) for r in ROOTS[:2]} and have == str(req.specifier)[2:]:
            kept.append(f"{name} {have}")
            continue
        if name not in wheels:
            print(f"install: no wheel of {req} for this Python ({sys.version.split()[0]}) in {bundle}; "
                  f"the image has {have or 'none'}", file=sys.stderr)
            continue
        chosen.append(wheels[name][1])
    print(f"install: kept the image's {', '.join(kept) or 'nothing'}", flush=True)
    print(f"install: {len(chosen)} wheels into {target}: {' '.join(w.name for w in chosen)}", flush=True)
    for w in chosen:  # a wheel is a zip laid out for site-packages (no scripts are needed)
        with zipfile.ZipFile(w) as z:
            z.extractall(target)
    return 0


def _satisfies(name: str, have: str, pins, wheels) -> bool:
    """Whether the image's `name` at version `have` meets every requirement the bundled wheels put on it."""
    import zipfile

    from packaging.requirements import Requirement
    from packaging.version import Version

    for _, w in wheels.values():
        with zipfile.ZipFile(w) as z:
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            text = z.read(meta).decode() if meta else ""
        for line in text.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            r = Requirement(line.split(":", 1)[1].strip())
            if _norm(r.name) != name or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
                continue
            if not r.specifier.contains(Version(have), prereleases=True):
                return False
    return True


# ------------------------------------------------------------------------------------------------------------------

def _add_sizes(p, defaults: dict) -> None:
    for k, v in defaults.items():
        if k == "device":
            continue
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None,
                       help=f"(lease {LEASE[k]}; dry run {DRY[k]})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every step, time-boxed, summary last")
    r.add_argument("--out", required=True, help="folder for rows.jsonl, log.txt, summary.md")
    r.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, aot_eager for Inductor")
    r.add_argument("--device", default=None, help="cuda (default) or cpu (the dry run's)")
    r.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, in order (default {','.join(STEPS)})")
    r.add_argument("--budget-s", type=float, default=480, help="the whole run stops itself after this (default 480)")
    r.add_argument("--box-scale", type=float, default=1.0, help="multiply every step's time box")
    r.add_argument("--measure-forms", default="blocks,flex", help="the kernel's measure-phase forms to time (issue 49)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of CPU steps (default 1)")
    _add_sizes(r, LEASE)
    s = sub.add_parser("step", help=argparse.SUPPRESS)
    s.add_argument("name")
    s.add_argument("--rows", required=True)
    s.add_argument("--device", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--measure-forms", default="blocks,flex")
    s.add_argument("--shrink", action="store_true")
    for k, v in LEASE.items():
        if k != "device":
            s.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    b = sub.add_parser("bundle", help="write the wheels that travel, check the size")
    b.add_argument("--out", default=".gpu-bundle")
    i = sub.add_parser("install", help="on the GPU machine: the bundle's wheels the image lacks, into --target")
    i.add_argument("--bundle", default=".gpu-bundle")
    i.add_argument("--target", required=True)
    a = p.parse_args(argv)
    if a.cmd == "step":
        return run_step(a)
    if a.cmd == "bundle":
        return cmd_bundle(a)
    if a.cmd == "install":
        return cmd_install(a)
    sizes = DRY if a.dry_run else LEASE
    a.device = a.device or sizes["device"]
    for k, v in sizes.items():
        if k != "device" and getattr(a, k) is None:
            setattr(a, k, v)
    return cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
