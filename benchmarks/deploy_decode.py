"""Deployment anchor: the decode step of `fxbudget.compile(..., budget=B)` against what transformers gives.

    OMP_NUM_THREADS=1 python benchmarks/deploy_decode.py [--budgets 1024,4096] [--contexts 8192,32768]
    python benchmarks/deploy_decode.py --device cuda         # CUDA graphs for both compiled sides
    python benchmarks/deploy_decode.py --quick               # smoke run: a tiny random Qwen2, printed only

On the embedded model (Qwen2.5-Coder-0.5B-Instruct, fp32), one fresh process per budget B, with an empty Inductor
cache (so both compiles are cold; a trivial compile first pays Inductor's one-time start-up for neither side):
- fxbudget: `fxbudget.compile(model, rule, budget=B, backend="inductor")`, a BudgetCache filled to B entries of a
  longer context, so every decode step evicts one entry;
- transformers' `StaticCache(max_cache_len=B)` with `torch.compile(model.forward, fullgraph=True)` (on CUDA
  `mode="reduce-overhead"`, CUDA graphs), the fastest stock option: every step attends over B entries, evicts none;
- transformers' uncompiled `DynamicCache` holding each context length (8K, 32K) of keys/values.
Caches are filled directly with random keys/values (a decode step's cost does not depend on their values). Steps of
the three are interleaved (round robin, so all see the same machine state); medians. Compile seconds: the first
decode call of each compiled side (the decode graph; prefill graphs are not part of this benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib.env import ROOT, header_lines, load_str, setup_threads, tune_malloc
from benchlib.timing import timed
from benchlib.output import emit, md_table


def _model(quick: bool, device: str):
    import torch

    if quick:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                          attn_implementation="sdpa")
        model = Qwen2ForCausalLM(cfg).eval()
    else:
        from fxbudget.models import load_default

        model, _ = load_default(progress=False)
    return model.to(device)


def _fill_budget(cache, ctx: int, gen) -> None:
    """A BudgetCache as after `ctx` tokens: every slot holds a random key/value at a distinct earlier position (in
    the cache's slot storage: quantized slots hold the codes and scales of the random values, norms of what they
    store)."""
    import torch

    from fxbudget.kernel.slot_storage import decode, encode

    for layer in cache.layers:  # drawn on the CPU generator, then copied (any device)
        for t, d in ((layer.keys, layer.head_dim), (layer.values, layer.v_head_dim)):
            x = torch.randn((*t.shape[:-1], d), generator=gen).to(t.device)
            t.copy_(encode(x.to(layer.dtype), t))
        pos = torch.sort(torch.randperm(ctx, generator=gen)[:layer.budget]).values.to(layer.pos.device)
        layer.pos[..., :layer.budget].copy_(pos.expand_as(layer.pos[..., :layer.budget]))
        layer.norms[..., 0].copy_(decode(layer.keys, layer.head_dim, layer.dtype).norm(dim=-1))
        layer.norms[..., 1].copy_(decode(layer.values, layer.v_head_dim, layer.dtype).norm(dim=-1))
        layer.seen.fill_(ctx)
    cache.next_pos.fill_(ctx)  # the next token's position (RoPE and visibility): after every slot's
    cache.admit(cache.budget)


def _fill_hf(cache, model, tokens: int, gen, batch: int = 1) -> None:
    """A transformers cache holding `tokens` random keys/values per layer and row (written through its own update)."""
    import torch

    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p = next(model.parameters())
    for i in range(cfg.num_hidden_layers):
        k, v = (torch.randn(batch, cfg.num_key_value_heads, tokens, hd, generator=gen).to(p.device, p.dtype)
                for _ in range(2))
        cache.update(k, v, i)


def _child(a) -> dict:
    """One budget: compile both sides cold, then interleaved decode steps of fxbudget, StaticCache, DynamicCache."""
    import torch
    from transformers import DynamicCache, StaticCache

    import fxbudget
    from fxbudget.cache.keyword import cache_kwargs

    setup_threads(1)
    tune_malloc()
    cuda = a.device == "cuda"
    model = _model(a.quick, a.device)
    gen = torch.Generator().manual_seed(0)
    nxt = torch.tensor([[3]], device=a.device)
    B = a.budget
    res = {"budget": B}
    with torch.no_grad():
        timed(lambda: torch.compile(lambda x: x * 2 + 1)(torch.ones(4, device=a.device)), a.device)  # Inductor start-up

        # fxbudget: a full budget cache of a context longer than B, evicting every step.
        fx_forward = fxbudget.compile(model, rule=a.rule, budget=B, backend="inductor", cudagraphs=cuda).forward
        fx_forward.restore()  # installed around each of its own steps below
        fx_cache = fx_forward.new_cache(1)
        _fill_budget(fx_cache, 2 * B, gen)
        if cuda:
            for layer in fx_cache.layers:
                for t in (layer.keys, layer.values, layer.pos, layer.state, layer.norms, layer.totals, layer.seen,
                          layer.inv_freq):
                    torch._dynamo.mark_static_address(t)

        def fx_step():
            fx_forward(input_ids=nxt, past_key_values=fx_cache, logits_to_keep=1)

        # transformers: StaticCache of B tokens, the model's forward under torch.compile.
        static = StaticCache(config=model.config, max_cache_len=B)
        start = B - 1 - (a.steps + 2) * 4  # room for every step; the step attends over all B entries anyway
        _fill_hf(static, model, start, gen)
        static_forward = torch.compile(model.forward, fullgraph=True, **({"mode": "reduce-overhead"} if cuda else {}))

        def static_step():
            static_forward(input_ids=nxt, use_cache=True, logits_to_keep=1, **cache_kwargs(model.forward, static))

        def static_reset():
            for layer in static.layers:
                if int(layer.cumulative_length) > B - 3:
                    layer.cumulative_length.fill_(start)

        # The fxbudget forward is installed only around its own steps (the other two need the unmodified model).
        def fx_timed():
            fx_forward.install()
            try:
                return timed(fx_step, a.device)
            finally:
                fx_forward.restore()

        res["fxbudget_compile_s"] = fx_timed()
        res["fxbudget_graphs"] = len(fx_forward.graphs)
        res["static_compile_s"] = timed(static_step, a.device)

        dyn = {}
        for ctx in a.contexts:
            d = DynamicCache()
            _fill_hf(d, model, ctx, gen)
            dyn[ctx] = d
        times: dict[str, list[float]] = {"fxbudget": [], "static": [], **{f"dynamic_{c}": [] for c in a.contexts}}

        def dyn_step(c):
            d = dyn[c]
            for layer in d.layers:  # back to `c` tokens: the step's cost stays that of a `c`-token context
                layer.keys, layer.values = layer.keys[..., :c, :], layer.values[..., :c, :]
            kw = cache_kwargs(model.forward, d)
            return timed(lambda: model(input_ids=nxt, use_cache=True, logits_to_keep=1, **kw), a.device)

        def static_timed():
            static_reset()
            return timed(static_step, a.device)

        steps = {"fxbudget": fx_timed, "static": static_timed, **{f"dynamic_{c}": (lambda c=c: dyn_step(c))
                                                                  for c in a.contexts}}
        names = list(steps)
        for r in range(2 + a.steps):  # round robin, rotating the first; 2 warm-up rounds dropped
            for name in names[r % len(names):] + names[:r % len(names)]:
                dt = steps[name]()
                if r >= 2:
                    times[name].append(dt)
    res.update({f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()})
    res["load"] = load_str()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--budgets", default="1024,4096")
    p.add_argument("--contexts", default="8192,32768", help="DynamicCache context lengths")
    p.add_argument("--rule", default="snapkv")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per side")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny random model, small sizes, printed only")
    p.add_argument("--out", default=None)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.budgets, a.contexts, a.steps = "64", "256,1024", 3
    a.contexts = [int(x) for x in a.contexts.split(",")]
    if a.child:
        a.budget = a.child
        print(json.dumps(_child(a)))
        return 0
    setup_threads(1)
    info = header_lines("Deployment anchor: decode step, fxbudget compiled vs transformers' caches",
                        command=None)
    rows = []
    for B in (int(x) for x in a.budgets.split(",")):
        print(f"[{time.strftime('%H:%M:%S')}] budget {B} (load {load_str()})", flush=True)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="fxbudget_deploy_"),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT),
               "TRANSFORMERS_VERBOSITY": "error"}
        cmd = [sys.executable, __file__, "--child", str(B), "--contexts", ",".join(map(str, a.contexts)),
               "--rule", a.rule, "--steps", str(a.steps), "--device", a.device, *(["--quick"] if a.quick else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise RuntimeError(f"budget {B} failed (rc {proc.returncode})")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print("  ", rows[-1], flush=True)
    model = "a tiny random Qwen2 (--quick)" if a.quick else "the embedded model (Qwen2.5-Coder-0.5B-Instruct, fp32)"
    lines = info + [
        f"Decode step on {model}, device `{a.device}`, rule `{a.rule}`, median of {a.steps} interleaved steps. "
        "fxbudget's cache is full (every step evicts); StaticCache attends over B entries; DynamicCache holds the "
        "context. Compile = the first decode call of a cold process (empty Inductor cache).", "",
        *md_table(["B", "fxbudget ms", "StaticCache ms", "fxbudget / static (goal <= 1.10)", "fxbudget compile s",
                   "graphs", "static compile s", *[f"DynamicCache {c} ms" for c in a.contexts],
                   *[f"DynamicCache {c} / fxbudget" for c in a.contexts], "load at end"],
                  [[r["budget"], f"{r['fxbudget_ms']:.1f}", f"{r['static_ms']:.1f}",
                    f"{r['fxbudget_ms'] / r['static_ms']:.2f}", f"{r['fxbudget_compile_s']:.1f}", r["fxbudget_graphs"],
                    f"{r['static_compile_s']:.1f}", *[f"{r[f'dynamic_{c}_ms']:.1f}" for c in a.contexts],
                    *[f"{r[f'dynamic_{c}_ms'] / r['fxbudget_ms']:.2f}" for c in a.contexts], r["load"]]
                   for r in rows]),
    ]
    emit(lines, a.out, a.quick, "deploy_decode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
