"""Memory scaling: peak memory and per-token decode time vs context length, fxbudget (budget) vs a full KV cache.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_scaling.py [--quick] [--out benchmarks/results/memory_scaling.md]

(a) Synthetic attention stack with the embedded model's attention shapes (Qwen2.5-0.5B: 14 query heads, 2 KV heads,
    head dim 64, fp32; 4 layers by default, the model has 24: KV bytes scale with layers, the kernel's per-call
    scratch does not), random q/k/v drawn chunk by chunk from a seeded generator (so the input never
    grows with the context). fxbudget: `BudgetCache` (budget 1024) + the shared budget attention kernel, EAGER path
    (`fxbudget.passes.eager.BudgetAttentionMode`, rule snapkv), context fed in prefill chunks through the kernel, so it
    evicts as it goes. Full cache: transformers' `DynamicCache` + SDPA (`enable_gqa=True`); its prefill only writes
    the keys/values (no prefill attention: with a 32K context that alone would take tens of minutes here), so its
    peak is a lower bound of a real full-cache prefill. Decode: one new token through all layers; fxbudget's cache
    is full, so every step evicts.
    Peak memory: one fresh subprocess per (cache, context): RSS high-water mark (`/proc/self/status` VmHWM, reset
    through `/proc/self/clear_refs`, which also resets `ru_maxrss`) minus the RSS after imports + warm-up.
    Decode time: a separate subprocess per context holds both caches (filled directly, same sizes as after a prefill)
    and times their decode steps interleaved (side by side); median.
(b) The embedded model (Qwen2.5-Coder-0.5B-Instruct fp32): fxbudget (`fxbudget.compile(rule="snapkv", budget=1024,
    chunk_size=CHUNK, backend=None)`: eager kernel) vs the unmodified model with transformers' `DynamicCache`, both
    prefilled in chunks of CHUNK tokens of a passkey haystack (`fxbudget.harness.tasks.passkey`), then greedy decode
    steps. One fresh subprocess per (cache, context); the two caches of a context run back to back.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from benchlib.env import command_line, env_info, header_lines, load_str  # noqa: E402
from benchlib.timing import interleaved  # noqa: E402
from benchlib.output import analysis_link, md_table, write_md  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


# ---------------------------------------------------------------------------------------------------- memory probes

def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_peak() -> int:
    """Free what can be freed and reset the RSS high-water mark; returns the RSS now (bytes)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


def _peak_delta_mb(base: int) -> float:
    return (_status()["VmHWM"] - base) / 2**20


def _fill_full(cache, ctx: int, budget: int, gen):
    """Make an empty BudgetCache look full after `ctx` tokens: random K/V at `budget` positions out of [0, ctx)."""
    import torch

    for layer in cache.layers:
        layer.keys.normal_(generator=gen)
        layer.values.normal_(generator=gen)
        layer.pos.copy_(torch.sort(torch.randperm(ctx, generator=gen)[:budget]).values.expand_as(layer.pos))
        layer.norms[..., 0].copy_(layer.keys.norm(dim=-1))
        layer.norms[..., 1].copy_(layer.values.norm(dim=-1))
        layer.seen.fill_(ctx)
    cache.admit(budget)
    return cache


def _dyn_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


# ---------------------------------------------------------------------------------------------------- (a) synthetic

def _synth_cfg(layers: int):
    return SimpleNamespace(num_hidden_layers=layers, num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS,
                           head_dim=HEAD_DIM, hidden_size=Q_HEADS * HEAD_DIM)


def _stack(layers: int):
    import torch.nn.functional as F

    def forward(qs, ks, vs, cache, mask=None):
        out = []
        for i in range(layers):
            k, v = cache.update(ks[i], vs[i], i)
            out.append(F.scaled_dot_product_attention(qs[i], k, v, attn_mask=mask, enable_gqa=True))
        return out

    return forward


def _rand(gen, layers: int, n: int, with_q: bool = True):
    import torch

    qs = [torch.randn(1, Q_HEADS, n, HEAD_DIM, generator=gen) for _ in range(layers)] if with_q else None
    ks = [torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen) for _ in range(layers)]
    vs = [torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen) for _ in range(layers)]
    return qs, ks, vs


def _budget_mode(rule_name: str):
    from fxbudget.compiler.backend import kernel_window
    from fxbudget.passes.eager import BudgetAttentionMode
    from fxbudget.rules import get

    rule = get(rule_name)
    return BudgetAttentionMode(rule, kernel_window(rule), get("window"))


def _synth_child(kind: str, ctx: int, a) -> dict:
    """Fresh process: prefill `ctx` random tokens in chunks, then `a.decode_steps` decode steps; peak RSS delta."""
    import torch
    from transformers import DynamicCache

    import fxbudget

    torch.set_num_threads(1)
    cfg = _synth_cfg(a.layers)
    fwd = _stack(a.layers)
    gen = torch.Generator().manual_seed(0)

    def new_cache():
        return fxbudget.BudgetCache(cfg, a.budget) if kind == "fxbudget" else DynamicCache()

    def prefill(cache, n_tokens):
        with torch.no_grad():
            for start in range(0, n_tokens, a.chunk):
                n = min(a.chunk, n_tokens - start)
                if kind == "fxbudget":
                    qs, ks, vs = _rand(gen, a.layers, n)
                    cache.admit(n)
                    with _budget_mode(a.rule):
                        fwd(qs, ks, vs, cache)
                else:  # write only: the full cache's KV, no prefill attention
                    _, ks, vs = _rand(gen, a.layers, n, with_q=False)
                    for i in range(a.layers):
                        cache.update(ks[i], vs[i], i)

    def decode(cache):
        qs, ks, vs = _rand(gen, a.layers, 1)
        with torch.no_grad():
            if kind == "fxbudget":
                cache.admit(1)
                with _budget_mode(a.rule):
                    fwd(qs, ks, vs, cache)
            else:
                fwd(qs, ks, vs, cache)

    warm = new_cache()  # warm-up: every op once, on a small context
    prefill(warm, 2 * a.chunk + a.budget)
    decode(warm)
    del warm
    base = _reset_peak()
    t0 = time.perf_counter()
    cache = new_cache()
    prefill(cache, ctx)
    t1 = time.perf_counter()
    steps = []
    for _ in range(a.decode_steps):
        t = time.perf_counter()
        decode(cache)
        steps.append(time.perf_counter() - t)
    kv = cache.kv_bytes() if kind == "fxbudget" else _dyn_bytes(cache)
    return {"kind": kind, "ctx": ctx, "peak_mb": _peak_delta_mb(base), "kv_mb": kv / 2**20,
            "prefill_s": t1 - t0, "decode_ms_isolated": 1e3 * statistics.median(steps), "load": os.getloadavg()}


def _synth_timing_child(ctx: int, a) -> dict:
    """Fresh process: both caches filled directly to their post-prefill state, decode steps timed interleaved."""
    import torch
    from transformers import DynamicCache

    import fxbudget

    torch.set_num_threads(1)
    cfg = _synth_cfg(a.layers)
    fwd = _stack(a.layers)
    gen = torch.Generator().manual_seed(0)
    b = _fill_full(fxbudget.BudgetCache(cfg, a.budget), ctx, a.budget, gen)
    d = DynamicCache()
    with torch.no_grad():
        for start in range(0, ctx, 4096):
            n = min(4096, ctx - start)
            for i in range(a.layers):
                d.update(torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen),
                         torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen), i)
    steps = {"fxbudget": _rand(gen, a.layers, 1), "full": _rand(gen, a.layers, 1)}
    mode = _budget_mode(a.rule)

    def step_b():
        qs, ks, vs = steps["fxbudget"]
        b.admit(1)
        with torch.no_grad(), mode:
            fwd(qs, ks, vs, b)

    def step_d():
        qs, ks, vs = steps["full"]
        with torch.no_grad():
            fwd(qs, ks, vs, d)

    times = interleaved({"fxbudget": step_b, "full": step_d}, reps=a.reps, warmup=3)
    return {"ctx": ctx, "fxbudget_ms": 1e3 * statistics.median(times["fxbudget"]),
            "full_ms": 1e3 * statistics.median(times["full"]), "load": os.getloadavg()}


# ---------------------------------------------------------------------------------------------------- (b) model

def _model_child(kind: str, ctx: int, a) -> dict:
    import torch
    from transformers import DynamicCache

    import fxbudget
    from fxbudget.cache.keyword import cache_name
    from fxbudget.harness.tasks import passkey
    from fxbudget.models import load_default

    torch.set_num_threads(1)
    model, tok = load_default(progress=False)
    sample = passkey(tok, ctx + 64, depth=0.5, seed=0)
    ids = tok(sample.context, return_tensors="pt").input_ids[:, :ctx]
    assert ids.shape[1] == ctx, ids.shape
    if kind == "fxbudget":
        model = fxbudget.compile(model, rule=a.rule, budget=a.budget, chunk_size=a.chunk, backend=None)

    name = cache_name(model.forward)  # `cache` from transformers 5.24; looked up once, outside the timed steps

    def run(x, steps):
        with torch.no_grad():
            if kind == "fxbudget":
                cache = model.forward.new_cache(1)
                out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
            else:
                cache = DynamicCache()
                for start in range(0, x.shape[1], a.chunk):
                    out = model(input_ids=x[:, start:start + a.chunk], use_cache=True, logits_to_keep=1,
                                **{name: cache})
            t_pre = time.perf_counter()
            nxt = out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                out = model(input_ids=nxt, use_cache=True, **{name: cache})
                times.append(time.perf_counter() - t)
                nxt = out.logits[:, -1:].argmax(-1)
        return cache, t_pre, times

    run(ids[:, :a.chunk + 64], 2)  # warm-up: pages in every weight, first-call overheads
    base = _reset_peak()
    t0 = time.perf_counter()
    cache, t_pre, times = run(ids, a.model_decode_steps)
    kv = cache.kv_bytes() if kind == "fxbudget" else _dyn_bytes(cache)
    return {"kind": kind, "ctx": ctx, "peak_mb": _peak_delta_mb(base), "kv_mb": kv / 2**20, "prefill_s": t_pre - t0,
            "decode_ms": 1e3 * statistics.median(times), "load": os.getloadavg()}


def _model_decode_child(contexts: list[int], a) -> dict:
    """One process, the real model: for each context, a BudgetCache and a DynamicCache filled directly to their
    post-prefill sizes (random K/V: a decode step's cost does not depend on the values), decode steps interleaved."""
    import torch
    from transformers import DynamicCache

    import fxbudget
    from fxbudget.cache.keyword import cache_name
    from fxbudget.models import load_default

    torch.set_num_threads(1)
    model, tok = load_default(progress=False)
    compiled = fxbudget.compile(model, rule=a.rule, budget=a.budget, backend=None).forward
    model.forward.restore()  # `model` is the unmodified model again; `compiled` keeps the budget path
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    nxt = torch.tensor([[tok.encode(" the")[0]]])
    rows = []
    for ctx in contexts:
        b = _fill_full(compiled.new_cache(1), ctx, a.budget, gen)
        d = DynamicCache()
        for i in range(cfg.num_hidden_layers):
            hd = cfg.hidden_size // cfg.num_attention_heads
            d.update(torch.randn(1, cfg.num_key_value_heads, ctx, hd, generator=gen),
                     torch.randn(1, cfg.num_key_value_heads, ctx, hd, generator=gen), i)

        def step_b():
            with torch.no_grad():
                compiled(input_ids=nxt, past_key_values=b)

        name = cache_name(model.forward)  # `cache` from transformers 5.24, looked up outside the timed step

        def step_d():
            with torch.no_grad():
                model(input_ids=nxt, use_cache=True, **{name: d})

        times = interleaved({"fxbudget": step_b, "full": step_d}, reps=a.model_decode_steps, warmup=2)
        rows.append({"ctx": ctx, "fxbudget_ms": 1e3 * statistics.median(times["fxbudget"]),
                     "full_ms": 1e3 * statistics.median(times["full"]), "fxbudget_kv_mb": b.kv_bytes() / 2**20,
                     "full_kv_mb": _dyn_bytes(d) / 2**20, "load": os.getloadavg()})
        del b, d
        gc.collect()
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------------- driver

def _child(args_list: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args_list], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise RuntimeError(f"child {args_list} failed (rc {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="synthetic 2K-8K with 2 layers, model at 1K and 2K (a smoke run, minutes)")
    p.add_argument("--contexts", default="2048,4096,8192,16384,32768", help="synthetic context lengths")
    p.add_argument("--model-contexts", default="2048,4096", help="embedded-model context lengths ('' = skip)")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size (both caches)")
    p.add_argument("--rule", default="snapkv")
    p.add_argument("--layers", type=int, default=4, help="synthetic layers (the embedded model has 24)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps in each synthetic memory child")
    p.add_argument("--reps", type=int, default=30, help="interleaved decode steps per cache, synthetic timing")
    p.add_argument("--model-decode-steps", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_scaling.md"))
    p.add_argument("--json-out", default=None, help="also write the raw rows here")
    p.add_argument("--from-json", default=None,
                   help="take parts (a) and (b) from this earlier --json-out instead of measuring them again")
    p.add_argument("--child", nargs=3, metavar=("PART", "KIND", "CTX"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.contexts, a.model_contexts, a.layers, a.reps = "2048,4096,8192", "1024,2048", 2, 15
    if a.child:
        part, kind, ctx = a.child[0], a.child[1], int(a.child[2])
        res = {"synth": lambda: _synth_child(kind, ctx, a), "timing": lambda: _synth_timing_child(ctx, a),
               "model": lambda: _model_child(kind, ctx, a),
               "model_decode": lambda: _model_decode_child(_ints(a.contexts), a)}[part]()
        print(json.dumps(res))
        return 0

    from benchlib.env import setup_threads

    setup_threads(1)
    info = env_info()
    command = command_line()
    passthrough = ["--budget", str(a.budget), "--chunk", str(a.chunk), "--rule", a.rule, "--layers", str(a.layers),
                   "--decode-steps", str(a.decode_steps), "--reps", str(a.reps),
                   "--model-decode-steps", str(a.model_decode_steps)]
    synth, timing, model_rows = [], [], []
    prev = json.loads(Path(a.from_json).read_text()) if a.from_json else None
    if prev:
        synth, timing, model_rows = prev["synth"], prev["timing"], prev["model"]
    for ctx in ([] if prev else _ints(a.contexts)):
        for kind in ("fxbudget", "full"):
            print(f"[{time.strftime('%H:%M:%S')}] synthetic {kind} {ctx} (load {load_str()})", flush=True)
            synth.append(_child(["--child", "synth", kind, str(ctx), *passthrough]))
            print("  ", synth[-1], flush=True)
        print(f"[{time.strftime('%H:%M:%S')}] synthetic decode timing {ctx}", flush=True)
        timing.append(_child(["--child", "timing", "both", str(ctx), *passthrough]))
        print("  ", timing[-1], flush=True)
    for ctx in ([] if prev else _ints(a.model_contexts)):
        for kind in ("fxbudget", "full"):
            print(f"[{time.strftime('%H:%M:%S')}] model {kind} {ctx} (load {load_str()})", flush=True)
            model_rows.append(_child(["--child", "model", kind, str(ctx), *passthrough]))
            print("  ", model_rows[-1], flush=True)
    print(f"[{time.strftime('%H:%M:%S')}] model decode steps vs context (load {load_str()})", flush=True)
    mdec = _child(["--child", "model_decode", "both", "0", "--contexts", a.contexts, *passthrough])["rows"]
    print("  ", mdec, flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"synth": synth, "timing": timing, "model": model_rows,
                                                "model_decode": mdec}))

    def get(rows, kind, ctx):
        return next(r for r in rows if r["kind"] == kind and r["ctx"] == ctx)

    lines = header_lines("Memory scaling: fxbudget budget cache vs full KV cache", info, command,
                         load_after=load_str())
    lines += [f"Budget {a.budget} per layer and KV head, rule `{a.rule}`, prefill chunks of {a.chunk}, fxbudget's "
              "EAGER kernel (no torch.compile), fp32, CPU, 1 thread. Peak = RSS high-water mark minus RSS after "
              "imports/model load and a warm-up, one fresh subprocess per row. KV = bytes of keys + values held at "
              "the end (fxbudget: the fixed slot arrays).", "",
              f"## (a) Synthetic attention stack ({a.layers} layers x {Q_HEADS} query / {KV_HEADS} KV heads, head dim "
              f"{HEAD_DIM}, random q/k/v)", "",
              "Decode ms/token: both caches in one process, steps interleaved, median of "
              f"{a.reps} (side by side). Full-cache prefill writes K/V only (no attention), so its peak is a lower "
              "bound.", ""]
    ctxs = _ints(a.contexts)
    rows = []
    for ctx in ctxs:
        f, d, t = get(synth, "fxbudget", ctx), get(synth, "full", ctx), next(x for x in timing if x["ctx"] == ctx)
        rows.append([ctx, f"{f['peak_mb']:.0f}", f"{f['kv_mb']:.1f}", f"{t['fxbudget_ms']:.2f}", f"{f['prefill_s']:.1f}",
                     f"{d['peak_mb']:.0f}", f"{d['kv_mb']:.1f}", f"{t['full_ms']:.2f}", f"{t['load'][0]:.2f}"])
    lines += md_table(["context", "fxbudget peak MB", "fxbudget KV MB", "fxbudget decode ms", "fxbudget prefill s",
                       "full peak MB", "full KV MB", "full decode ms", "load (1 min)"], rows)
    goals = []
    lo, hi = (4096 if 4096 in ctxs else ctxs[0]), ctxs[-1]
    fl, fh = get(synth, "fxbudget", lo), get(synth, "fxbudget", hi)
    dl, dh = get(synth, "full", lo), get(synth, "full", hi)
    tl, th = next(x for x in timing if x["ctx"] == lo), next(x for x in timing if x["ctx"] == hi)
    goals.append((f"synthetic {hi}/{lo}", fh["peak_mb"] / fl["peak_mb"], th["fxbudget_ms"] / tl["fxbudget_ms"],
                  dh["peak_mb"] / dl["peak_mb"], th["full_ms"] / tl["full_ms"]))
    lines += ["", f"Ratios {hi}/{lo} (goal for fxbudget: <= 1.1 for memory and decode time):", "",
              *md_table(["", "fxbudget peak", "fxbudget decode", "full peak", "full decode"],
                        [[g[0], f"{g[1]:.2f}", f"{g[2]:.2f}", f"{g[3]:.2f}", f"{g[4]:.2f}"] for g in goals]), ""]
    mctx = _ints(a.model_contexts)
    if mctx:
        lines += ["## (b) Embedded model (Qwen2.5-Coder-0.5B-Instruct, fp32)", "",
                  f"Both prefilled in chunks of {a.chunk} (`logits_to_keep=1`), then {a.model_decode_steps} greedy "
                  "decode steps (median ms/token). Rows of one context ran back to back in fresh processes.", ""]
        rows = []
        for ctx in mctx:
            f, d = get(model_rows, "fxbudget", ctx), get(model_rows, "full", ctx)
            rows.append([ctx, f"{f['peak_mb']:.0f}", f"{f['kv_mb']:.1f}", f"{f['decode_ms']:.0f}", f"{f['prefill_s']:.0f}",
                         f"{d['peak_mb']:.0f}", f"{d['kv_mb']:.1f}", f"{d['decode_ms']:.0f}", f"{d['prefill_s']:.0f}",
                         f"{f['load'][0]:.2f} / {d['load'][0]:.2f}"])
        lines += md_table(["context", "fxbudget peak MB", "fxbudget KV MB", "fxbudget decode ms", "fxbudget prefill s",
                           "full peak MB", "full KV MB", "full decode ms", "full prefill s", "load (1 min)"], rows)
        lo, hi = mctx[0], mctx[-1]
        fl, fh, dl, dh = (get(model_rows, k, c) for k, c in (("fxbudget", lo), ("fxbudget", hi), ("full", lo),
                                                              ("full", hi)))
        lines += ["", f"Ratios {hi}/{lo}:", "",
                  *md_table(["", "fxbudget peak", "fxbudget decode", "full peak", "full decode"],
                            [[f"model {hi}/{lo}", f"{fh['peak_mb'] / fl['peak_mb']:.2f}",
                              f"{fh['decode_ms'] / fl['decode_ms']:.2f}", f"{dh['peak_mb'] / dl['peak_mb']:.2f}",
                              f"{dh['decode_ms'] / dl['decode_ms']:.2f}"]]), ""]
    lines += ["## (c) Embedded model, decode step vs context (caches filled directly)", "",
              f"One process: for each context a BudgetCache (budget {a.budget}, full, so every step evicts) and a "
              "DynamicCache holding the whole context (random K/V), decode steps of the real model interleaved, "
              f"median of {a.model_decode_steps}.", ""]
    lines += md_table(["context", "fxbudget ms/token", "fxbudget KV MB", "full ms/token", "full KV MB", "full / fxbudget",
                       "load (1 min)"],
                      [[r["ctx"], f"{r['fxbudget_ms']:.0f}", f"{r['fxbudget_kv_mb']:.1f}", f"{r['full_ms']:.0f}",
                        f"{r['full_kv_mb']:.1f}", f"{r['full_ms'] / r['fxbudget_ms']:.2f}", f"{r['load'][0]:.2f}"]
                       for r in mdec])
    c = {r["ctx"]: r for r in mdec}
    clo, chi = (4096 if 4096 in c else min(c)), max(c)
    lines += ["", f"Ratios {chi}/{clo}: fxbudget decode {c[chi]['fxbudget_ms'] / c[clo]['fxbudget_ms']:.2f}, "
              f"full decode {c[chi]['full_ms'] / c[clo]['full_ms']:.2f}.", ""]
    lines += analysis_link("memory_scaling")
    write_md(a.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
