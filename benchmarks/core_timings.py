"""Core timings on the embedded model: compile cost cold and warm, and a decode step against transformers' own cache.

    OMP_NUM_THREADS=1 python benchmarks/core_timings.py            # full run (~10 min on 2 CPU cores)
    OMP_NUM_THREADS=1 python benchmarks/core_timings.py --quick    # smoke run: budget 64, 128-token prompt, 5 steps

1. Compile: `fxbudget.compile(..., backend="inductor")` (snapkv, prefill chunks of `--chunk`), the first prefill (one
   chunk graph) and the first decode step, each in a fresh process; both processes share one new Inductor cache
   directory, so the first is cold and the second warm.
2. Decode step after the prompt (second process): fxbudget compiled, fxbudget's eager kernel, and the model's own
   forward with transformers' full DynamicCache (no eviction); interleaved steps, median and interquartile range, and
   the per-step ratio to the compiled path.
Layer-level kernel costs are in `overhead.py` (vs plain SDPA) and `compiled_vs_eager.py`; this script does not repeat
them. The report holds only what this run measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchlib.env import ROOT, env_info, header_lines, load_str, setup_threads, tune_malloc
from benchlib.timing import fmt_ratio, interleaved, paired_ratio, quartiles
from benchlib.output import emit, md_table


def _child(budget: int, chunk: int, prompt: int, steps: int) -> dict:
    """One fresh process: compile times and (if `steps`) interleaved decode steps on the embedded model."""
    import torch

    import fxbudget
    from fxbudget.cache.keyword import output_cache
    from fxbudget.harness.tasks import chat_ids, passkey
    from fxbudget.models import load_default

    model, tok = load_default(progress=False)
    ids = torch.cat(chat_ids(tok, passkey(tok, prompt, seed=0)), dim=1)[:, :prompt]
    res = {"prompt_tokens": ids.shape[1]}
    with torch.no_grad():
        compiled = fxbudget.compile(model, rule="snapkv", budget=budget, chunk_size=chunk, backend="inductor").forward
        t = time.perf_counter()
        out = compiled(input_ids=ids)
        res["compile_prefill_s"] = time.perf_counter() - t
        c_cache, tok_ = output_cache(out), out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        compiled(input_ids=tok_, past_key_values=c_cache)
        res["compile_decode_s"] = time.perf_counter() - t
        if not steps:
            return res
        # A second copy for the eager kernel; transformers runs that copy's own forward (`.original`: SDPA over its
        # full DynamicCache, no mask in a decode step, as with attn_implementation="sdpa"). Two copies stay alive,
        # never three: ~2 GB each.
        other, _ = load_default(progress=False)
        eager = fxbudget.compile(other, rule="snapkv", budget=budget, chunk_size=chunk, backend=None).forward
        e_cache = output_cache(eager(input_ids=ids))
        hf_cache = output_cache(eager.original(input_ids=ids, use_cache=True))
        t = interleaved({"compiled": lambda: compiled(input_ids=tok_, past_key_values=c_cache),
                         "eager_kernel": lambda: eager(input_ids=tok_, past_key_values=e_cache),
                         "transformers": lambda: eager.original(input_ids=tok_, past_key_values=hf_cache,
                                                                use_cache=True)},
                        steps, warmup=2)
    res["steps_s"] = t
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=256, help="budget (default 256)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size (default 256)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--steps", type=int, default=12, help="interleaved decode steps (default 12)")
    p.add_argument("--quick", action="store_true", help="smoke run: budget 64, chunk 64, 128-token prompt, 5 steps")
    p.add_argument("--out", default=None, help="markdown output (default benchmarks/results/core_timings.md; "
                                               "--quick writes nothing unless given)")
    p.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)
    args = p.parse_args()
    setup_threads(1)
    tune_malloc()
    if args.quick:
        args.budget, args.chunk, args.prompt, args.steps = 64, 64, 128, 5
    if args.child:
        res = _child(args.budget, args.chunk, args.prompt, args.steps if args.child == "warm" else 0)
        print(json.dumps(res))
        return 0

    info = env_info("cpu")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="fxbudget_inductor_"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)}
    runs = {}
    for phase in ("cold", "warm"):
        print(f"{phase} process...", flush=True)
        cmd = [sys.executable, __file__, "--child", phase, "--budget", str(args.budget), "--chunk", str(args.chunk),
               "--prompt", str(args.prompt), "--steps", str(args.steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.stderr.write(out.stderr)
            return out.returncode
        runs[phase] = json.loads(out.stdout.strip().splitlines()[-1])
        print(" ", {k: v for k, v in runs[phase].items() if k != "steps_s"}, flush=True)

    warm = runs["warm"]
    lines = header_lines("Core timings on the embedded model", info, load_after=load_str())
    lines += [f"Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF dequantized to fp32), 24 layers; snapkv, budget "
              f"{args.budget}, prefill chunks of {args.chunk}, a {warm['prompt_tokens']}-token prompt.", "",
              "## Compile (first call of each graph, a fresh process each; shared new Inductor cache)", ""]
    lines += md_table(["", "prefill-chunk graph (s)", "decode graph (s)"],
                      [[f"{phase} ({'empty cache' if phase == 'cold' else 'cache from the cold process'})",
                        runs[phase]["compile_prefill_s"], runs[phase]["compile_decode_s"]] for phase in runs])
    steps = warm["steps_s"]
    names = {"compiled": "fxbudget, Inductor", "eager_kernel": "fxbudget, eager kernel",
             "transformers": "transformers, full DynamicCache (no eviction)"}
    rows = []
    for key, name in names.items():
        q = quartiles([1e3 * x for x in steps[key]])
        ratio = fmt_ratio(paired_ratio(steps[key], steps["compiled"]))
        rows.append([name, f"{q[1]:.1f} [{q[0]:.1f}-{q[2]:.1f}]", ratio])
    lines += ["", f"## Decode step after the prompt ({len(steps['compiled'])} interleaved steps; median "
              "[interquartile range]; ratio: per-step ratio to the compiled path, median [interquartile range])", ""]
    lines += md_table(["path", "ms / step", "vs compiled"], rows)
    emit(lines, args.out, args.quick, "core_timings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
