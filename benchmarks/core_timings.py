"""Core timings: compile cost on the embedded model, decode step eager vs compiled, budget attention vs plain SDPA.

    OMP_NUM_THREADS=1 python benchmarks/core_timings.py [--out benchmarks/results/core_timings.md]

1. Cold and warm compile of the embedded model (snapkv, budget 256, prefill chunk 256): each measured in a fresh
   process sharing one new Inductor cache directory (first process = cold, second = warm).
2. Decode step on the embedded model after a 512-token prefill: unmodified transformers (DynamicCache), fxbudget's
   eager kernel, fxbudget compiled with Inductor; interleaved steps, medians.
3. Layer level, decode with a full cache: compiled budget attention (the fxbudget pass + Inductor, snapkv) vs
   compiled plain SDPA over a static cache of the same size (index_copy_ write + SDPA, the ideal that never evicts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def _model_phase(measure_steps: bool) -> dict:
    """Runs in a child process: compile times (and decode-step timings if asked) on the embedded model."""
    import fxbudget
    from fxbudget.cache_arg import cache_name, output_cache
    from fxbudget.harness.tasks import chat_ids, passkey
    from fxbudget.models import load_default

    model, tok = load_default(progress=False)
    sample = passkey(tok, 500, seed=0)
    ids = torch.cat(chat_ids(tok, sample), dim=1)[:, :512]
    res = {}
    with torch.no_grad():
        m = fxbudget.compile(model, rule="snapkv", budget=256, chunk_size=256, backend="inductor")
        m_forward = m.forward
        t = time.perf_counter()
        out = m(input_ids=ids)  # two chunks of 256: one graph
        res["compile_prefill_s"] = time.perf_counter() - t
        cache = output_cache(out)
        t = time.perf_counter()
        out = m(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)
        res["compile_decode_s"] = time.perf_counter() - t
        if not measure_steps:
            return res
        tok_ = out.logits[:, -1:].argmax(-1)
        compiled = m_forward  # the compiled wrapper stays callable after the model is restored
        model.forward.restore()
        eager = fxbudget.compile(model, rule="snapkv", budget=256, chunk_size=256, backend=None).forward
        model.forward.restore()
        e_cache = output_cache(eager(input_ids=ids))
        hf_cache = output_cache(model(input_ids=ids, use_cache=True))
        steps = {"compiled": [], "eager_kernel": [], "transformers": []}
        # The cache keyword each callee declares (`cache` from transformers 5.24), looked up outside the timing.
        names = {"compiled": cache_name(compiled), "eager_kernel": cache_name(eager),
                 "transformers": cache_name(model.forward)}
        for _ in range(15):  # interleaved, so all three see the same machine state
            for name, fn, c in (("compiled", compiled, cache), ("eager_kernel", eager, e_cache),
                                ("transformers", model, hf_cache)):
                t = time.perf_counter()
                fn(input_ids=tok_, use_cache=True, **{names[name]: c})
                steps[name].append(time.perf_counter() - t)
        res.update({f"decode_{k}_ms": 1e3 * statistics.median(v[3:]) for k, v in steps.items()})
    return res


class _Layer(torch.nn.Module):
    """Attention only: the new token's K/V go through the cache, SDPA attends (GQA 7:1 like the embedded model)."""

    def forward(self, q, k, v, past_key_values):
        keys, values = past_key_values.update(k, v, 0)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


def _static_sdpa(q, k, v, K, V, idx):
    K.index_copy_(2, idx, k)
    V.index_copy_(2, idx, v)
    return F.scaled_dot_product_attention(q, K, V, enable_gqa=True)


def _layer_bench(budget: int, iters: int = 300) -> dict:
    from types import SimpleNamespace

    import fxbudget
    from fxbudget.backend import make_backend

    cfg = SimpleNamespace(num_hidden_layers=1, num_attention_heads=14, num_key_value_heads=2, head_dim=64, hidden_size=896)
    cache = fxbudget.BudgetCache(cfg, budget)
    q, k, v = torch.randn(1, 14, 1, 64), torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    layer = torch.compile(_Layer(), backend=make_backend("snapkv"), fullgraph=True, dynamic=False)
    with torch.no_grad():
        cache.layers[0].pos.copy_(torch.arange(budget))  # a full cache: every step evicts
        cache.layers[0].keys.normal_(); cache.layers[0].values.normal_(); cache.layers[0].seen.fill_(budget)
        K, V = torch.randn(1, 2, budget, 64), torch.randn(1, 2, budget, 64)
        idx = torch.tensor([budget - 1])
        static = torch.compile(_static_sdpa, fullgraph=True, dynamic=False)
        t0 = time.perf_counter(); layer(q, k, v, cache); c1 = time.perf_counter() - t0
        t0 = time.perf_counter(); static(q, k, v, K, V, idx); c2 = time.perf_counter() - t0
        a, b = [], []
        for _ in range(iters):  # interleaved, so both see the same machine state
            t = time.perf_counter(); layer(q, k, v, cache); a.append(time.perf_counter() - t)
            t = time.perf_counter(); static(q, k, v, K, V, idx); b.append(time.perf_counter() - t)
    ma, mb = statistics.median(a[20:]), statistics.median(b[20:])
    return {"budget": budget, "budget_attention_us": 1e6 * ma, "static_sdpa_us": 1e6 * mb, "ratio": ma / mb,
            "compile_budget_s": c1, "compile_static_s": c2}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "core_timings.md"))
    p.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)
    p.add_argument("--budgets", default="256,1024,4096")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(_model_phase(measure_steps=args.child == "warm")))
        return 0

    inductor_dir = tempfile.mkdtemp(prefix="fxbudget_inductor_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": str(ROOT)}
    phases = {}
    for phase in ("cold", "warm"):
        print(f"model phase: {phase} (fresh process)...", flush=True)
        out = subprocess.run([sys.executable, __file__, "--child", phase], env=env, capture_output=True, text=True,
                             check=True)
        phases[phase] = json.loads(out.stdout.strip().splitlines()[-1])
        print(" ", phases[phase], flush=True)
    layers = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        print(f"layer bench: budget {budget}...", flush=True)
        layers.append(_layer_bench(budget))
        print(" ", layers[-1], flush=True)

    import transformers

    w = phases["warm"]
    lines = [
        "# Core timings", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch threads 1, "
        f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{time.strftime('%Y-%m-%d')}. Command: `OMP_NUM_THREADS=1 python benchmarks/core_timings.py`.", "",
        "## Compile on the embedded model (snapkv, budget 256, prefill chunks of 256, 24 layers)", "",
        "| | prefill-chunk graph | decode graph |", "|---|---|---|",
        f"| cold (empty Inductor cache) | {phases['cold']['compile_prefill_s']:.1f} s | {phases['cold']['compile_decode_s']:.1f} s |",
        f"| warm (same cache, new process) | {w['compile_prefill_s']:.1f} s | {w['compile_decode_s']:.1f} s |", "",
        "## Decode step on the embedded model after a 512-token prompt (median of 12 interleaved steps)", "",
        "| path | ms / step | vs compiled |", "|---|---|---|",
    ]
    for key, name in (("compiled", "fxbudget, Inductor"), ("eager_kernel", "fxbudget, eager kernel"),
                      ("transformers", "transformers, full DynamicCache (no eviction)")):
        v = w[f"decode_{key}_ms"]
        lines.append(f"| {name} | {v:.1f} | {v / w['decode_compiled_ms']:.2f}x |")
    lines += ["", "## Layer level: compiled budget attention vs compiled plain SDPA over a static cache (decode, "
              "14 query / 2 KV heads, head dim 64, cache full so every step evicts)", "",
              "| budget | budget attention (us) | static-cache SDPA (us) | ratio |", "|---|---|---|---|"]
    for r in layers:
        lines.append(f"| {r['budget']} | {r['budget_attention_us']:.1f} | {r['static_sdpa_us']:.1f} | {r['ratio']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
