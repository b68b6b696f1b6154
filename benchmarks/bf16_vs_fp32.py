"""bf16 against fp32 on this CPU (issue 50, item 3): the helper `benchmarks/bf16_vs_fp32.sh` runs.

    python benchmarks/bf16_vs_fp32.py step --out DIR        # one prefill + decode, unmodified and budgeted, per dtype
    python benchmarks/bf16_vs_fp32.py summary DIR --md FILE  # the committed table, from DIR's files

`step`: the embedded Qwen2.5-Coder-0.5B-Instruct in each dtype, on a passkey prompt of `--length` tokens (the quick
start's task, chat template included): ONE prefill of the whole prompt and `--steps` greedy decode steps (EOS
ignored, so both dtypes run the same number), for the unmodified model (transformers' cache) and for snapkv at
`--budget` on fxbudget's eager kernel (`backend=None`, the quick start's). Each is timed once after a short warm-up
forward; then one more budgeted run per dtype under `torch.profiler` gives where the time goes (self CPU time by op:
the model's own matmuls `aten::mm`/`addmm`/`bmm`/`linear` against the rest). Writes DIR/step.json.

`summary`: the quick grid's rows per dtype (DIR/quick_<dtype>/results.jsonl: the seconds of its rows, their
accuracy and likelihood cells side by side), DIR/step.json, the machine (DIR/cpu.txt: lscpu model and bf16 flags,
threads, versions, load before each part) and the wall seconds and peak RSS of each grid (DIR/quick_<dtype>.time,
`/usr/bin/time -v`), as one Markdown page.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import env_info, load_str  # noqa: E402
from benchlib.output import md_table  # noqa: E402

DTYPES = ("float32", "bfloat16")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def _prompt(tok, length: int):
    import torch

    from fxbudget.harness.tasks import make_samples
    from fxbudget.harness.tasks.prompt import chat_ids

    ctx, question = chat_ids(tok, make_samples("passkey", tok, length, 1, seed=0)[0])
    return torch.cat([ctx, question], dim=1)


def _decode(model, cache, logits, steps: int) -> None:
    """`steps` greedy decode steps from `logits`, EOS ignored (as `harness.measure.greedy` feeds them)."""
    import torch

    from fxbudget.cache.keyword import cache_kwargs, output_cache

    for _ in range(steps):
        tok = torch.tensor([[int(logits[0, -1].argmax())]])
        out = model(input_ids=tok, use_cache=True, logits_to_keep=1, **cache_kwargs(model.forward, cache))
        logits, cache = out.logits, output_cache(out)


def _one(model, ids, steps: int, budgeted: bool) -> dict:
    """Seconds of one prefill of `ids` and `steps` decode steps."""
    import torch

    from fxbudget.cache.keyword import output_cache

    with torch.no_grad():
        t0 = time.perf_counter()
        if budgeted:
            cache = model.forward.new_cache(1, prompt=ids.shape[1])
            out = model(input_ids=ids, cache=cache, logits_to_keep=1)
        else:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = output_cache(out)
        t1 = time.perf_counter()
        _decode(model, cache, out.logits, steps)
        t2 = time.perf_counter()
    return {"prefill_s": round(t1 - t0, 3), "decode_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3)}


def _profile(model, ids, steps: int) -> dict:
    """Self CPU seconds by op of one budgeted run, and the matmuls' share."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _one(model, ids, steps, budgeted=True)
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    total = sum(ops.values())
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
    mm = sum(s for k, s in ops.items() if k in MATMULS)
    return {"self_cpu_s": round(total, 3), "matmul_share": round(mm / total, 3) if total else None,
            "top": [[k, round(s, 3)] for k, s in top]}


def step(a) -> None:
    import torch

    import fxbudget
    from fxbudget.models import load_default

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"env": env_info("cpu"), "length": a.length, "steps": a.steps, "budget": a.budget, "dtypes": {}}
    for dtype in DTYPES:
        model, tok = load_default(dtype=dtype, progress=False)
        ids = _prompt(tok, a.length)
        entry = {"prompt_tokens": ids.shape[1], "load_before": load_str()}
        with torch.no_grad():
            model(input_ids=ids[:, :64], use_cache=True, logits_to_keep=1)  # warm-up: page the weights in
        entry["unmodified"] = _one(model, ids, a.steps, budgeted=False)
        model = fxbudget.compile(model, rule="snapkv", budget=a.budget, backend=None)
        entry["budgeted"] = _one(model, ids, a.steps, budgeted=True)
        entry["profile"] = _profile(model, ids, a.steps)
        entry["load_after"] = load_str()
        model.forward.restore()
        result["dtypes"][dtype] = entry
        print(dtype, json.dumps({k: entry[k] for k in ("unmodified", "budgeted")}), file=sys.stderr)
        del model
    (out / "step.json").write_text(json.dumps(result, indent=1) + "\n")


def _grid(folder: Path) -> dict:
    rows = [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines() if x.strip()]
    seconds = sum(r["prefill_s"] + r["decode_s"] + (r.get("likelihood_s") or 0.0) for r in rows)
    return {"rows": rows, "seconds": seconds}


def _time_file(path: Path) -> tuple[str, str]:
    """(wall clock, peak RSS MiB) from `/usr/bin/time -v`'s output."""
    text = path.read_text() if path.is_file() else ""
    wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return (wall.group(1) if wall else "n/a", f"{int(rss.group(1)) / 1024:.0f}" if rss else "n/a")


def summary(a) -> None:
    from fxbudget.harness.report import accuracy_table, likelihood_table

    d = Path(a.dir)
    step_ = json.loads((d / "step.json").read_text())
    grids = {dt: _grid(d / f"quick_{dt}") for dt in DTYPES}
    lines = ["# bf16 against fp32 on this CPU", "",
             "Written by `bash benchmarks/bf16_vs_fp32.sh` (`benchmarks/bf16_vs_fp32.py summary`); its files are in "
             f"`{d.as_posix()}/`.", "", "## Machine", "", "```", (d / "cpu.txt").read_text().strip(), "```", "",
             "## The quick start's grid in each dtype", "",
             "README's quick start (passkey at 1000 tokens, full, streamingllm, snapkv, tova at B=128, 2 samples, "
             "query-aware) with `--dtype float32` and `--dtype bfloat16`. Rows seconds: the sum over its rows of "
             "prefill, decode and likelihood seconds (the runner's timers; model load, fingerprints and report "
             "outside).", ""]
    f32, b16 = grids["float32"]["seconds"], grids["bfloat16"]["seconds"]
    table = [[dt, f"{grids[dt]['seconds']:.1f}", f"{grids[dt]['seconds'] / f32:.2f}x",
              *_time_file(d / f"quick_{dt}.time")] for dt in DTYPES]
    lines += md_table(["dtype", "rows s", "vs fp32", "wall (whole command)", "peak RSS MiB"], table) + [""]
    for dt in DTYPES:
        rows = grids[dt]["rows"]
        lines += [f"{dt}, accuracy:", "", accuracy_table(rows, "accuracy", by_setting=True), "",
                  f"{dt}, answer log-likelihood:", "", likelihood_table(rows, "accuracy", by_setting=True), ""]
    lines += ["## One prefill and its decode steps", "",
              f"One prefill of a {step_['dtypes']['float32']['prompt_tokens']}-token passkey prompt and "
              f"{step_['steps']} greedy decode steps (EOS ignored), timed once each: the unmodified model, and snapkv "
              f"at B={step_['budget']} on the eager kernel.", ""]
    rows = []
    for side in ("unmodified", "budgeted"):
        for part in ("prefill_s", "decode_s", "total_s"):
            v = {dt: step_["dtypes"][dt][side][part] for dt in DTYPES}
            rows.append([side, part.removesuffix("_s"), f"{v['float32']:.2f}", f"{v['bfloat16']:.2f}",
                         f"{v['bfloat16'] / v['float32']:.2f}x"])
    lines += md_table(["model", "part", "fp32 s", "bf16 s", "bf16 / fp32"], rows) + [""]
    lines += ["Where the budgeted run's time goes (torch.profiler, self CPU seconds by op; the model's matmuls are "
              f"{', '.join(MATMULS)}):", ""]
    prof = [[dt, f"{step_['dtypes'][dt]['profile']['self_cpu_s']:.2f}",
             f"{100 * (step_['dtypes'][dt]['profile']['matmul_share'] or 0):.0f}%",
             ", ".join(f"{k} {s:.2f}" for k, s in step_["dtypes"][dt]["profile"]["top"][:5])] for dt in DTYPES]
    lines += md_table(["dtype", "self CPU s", "matmuls", "top ops (s)"], prof) + [""]
    lines += [f"bf16 rows take {b16 / f32:.2f}x the fp32 rows' time on this machine (one run each, timed once: "
              "a guide, not a benchmark of record)."]
    Path(a.md).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.md}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step")
    s.add_argument("--out", required=True)
    s.add_argument("--length", type=int, default=1000)
    s.add_argument("--steps", type=int, default=32)
    s.add_argument("--budget", type=int, default=128)
    m = sub.add_parser("summary")
    m.add_argument("dir")
    m.add_argument("--md", required=True)
    a = p.parse_args()
    step(a) if a.cmd == "step" else summary(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
