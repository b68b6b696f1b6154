"""The H200 lease runs' measured numbers, and the predictions of benchmarks/gpu_cost.py beside them.

    python benchmarks/gpu_lease_report.py            # writes benchmarks/results/gpu_lease.md
    python benchmarks/gpu_lease_report.py --check    # exit 1 if the committed page differs from what it would write

Reads only committed files: each run folder under results/gpu_lease/ (`RUNS`: its rows file, its summary.md or
script for the steps' status), run 2's flex_check.txt, and gpu_cost.py's formulas with results/gpu_cost_inductor.json.
Nothing here runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LEASE = HERE / "results" / "gpu_lease"
PAGE = HERE / "results" / "gpu_lease.md"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# (folder, rows file, what the run was). Run 1 is `bash benchmarks/gpu.sh $OUT` (summary.md holds each step's status);
# run 2 is run2.sh (its steps' boxes are in the script; it kept no status file).
RUNS = [("2026-12-04-run1", "rows.jsonl", "the whole prepared run, `bash benchmarks/gpu.sh $OUT`"),
        ("2026-12-04-run2", "rows2.jsonl", "a focused rerun after the fixes of 85b65fa, `run2.sh` (in its folder)")]

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
    ("2026-12-04-run2", "spread"): "cut while compiling the rules (5-17 s each, 3 of 11 done): no timing row",
}


def load_rows(folder: str, name: str) -> list[dict]:
    return [json.loads(x) for x in (LEASE / folder / name).read_text().splitlines() if x.strip()]


def run1_status(folder: str) -> list[dict]:
    """Each step's status and seconds from the run's summary.md (gpu_lease.py's `_table`)."""
    out = []
    for line in (LEASE / folder / "summary.md").read_text().splitlines():
        m = re.match(r"\| ([a-z0-9-]+) \| (ok|failed|timed out|[a-z ]+) \| (\d+) \|", line)
        if m and m.group(1) != "step":
            out.append(dict(step=m.group(1), status=m.group(2), seconds=int(m.group(3))))
    return out


def script_status(folder: str, rows: list[dict]) -> list[dict]:
    """Steps of a run script (`step BOX NAME`) with no status file: finished when the step's last row is its `key`
    line (every step writes its key last), else stopped in its box."""
    out = []
    for m in re.finditer(r"^step (\d+) ([a-z0-9-]+)", (LEASE / folder / "run2.sh").read_text(), re.M):
        got = [r for r in rows if r["step"] == m.group(2)]
        done = bool(got) and got[-1]["kind"] == "key"
        out.append(dict(step=m.group(2), box=int(m.group(1)), status="finished" if done else "timed out"))
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
    import gpu_lease

    for folder, rows, status in ((f, runs[f]["rows"], runs[f]["status"]) for f in runs):
        for st in status:
            box = st.get("box", gpu_lease.BOXES.get(st["step"]))
            why = WHY.get((folder, st["step"]), "")
            lines.append(f"| {folder[-4:]} | {st['step']} | {box} | {st['status']} | {st.get('seconds', '-')} "
                         f"| {why} |")
    return lines


def prefill_section(rows: list[dict]) -> tuple[list[str], dict]:
    pre = [r for r in rows if r["kind"] == "prefill" and "seconds" in r]
    full = {r["tokens"]: r for r in pre if r["side"] == "full"}
    lines = ["| side | form | tokens | seconds | / unmodified | peak MB above weights | / unmodified |",
             "|---|---|---|---|---|---|---|"]
    got = {}
    for r in pre:
        f = full[r["tokens"]]
        side = "unmodified (SDPA flash/efficient)" if r["side"] == "full" else f"fxbudget {r['side']} kernel"
        first = r["form"] == "flex" and r["tokens"] == min(full)
        note = " (includes flex_attention's compile)" if first else ""
        lines.append(f"| {side} | {r['form']} | {_k(r['tokens'])} | {r['seconds']:.3f}{note} "
                     f"| {'-' if first else _r(r['seconds'] / f['seconds'])} | {r['peak_mb_above']:.0f} "
                     f"| {_r(r['peak_mb_above'] / f['peak_mb_above'])} |")
        got[(r["side"], r["form"], r["tokens"])] = r
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


def flex_check_section(folder: str) -> list[str]:
    text = [x for x in (LEASE / folder / "flex_check.txt").read_text().splitlines() if "warn" not in x.lower()]
    return ["`benchmarks/studies/flex_gpu_check.py --device cuda` (run 2, `flex_check.txt`), verbatim:", "",
            "```", *text, "```"]


def predicted_section(pre: dict, dec: dict) -> list[str]:
    """gpu_cost.py's predictions at the lease's 2 layers (its formulas with L = 2: its prefill ratios do not depend
    on L, both sides scale with it) beside the measured calls."""
    import gpu_cost

    layers = {r["layers"] for r in pre.values()} | {r["layers"] for r in dec.values()}
    assert len(layers) == 1, f"the measured rows disagree on the layer count: {layers}"
    L = layers.pop()
    s = dict(gpu_cost.shapes(), L=L)
    itab, _ = gpu_cost.inductor_table(gpu_cost.load_inductor(), s)
    comb = {(r["kind"], r["n"], r["S"], r["ref"]): r for r in gpu_cost.combined(gpu_cost.paper_rows(s), itab, s)}
    lines = [f"gpu_cost.py's formulas and Inductor counts at {L} layers of the Llama-3.1-8B config (the measured "
             "model), bf16, batch 1; predicted seconds are the whole model's (attention with the launch floor, "
             "plus the projections and MLP), as measured. The attention-only ratio is the bold column of "
             "[gpu_cost.md](gpu_cost.md)'s last table (the same at 32 layers).", "",
             "| call | measured side | predicted as | predicted s | measured s | measured / predicted "
             "| predicted ratio: attention only | predicted ratio: whole model | measured ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({k[2] for k in pre}):
        c = comb[("prefill", n, gpu_cost.PREFILL_BUDGET, n)]
        base = c["t_base_l"] + c["rest_l"]
        full = pre[("full", "-", n)]["seconds"]
        lines.append(f"| prefill {_k(n)} | unmodified (SDPA) | unmodified (flash) | {_s(base)} | {_s(full)} "
                     f"| {_r(full / base)} | 1 | 1 | 1 |")
        for form, t, as_ in (("blocks", c["t_today_i"], "today's form, Inductor-compiled"),
                             ("flex", c["t_fused_l"], "fused form (by hand)")):
            m = pre.get(("eager", form, n))
            if not m:
                continue
            first = form == "flex" and n == min(k[2] for k in pre)
            got = [f"{_s(m['seconds'])} (its compile)", "-", "-"] if first else \
                [_s(m["seconds"]), _r(m["seconds"] / (t + c["rest_l"])), _r(m["seconds"] / full)]
            lines.append(f"| prefill {_k(n)} | eager kernel, {form} | {as_} | {_s(t + c['rest_l'])} "
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
              "(the compiled side did not finish its cold compile in its box); the prediction for today's form is "
              "Inductor's fused kernels with Inductor's byte counts. The eager block form materializes more and "
              "launches more per block, and is furthest above the prediction at 128K. The flex form "
              "measured is the eager kernel around a torch.compile'd flex_attention (Inductor's flex templates), "
              "its rule and evict eager; the prediction is the fused form by hand.",
              "- **The flex form's timing is of a form whose `attn` is wrong on the H200** (Correctness): it computes "
              "the output right and is timed as run, but its signals are not verified there, so its speed is not "
              "yet a result about a correct kernel.",
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
    pre_lines, pre = prefill_section(all_rows)
    dec_lines, dec = decode_section(runs)
    comp = [r.get("compile_s", r.get("seconds_incl_compile", r.get("seconds"))) for r in all_rows
            if "compile_s" in r or r["kind"] in ("spread_compile", "kept_compiled_vs_eager")
            or (r["kind"] == "covering" and r["backend"] == "inductor")]
    lo, hi = min(comp), max(comp)
    fb = {n: pre[("eager", "blocks", n)]["seconds"] / pre[("eager", "flex", n)]["seconds"]
          for n in sorted({k[2] for k in pre})[1:]}
    out = ["# GPU lease runs on an H200 (measured)", "",
           "Written by `python benchmarks/gpu_lease_report.py` from the committed rows of two runs on one leased "
           "H200: " + "; ".join(f"[{f}](gpu_lease/{f}/) ({r['what']}; rows: `{r['name']}`)"
                                  for f, r in runs.items()) + ". Seeded random weights: correctness is against "
           "the same model unmodified, no accuracy. Both runs used the committed code of their day (run 1 before "
           "85b65fa, run 2 after); `measure=\"auto\"` has been the block form on every device since (f6dc7a3).", "",
           *env_section(all_rows), "",
           "## Steps", "", *steps_section(runs), "",
           "Run 2 kept no status file: a step counts as finished when its last row is its `key` line. "
           "The boxes are the seconds each step had (`benchmarks/gpu_lease.py`'s `BOXES` in run 1, run2.sh's in "
           f"run 2); the rows that time a cold compile (with its first run) took {lo:.1f}-{hi:.1f} s each ({len(comp)} "
           "rows: decode sides, the spread's rules, the compiled checks), and a step holds several: the compiled "
           "steps' boxes were too short for them.", "",
           "## Prefill (one call, Llama-3.1-8B config, 2 layers, bf16, batch 1, snapkv B = 1024)", "",
           *pre_lines, "",
           "Seconds of one call after a 64-token warm-up call (`benchmarks/long_context.py`'s `_Peak`); peak memory "
           "above the weights. The unmodified model runs SDPA restricted to its flash and efficient backends. The "
           "fxbudget rows are the eager kernel (`backend=None`); the compiled side timed out (Steps). The flex form "
           "against the block form: " + ", ".join(f"{v:.1f}x faster at {_k(n)}" for n, v in fb.items()) + " (its "
           "`attn` is wrong there: Correctness).", "",
           "## Decode (one token, same model)", "", *dec_lines, "",
           "fxbudget: snapkv at budget B over a full cache (every step evicts), Inductor with CUDA graphs; the "
           "unmodified model over the full cache at 32K / 128K tokens: DynamicCache uncompiled, StaticCache under "
           "`torch.compile(mode=\"reduce-overhead\")`. Run 1's decode failed after its DynamicCache rows (Steps).",
           "", "## Correctness", "", *correctness_section(runs), "",
           "The two rules that differ, h2o and observed_attention, are the two that read `attn`; on the GPU it came "
           "from the flex form (then `measure=\"auto\"`'s choice on CUDA). The Inductor side runs the block form, "
           "so Inductor vs eager disagrees on h2o for the same reason.", "",
           *flex_check_section("2026-12-04-run2"), "",
           "## Predicted vs measured", "", *predicted_section(pre, dec), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed page differs")
    a = ap.parse_args(argv)
    text = page()
    if a.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} differs from `python benchmarks/gpu_lease_report.py`")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
