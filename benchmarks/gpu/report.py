"""The H200 lease runs' measured numbers, and the predictions of benchmarks/gpu/cost.py beside them.

    python benchmarks/gpu/report.py            # writes benchmarks/results/gpu_lease.md
    python benchmarks/gpu/report.py --check    # exit 1 if the committed page differs from what it would write

Reads only committed files: each run folder under results/gpu_lease/ (`RUNS`: its rows file, its summary.md or
script for the steps' status, its flex checks' output), and gpu/cost.py's formulas with
results/gpu_cost_inductor.json. Nothing here runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # benchmarks/gpu
ROOT = HERE.parent.parent
LEASE = HERE.parent / "results" / "gpu_lease"
PAGE = HERE.parent / "results" / "gpu_lease.md"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# (folder, rows file, what the run was). Run 1 is `bash benchmarks/gpu/run.sh $OUT` (summary.md holds each step's status);
# runs 2-5 are the run*.sh in their folders (the steps' boxes are in the script; no status file).
RUNS = [("2026-12-04-run1", "rows.jsonl", "the whole prepared run, `bash benchmarks/gpu/run.sh $OUT`"),
        ("2026-12-04-run2", "rows2.jsonl", "a focused rerun after the fixes of 85b65fa, `run2.sh` (in its folder)"),
        ("2026-12-04-run3", "rows3.jsonl", "the folded flex form, `auto` = flex on CUDA, `run3.sh`"),
        ("2026-12-04-run4", "rows4.jsonl", "which part of the flex form goes wrong, `run4.sh`"),
        ("2026-12-04-run5", "rows5.jsonl", "the flex form with contiguous block lists, `run5.sh`")]
# The flex form each run timed and checked (the code of its day: the runs ran uncommitted trees, described here).
FLEX_FORM = {
    "2026-12-04-run1": "77df3c1's (enable_gqa, block lists strided)",
    "2026-12-04-run2": "77df3c1's (enable_gqa, block lists strided)",
    "2026-12-04-run3": "folded queries, block lists strided, V' a view of the keys",
    "2026-12-04-run4": "folded queries, block lists strided, V' zeros",
    "2026-12-04-run5": "67e359b's, except that the mask read the positions through their `cat`",
}

# Why a step stopped, from its rows and log (hand-written: the rows say where it stopped, not why).
WHY = {
    ("2026-12-04-run1", "correct-fp32"): "its eager checks done (23 rules' kept sets), cut in the Inductor "
                                         "compile of the covering check",
    ("2026-12-04-run1", "correct-bf16"): "cut in the kept-set comparison (9 of 23 rules, each run on the GPU and "
                                         "on the CPU)",
    ("2026-12-04-run1", "fingerprint"): "cut after 3 of 23 rules (2.5-6.7 s each: a trace per rule)",
    ("2026-12-04-run1", "tests"): "no row: `pytest -m cuda` had not finished (no output in log.txt)",
    ("2026-12-04-run1", "prefill-compiled"): "no row: its first compiled calls (the 64-token warm-up, then 8K) had "
                                             "not finished",
    ("2026-12-04-run1", "decode"): "CUDA graphs: the next layer's replay overwrote a region's outputs (fixed in "
                                   "85b65fa: fxbudget/compiler/regions.py clones them)",
    ("2026-12-04-run1", "spread"): "'cuda' vs 'cuda:0' in the output projection's device check (fixed in 85b65fa: "
                                   "fxbudget/cache/budget_cache.py)",
    ("2026-12-04-run2", "spread"): "timed out while compiling the rules (5-17 s each, 3 of 11 done): no timing row",
    ("2026-12-04-run2", "decode"): "",
    ("2026-12-04-run3", "prefill-eager"): "failed: Dynamo 'sources must not be empty for symbol s81' in the compiled "
                                          "flex call (the transposed call's values were a view of its keys: two "
                                          "aliasing inputs; zeros of their own since run 4)",
    ("2026-12-04-run3", "prefill-compiled"): "failed: Inductor 2.11 cannot inline the `masked` loads of the "
                                             "positions' `cat` into flex's mask_mod ('function' object has no "
                                             "attribute 'graph'); fixed after run 5 (`flex_measure.kpos_at`), "
                                             "checked by the codegen leg, not on a GPU",
    ("2026-12-04-run3", "correct-fp32"): "failed: the same Dynamo error as prefill-eager, in the covering check",
    ("2026-12-04-run4", "prefill-compiled"): "failed: the same Inductor 2.11 error as run 3",
}


def load_rows(folder: str, name: str) -> list[dict]:
    return [json.loads(x) for x in (LEASE / folder / name).read_text().splitlines() if x.strip()]


# The steps' boxes when run 1 ran: lease.py's BOXES of then (`git show f6dc7a3^:benchmarks/gpu_lease.py`); today's
# BOXES are rebalanced for today's steps, so they would not say what run 1 had.
RUN1_BOXES = {"env": 15, "correct-fp32": 65, "correct-bf16": 50, "fingerprint": 30, "tests": 40, "prefill-full": 25,
              "prefill-eager": 80, "prefill-compiled": 70, "decode": 65, "spread": 40}


def run1_status(folder: str) -> list[dict]:
    """Each step's status and seconds from the run's summary.md (gpu/lease.py's `_table`), and its box then."""
    out = []
    for line in (LEASE / folder / "summary.md").read_text().splitlines():
        m = re.match(r"\| ([a-z0-9-]+) \| (ok|failed|timed out|[a-z ]+) \| (\d+) \|", line)
        if m and m.group(1) != "step":
            out.append(dict(step=m.group(1), status=m.group(2), seconds=int(m.group(3)), box=RUN1_BOXES[m.group(1)]))
    return out


def script_status(folder: str, rows: list[dict]) -> list[dict]:
    """Steps of a run script (`step BOX NAME` in its run*.sh) with no status file: finished when the step's last row
    is its `key` line (every step writes its key last), else stopped (failed or timed out: `WHY` says which)."""
    out = []
    script = next((LEASE / folder).glob("run*.sh"))
    for m in re.finditer(r"^step (\d+) ([a-z0-9-]+)", script.read_text(), re.M):
        got = [r for r in rows if r["step"] == m.group(2)]
        done = bool(got) and got[-1]["kind"] == "key"
        out.append(dict(step=m.group(2), box=int(m.group(1)), status="finished" if done else "stopped"))
    return out


def _k(n: int) -> str:
    return f"{n // 1024}K"


def _r(x: float) -> str:
    return f"{x:.2f}x"


def _s(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 0.01 else f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"



def env_section(rows: list[dict]) -> list[str]:
    e = next(r for r in rows if r["kind"] == "env")
    return [f"Machine: {e['gpu']} (compute capability {e['capability']}, {e['total_gib']} GiB, {e['free_gib']} GiB "
            f"free at the start), CUDA {e['cuda']}; torch {e['torch']}, transformers {e['transformers']} (from the "
            f"lease bundle), Triton {e['triton']}, Python {e['python']} (the `env` row of run 1)."]


def steps_section(runs: dict) -> list[str]:
    lines = ["| run | step | box (s) | status | seconds | why |", "|---|---|---|---|---|---|"]
    for folder, rows, status in ((f, runs[f]["rows"], runs[f]["status"]) for f in runs):
        for st in status:
            box = st["box"]
            why = WHY.get((folder, st["step"]), "")
            lines.append(f"| {folder[-4:]} | {st['step']} | {box} | {st['status']} | {st.get('seconds', '-')} "
                         f"| {why} |")
    return lines


def _full(runs: dict) -> dict:
    """Per run, its unmodified prefill rows by length (empty for a run that timed none)."""
    return {f: {r["tokens"]: r for r in runs[f]["rows"] if r["kind"] == "prefill" and r["side"] == "full"
                and "seconds" in r} for f in runs}


def full_for(runs: dict, folder: str) -> tuple[str, dict]:
    """The unmodified rows a run's prefill rows are divided by: its own, else those of the latest earlier run that
    timed them (the same machine kind and image; not side by side: `prefill_section` marks them)."""
    full = _full(runs)
    names = list(runs)
    ref = folder if full[folder] else [f for f in names[:names.index(folder)] if full[f]][-1]
    return ref, full[ref]


def prefill_section(runs: dict) -> tuple[list[str], dict]:
    lines = ["| run | side | form | tokens | seconds | / unmodified | peak MB above weights | / unmodified |",
             "|---|---|---|---|---|---|---|---|"]
    got = {}
    for f in runs:
        ref, full = full_for(runs, f)
        mark = "" if ref == f else f" (vs {ref[-4:]})"
        for r in (r for r in runs[f]["rows"] if r["kind"] == "prefill" and "seconds" in r):
            fr = full[r["tokens"]]
            side = "unmodified (SDPA flash/efficient)" if r["side"] == "full" else f"fxbudget {r['side']} kernel"
            first = r["form"] == "flex" and r["tokens"] == min(full)
            note = " (includes flex_attention's compile)" if first else ""
            lines.append(f"| {f[-4:]} | {side} | {r['form']} | {_k(r['tokens'])} | {r['seconds']:.3f}{note} "
                         f"| {'-' if first else _r(r['seconds'] / fr['seconds']) + mark} | {r['peak_mb_above']:.0f} "
                         f"| {_r(r['peak_mb_above'] / fr['peak_mb_above'])}{mark} |")
            got[(f, r["side"], r["form"], r["tokens"])] = r
    return lines, got


def decode_section(runs: dict) -> tuple[list[str], dict]:
    lines = ["| run | side | form | ms per step (median of 20) | / StaticCache 32K | / StaticCache 128K "
             "| compile s | CUDA graphs |", "|---|---|---|---|---|---|---|---|"]
    got = {}
    for folder in runs:
        dec = [r for r in runs[folder]["rows"] if r["kind"] == "decode"]
        static = {int(r["side"].split()[1]): r["ms"] for r in dec if r["side"].startswith("StaticCache")}
        for r in dec:
            vs = [_r(r["ms"] / static[c]) if c in static else "-" for c in (32768, 131072)]
            lines.append(f"| {folder[-4:]} | {r['side']} | {r['form']} | {r['ms']:.2f} | {vs[0]} | {vs[1]} "
                         f"| {r.get('compile_s', '-')} | {'yes' if r.get('cudagraphs') else 'no'} |")
            if static:
                got[r["side"]] = r
    return lines, got


def correctness_section(runs: dict) -> list[str]:
    lines = ["| run | step | check | verdict | detail |", "|---|---|---|---|---|"]
    for folder in runs:
        for r in runs[folder]["rows"]:
            if r["kind"] == "check":
                lines.append(f"| {folder[-4:]} | {r['step']} | {r['what']} | {'ok' if r['ok'] else 'FAILED'} "
                             f"| {r['detail']} |")
    kept = [(f, r) for f in runs for r in runs[f]["rows"] if r["kind"] in ("kept_device_vs_cpu",
                                                                           "kept_compiled_vs_eager")]
    fp32 = [r for f, r in kept if f.endswith("run1") and r["dtype"] == "float32" and r["kind"] == "kept_device_vs_cpu"]
    same_pre = [r["rule"] for r in fp32 if r["prefill_mean"] == 1.0]
    same = [r["rule"] for r in fp32 if r["prefill_mean"] == 1.0 and r["decode_mean"] == 1.0]
    lines += ["", f"Kept sets on the GPU against the CPU, float32, run 1: identical after the prefill for "
              f"{len(same_pre)} of {len(fp32)} rules, after the prefill and every decode step for {len(same)}. "
              "Every other kept-set row (run 1's float32 rows that differ, the bf16 step's 9 rules before its cut, "
              "run 2's) follows; 'unexplained' counts differing heads with no exact or near tie at the cut:", "",
              "| run | comparison | dtype | rule | prefill mean (min) | decode mean | heads differing "
              "(unexplained) | tokens agree |", "|---|---|---|---|---|---|---|---|"]
    for f, r in kept:
        if f.endswith("run1") and r["dtype"] == "float32" and r["rule"] in same:
            continue
        comp = "GPU vs CPU" if r["kind"] == "kept_device_vs_cpu" else "Inductor vs eager (GPU)"
        unexp = r.get("unexplained", "-")
        lines.append(f"| {f[-4:]} | {comp} | {r['dtype']} | {r['rule']} | {r['prefill_mean']:.4f} "
                     f"({r['prefill_min']:.4f}) | {r['decode_mean']:.4f} | {r['heads_differing']} ({unexp}) "
                     f"| {'yes' if r['tokens_agree'] else 'no'} |")
    fps = [r for f in runs for r in runs[f]["rows"] if r["kind"] == "fingerprint"]
    if fps:
        lines += ["", f"Kernel fingerprints on the GPU: {', '.join(r['rule'] for r in fps)}: "
                  f"{', '.join(sorted({r['fingerprint'] for r in fps}))} ({len({r['fingerprint'] for r in fps})} "
                  "distinct; the step was cut after these)."]
    return lines


def _spread(runs: dict) -> str:
    """The largest relative difference between runs' unmodified prefill timings at the same length."""
    full = [x for x in _full(runs).values() if x]
    worst = max(abs(a[n]["seconds"] / b[n]["seconds"] - 1) for a in full for b in full for n in a if n in b)
    return f"{worst:.1%}"


# The flex checks' outputs kept verbatim: (run, file, the script that wrote it).
CHECKS = [("2026-12-04-run2", "flex_check.txt", "benchmarks/studies/flex_gpu_check.py"),
          ("2026-12-04-run3", "flex_check.txt", "benchmarks/studies/flex_gpu_check.py"),
          ("2026-12-04-run4", "transposed.txt", "benchmarks/studies/flex_transposed_check.py"),
          ("2026-12-04-run4", "flex_check.txt", "benchmarks/studies/flex_gpu_check.py"),
          ("2026-12-04-run5", "flex_check.txt", "benchmarks/studies/flex_gpu_check.py")]
_CHECK_LINE = re.compile(r"^(torch \d|raw|first|ours|torchmask|nomod|dense|dynamic|prefill|chunk|sliding|pool|worst)")


def flex_check_section(folder: str, name: str, script: str) -> list[str]:
    text = [x for x in (LEASE / folder / name).read_text().splitlines() if _CHECK_LINE.match(x)]
    return [f"`{script} --device cuda` ({folder[-4:]}, flex form: {FLEX_FORM[folder]}; `{name}`, its result lines "
            "verbatim):", "", "```", *text, "```"]


def attn_ratio(folder: str, case: str = "prefill") -> str:
    """A case's `sum(attn) flex/blocks` in a run's flex_check.txt, as printed."""
    text = (LEASE / folder / "flex_check.txt").read_text()
    return re.search(rf"^{case}: .*sum\(attn\) flex/blocks ([0-9.]+)$", text, re.M).group(1)


# The run whose prefill rows of each form stand beside the prediction: the block form's only timing (run 1), the flex
# form's verified one (run 5, divided by run 3's unmodified rows: `full_for`).
PREDICTED_RUNS = {"blocks": "2026-12-04-run1", "flex": "2026-12-04-run5"}


def predicted_section(runs: dict, pre: dict, dec: dict) -> list[str]:
    """gpu/cost.py's predictions at the lease's 2 layers (its formulas with L = 2: its prefill ratios do not depend
    on L, both sides scale with it) beside the measured calls."""
    import cost as gpu_cost

    layers = {r["layers"] for r in pre.values()} | {r["layers"] for r in dec.values()}
    assert len(layers) == 1, f"the measured rows disagree on the layer count: {layers}"
    L = layers.pop()
    s = dict(gpu_cost.shapes(), L=L)
    itab, _ = gpu_cost.inductor_table(gpu_cost.load_inductor(), s)
    comb = {(r["kind"], r["n"], r["S"], r["ref"]): r for r in gpu_cost.combined(gpu_cost.paper_rows(s), itab, s)}
    lines = [f"gpu/cost.py's formulas and Inductor counts at {L} layers of the Llama-3.1-8B config (the measured "
             "model), bf16, batch 1; predicted seconds are the whole model's (attention with the launch floor, "
             "plus the projections and MLP), as measured. The attention-only ratio is the bold column of "
             "[gpu_cost.md](gpu_cost.md)'s last table (the same at 32 layers).", "",
             "| call | measured side | predicted as | predicted s | measured s | measured / predicted "
             "| predicted ratio: attention only | predicted ratio: whole model | measured ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    lengths = sorted({k[3] for k in pre})
    for n in lengths:
        c = comb[("prefill", n, gpu_cost.PREFILL_BUDGET, n)]
        base = c["t_base_l"] + c["rest_l"]
        for ref in sorted({full_for(runs, f)[0] for f in PREDICTED_RUNS.values()}):
            full = pre[(ref, "full", "-", n)]["seconds"]
            lines.append(f"| prefill {_k(n)} | unmodified (SDPA), {ref[-4:]} | unmodified (flash) | {_s(base)} "
                         f"| {_s(full)} | {_r(full / base)} | 1 | 1 | 1 |")
        for form, t, as_ in (("blocks", c["t_today_i"], "today's form, Inductor-compiled"),
                             ("flex", c["t_fused_l"], "fused form (by hand)")):
            run = PREDICTED_RUNS[form]
            m = pre.get((run, "eager", form, n))
            if not m:
                continue
            full = pre[(full_for(runs, run)[0], "full", "-", n)]["seconds"]
            first = form == "flex" and n == lengths[0]
            got = [f"{_s(m['seconds'])} (its compile)", "-", "-"] if first else \
                [_s(m["seconds"]), _r(m["seconds"] / (t + c["rest_l"])), _r(m["seconds"] / full)]
            lines.append(f"| prefill {_k(n)} | eager kernel, {form}, {run[-4:]} | {as_} | {_s(t + c['rest_l'])} "
                         f"| {got[0]} | {got[1]} | {_r(t / c['t_base_l'])} | {_r((t + c['rest_l']) / base)} "
                         f"| {got[2]} |")
    for ctx in (32768, 131072):
        st = dec.get(f"StaticCache {ctx}")
        for B in (1024, 4096):
            fx = dec.get(f"fxbudget B={B}")
            c = comb.get(("decode", 1, B, ctx))
            if not (st and fx and c):
                continue
            base = c["t_base_l"] + c["rest_l"]
            if B == 1024:
                lines.append(f"| decode {_k(ctx)} | StaticCache, reduce-overhead | unmodified (flash) | {_s(base)} "
                             f"| {_s(st['ms'] / 1e3)} | {_r(st['ms'] / 1e3 / base)} | 1 | 1 | 1 |")
            t = c["t_today_i"] + c["rest_l"]
            lines.append(f"| decode B={B} vs {_k(ctx)} | fxbudget, Inductor + CUDA graphs | today's form, "
                         f"Inductor-compiled | {_s(t)} | {_s(fx['ms'] / 1e3)} | {_r(fx['ms'] / 1e3 / t)} "
                         f"| {_r(c['t_today_i'] / c['t_base_l'])} | {_r(t / base)} | {_r(fx['ms'] / st['ms'])} |")
    p_layers = L * s["layer_params"] * 2 / 1e9
    p_head = s["embed_params"] * 2 / 1e9
    lines += ["", "What differs between the two:", "",
              f"- **{L} layers, not 32.** A prefill's ratios do not depend on the layer count (every term of both "
              "sides scales with it; the LM head runs on one token), so gpu_cost.md's 32-layer ratios are these; "
              f"its seconds are not. A decode step's do: at {L} layers it reads {p_layers:.2f} GB of layer weights "
              f"and {p_head:.2f} GB of LM head, so the rest of the model weighs more against attention than at "
              "32 layers; the rows above use the 2-layer whole-model prediction.",
              "- **The eager kernel, not the compiled one.** The measured prefill sides are fxbudget's eager kernel "
              "(the compiled side never finished: run 1 timed out in its cold compile, runs 3-4 failed to lower the flex "
              "form on torch 2.11, Steps); the prediction for today's form is "
              "Inductor's fused kernels with Inductor's byte counts. The eager block form materializes more and "
              "launches more per block, and is furthest above the prediction at 128K. The flex form "
              "measured is the eager kernel around a torch.compile'd flex_attention (Inductor's flex templates), "
              "its rule and evict eager; the prediction is the fused form by hand.",
              "- **Not side by side for the flex form.** Run 5 timed the verified flex form only; its ratio divides "
              "by run 3's unmodified rows (another machine start of the same kind and image, the same script). Runs "
              "1 and 3 timed the unmodified model within " + _spread(runs) + " of each other at every length.",
              "- **Decode** is compiled on both sides (fxbudget: Inductor and CUDA graphs; the unmodified side: "
              "StaticCache under `torch.compile(mode=\"reduce-overhead\")`), as predicted; the prediction's launch "
              f"floor is {gpu_cost.LAUNCH_S * 1e6:g} us per kernel (an assumption)."]
    return lines


def page() -> str:
    runs = {}
    for folder, name, what in RUNS:
        rows = load_rows(folder, name)
        status = run1_status(folder) if (LEASE / folder / "summary.md").exists() else script_status(folder, rows)
        runs[folder] = dict(rows=rows, status=status, what=what, name=name)
    all_rows = [r for f in runs for r in runs[f]["rows"]]
    pre_lines, pre = prefill_section(runs)
    dec_lines, dec = decode_section(runs)
    comp = [r.get("compile_s", r.get("seconds_incl_compile", r.get("seconds"))) for r in all_rows
            if "compile_s" in r or r["kind"] in ("spread_compile", "kept_compiled_vs_eager")
            or (r["kind"] == "covering" and r["backend"] == "inductor")]
    lo, hi = min(comp), max(comp)
    fb = {n: pre[(PREDICTED_RUNS["blocks"], "eager", "blocks", n)]["seconds"]
          / pre[(PREDICTED_RUNS["flex"], "eager", "flex", n)]["seconds"] for n in sorted({k[3] for k in pre})[1:]}
    out = ["# GPU lease runs on an H200 (measured)", "",
           f"Written by `python benchmarks/gpu/report.py` from the committed rows of {len(runs)} runs on leased "
           "H200s (two sessions' leases, one machine start per run): "
           + "; ".join(f"[{f}](gpu_lease/{f}/) ({r['what']}; rows: `{r['name']}`)" for f, r in runs.items())
           + ". Seeded random weights: correctness is against the same model unmodified, no accuracy. Runs 1-2 "
           "used the committed code of their day (run 1 before 85b65fa, run 2 after); runs 3-5 ran the working tree "
           "on the way to 67e359b (their flex forms: `FLEX_FORM` in the script, and the check sections below). "
           "Since 67e359b `measure=\"auto\"` is the flex form on CUDA.", "",
           *env_section(all_rows), "",
           "## Steps", "", *steps_section(runs), "",
           "Runs 2-5 kept no status file: a step counts as finished when its last row is its `key` line. "
           "The boxes are the seconds each step had (`benchmarks/gpu/lease.py`'s `BOXES` of then in run 1, the "
           f"run*.sh's in runs 2-5); the rows that time a cold compile (with its first run) took {lo:.1f}-{hi:.1f} s each ({len(comp)} "
           "rows: decode sides, the spread's rules, the compiled checks), and a step holds several: the compiled "
           "steps' boxes were too short for them.", "",
           "## Prefill (one call, Llama-3.1-8B config, 2 layers, bf16, batch 1, snapkv B = 1024)", "",
           *pre_lines, "",
           "Seconds of one call after a 64-token warm-up call (`benchmarks/long_context.py`'s `_Peak`); peak memory "
           "above the weights. The unmodified model runs SDPA restricted to its flash and efficient backends. The "
           "fxbudget rows are the eager kernel (`backend=None`) around a compiled flex_attention; the compiled "
           "kernel never finished on the GPU (Steps: run 1 timed out, runs 3-4 failed to lower). A ratio marked "
           "(vs runX) divides by that run's unmodified rows: its own run timed none. The flex forms differ by run "
           "(`FLEX_FORM`): run 1's and run 4's `attn` was wrong, run 5's is verified (Correctness). Run 5's flex "
           "form against run 1's block form: " + ", ".join(f"{v:.1f}x faster at {_k(n)}" for n, v in fb.items())
           + ".", "",
           "## Decode (one token, same model)", "", *dec_lines, "",
           "fxbudget: snapkv at budget B over a full cache (every step evicts), Inductor with CUDA graphs; the "
           "unmodified model over the full cache at 32K / 128K tokens: DynamicCache uncompiled, StaticCache under "
           "`torch.compile(mode=\"reduce-overhead\")`. Run 1's decode failed after its DynamicCache rows (Steps).",
           "", "## Correctness", "", *correctness_section(runs), "",
           "The two rules that differ in runs 1-2, h2o and observed_attention, are the two that read `attn`; on the "
           "GPU it came from the flex form (then `measure=\"auto\"`'s choice on CUDA). The Inductor side runs the "
           "block form, so Inductor vs eager disagrees on h2o for the same reason. Run 3's kept-set check failed "
           "before its first comparison (Steps); after the fix no kept-set check ran on a GPU (no device time "
           "left): the flex checks below are the GPU evidence.", "",
           "### The flex form on the H200", "",
           "Runs 3-4 kept `attn` wrong after folding the queries (no `enable_gqa`): the ratio of run 2, "
           f"{attn_ratio('2026-12-04-run2')}, came "
           "back unchanged. Run 4's transposed-call check located it: with the form's own block mask the column "
           "log-sum-exps are wrong (`ours`, and `nomod` without the score_mod), with torch's `create_block_mask` of "
           "the same mask_mod or with no block mask they are exact (`torchmask`, `dense`). The form's lists came "
           "from an argsort over a transposed view: strided tensors, which the GPU kernel reads at row-major "
           "offsets (flex's CPU path applies the mask_mod everywhere and never reads them). Run 5, with contiguous "
           "lists, is exact in every case, each compiled (the check raises Dynamo's recompile limit; in run 3 the "
           "last two cases had fallen back to flex's eager path past it, which is why they passed there).", "",
           *[x for c in CHECKS for x in (*flex_check_section(*c), "")],
           "## Predicted vs measured", "", *predicted_section(runs, pre, dec), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed page differs")
    a = ap.parse_args(argv)
    text = page()
    if a.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} differs from `python benchmarks/gpu/report.py`")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
