"""fxbudget's AdaKV vs kvpress's AdaKVPress on the embedded model: kept-set parity, and peak memory at 4K / 8K.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peers/vs_kvpress_adakv.py parity   # ~1K prompts, B 256
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peers/vs_kvpress_adakv.py memory   # 4K, 8K, B 1024, 32 tokens

Same setup as `vs_kvpress.py` (whose worker helpers this module shares): two venvs, the same token ids handed to both
sides as JSON, one fresh subprocess per (side, configuration), peak memory = the RSS high-water mark after load and
warm-up minus the RSS at that point. Query-agnostic protocol: the context is compressed in one call, the question
and a greedy answer (<= `--new-tokens`, EOS stops) are appended without compression.

kvpress: `AdaKVPress(SnapKVPress(compression_ratio, window_size=64, kernel_size=5))` (alpha_safeguard 0.2). It keeps
every key in memory and masks the dropped ones (`attention_patch.py`: a fake key per decode call), so its kept set
is read from the press's `module.masked_key_indices` (kept = the context positions not masked, per layer and KV
head). kvpress's ratio is `1 - (B + 0.5) / L` (exactly B kept per head on average, as in `vs_kvpress.py`).
fxbudget: `adakv:snapkv` with window 64, kernel 5, avg pooling, alpha 0.2 (the pooled layout), one-call prefill;
its kept set is `cache.head_positions(layer)`. A `snapkv` row (uniform allocation) runs on both sides as a control.

Modes: `parity` (prompts of `--context` tokens, B = `--budget`; report: overlap per layer and KV head, per-head
counts) -> results/vs_kvpress_adakv.md; `memory` (one passkey prompt per `--lengths` entry; fxbudget eager and
Inductor sides; report: peak above the weights, ratio to kvpress's, answers, overlap) ->
results/vs_kvpress_adakv_memory.md. Raw rows accumulate in `--store` (one JSON file per mode, a row per side and
configuration, each with its own date and load), so sides can be run at different times (`--sides`) and the report
is rewritten from every stored row of the same prompt settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vs_kvpress import (PEER_PYTHON, ROOT, _greedy, kvpress_ratio, _overlap, _peak_since, _reset_peak, _run_worker,  # noqa: E402
                        add_worker_args, serve_worker)

SNAP = {"window": 64, "kernel": 5, "pooling": "avg"}
KV_SNAP = {"window_size": 64, "kernel_size": 5}
RULES = ("adakv:snapkv", "snapkv")
SIDES = ("kvpress", "eager", "inductor")  # eager / inductor: fxbudget's kernel without torch.compile / with Inductor


# ----------------------------------------------------------------------------------------------------------------
# Workers (kvpress side: the peer venv; fxbudget side: the project venv)
# ----------------------------------------------------------------------------------------------------------------

def record_kept(press, recorded: dict):
    """`press` with its `compress` wrapped to record each layer's kept positions per KV head into `recorded`
    (layer index -> lists), as `_kvpress_kept` reads them; returns the press."""
    orig = press.compress

    def compress(module, hidden_states, keys, values, *a, **k):
        kept_k, kept_v = orig(module, hidden_states, keys, values, *a, **k)
        recorded[module.layer_idx] = _kvpress_kept(module, keys, kept_k, keys.shape[2])
        return kept_k, kept_v

    press.compress = compress
    return press


def _kvpress_kept(module, keys, kept_k, L: int) -> list[list[int]]:
    """Kept context positions per KV head of one layer (batch 0): from the mask of a head-wise press, else by
    matching every kept key row to the input row it was gathered from (a pruning press)."""
    import torch

    masked = getattr(module, "masked_key_indices", None)
    if masked is not None:
        b, h, s = (t.tolist() for t in masked)
        drop = [set() for _ in range(keys.shape[1])]
        for bi, hi, si in zip(b, h, s):
            if bi == 0:
                drop[hi].add(si)
        return [[p for p in range(L) if p not in d] for d in drop]
    same = (kept_k[0].unsqueeze(2) == keys[0].unsqueeze(1)).all(-1)  # [heads, kept, L]
    assert bool(same.any(-1).all()), "a kept key matches no input key"
    return [sorted(set(r)) for r in same.to(torch.int8).argmax(-1).tolist()]


def _worker_kvpress(job: dict) -> dict:
    import torch
    import transformers
    from importlib.metadata import version

    import kvpress
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=AutoTokenizer.from_pretrained(job["model_dir"]),
                                         device="cpu")
    recorded: dict[int, list] = {}

    def make_press(L: int, budget: int):
        inner = kvpress.SnapKVPress(compression_ratio=kvpress_ratio(budget, L), **KV_SNAP)
        press = kvpress.AdaKVPress(press=inner) if job["rule"] == "adakv:snapkv" else inner
        return record_kept(press, recorded)

    def run(ctx_ids, q_ids, max_new, budget):
        ctx, q = torch.tensor([ctx_ids]), torch.tensor([q_ids])
        press = make_press(ctx.shape[1], budget)
        recorded.clear()
        cache = DynamicCache()
        t0 = time.perf_counter()
        with torch.no_grad():
            with press(model):
                model.model(input_ids=ctx, past_key_values=cache)  # the pipeline's prefill, verbatim
            t1 = time.perf_counter()
            answer = pipe.generate_answer(question_ids=q, cache=cache, context_length=ctx.shape[1],
                                          max_new_tokens=max_new)
        t2 = time.perf_counter()
        kv = sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers)
        return {"answer": answer, "prefill_s": t1 - t0, "answer_s": t2 - t1, "total_s": t2 - t0,
                "kept": [recorded[i] for i in sorted(recorded)], "kv_bytes": kv}

    w = job["warmup"]
    run(w["ctx"], w["q"], 2, len(w["ctx"]) // 2)  # pages in every weight, first-call overheads
    base, reset = _reset_peak()
    results = [run(p["ctx"], p["q"], job["new_tokens"], job["budget"]) for p in job["prompts"]]
    return {"results": results, "base_rss_mb": base / 2**20, "hwm_reset": reset, **_peak_since(base),
            "versions": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                         "torch": torch.__version__}}


def _head_kept(cache, i: int) -> list[list[int]]:
    """Positions each KV head of layer `i` holds (batch 0), sorted."""
    pos = cache.head_positions(i) if hasattr(cache, "head_positions") else cache.positions(i)
    return [sorted(int(x) for x in row if x >= 0) for row in pos[0].tolist()]


def _worker_fxbudget(job: dict) -> dict:
    import torch
    import transformers

    import fxbudget
    from fxbudget.models import load_default

    torch.set_num_threads(1)
    model, tok = load_default(progress=False)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    backend = "inductor" if job["side"] == "inductor" else None
    extra = {} if job.get("head_pool") is None else {"head_pool": job["head_pool"]}
    model = fxbudget.compile(model, rule=job["rule"], budget=job["budget"], backend=backend,
                             headroom=job["headroom"], **extra, **SNAP)

    def run(ctx_ids, q_ids, max_new):
        ctx, q = torch.tensor([ctx_ids]), torch.tensor([q_ids])
        cache = model.forward.new_cache(1)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
            t1 = time.perf_counter()
            kept = [_head_kept(cache, i) for i in range(len(cache.layers))]
            with cache.frozen():
                out = model(input_ids=q, past_key_values=cache, logits_to_keep=1)
                ids = _greedy(lambda t: model(input_ids=torch.tensor([[t]]), past_key_values=cache).logits,
                              out.logits, eos, max_new)
        t2 = time.perf_counter()
        return {"answer": tok.decode(ids, skip_special_tokens=True), "prefill_s": t1 - t0, "answer_s": t2 - t1,
                "total_s": t2 - t0, "kept": kept, "kv_bytes": cache.kv_bytes(), "layout": _layout(cache)}

    w = job["warmup"]
    run(w["ctx"], w["q"], 2)
    compile_run_s = None
    if backend:  # the first call of each length compiles: run the prompts once before the measured runs
        t = time.perf_counter()
        for p in job["prompts"]:
            run(p["ctx"], p["q"], job["new_tokens"])
        compile_run_s = time.perf_counter() - t
    base, reset = _reset_peak()
    results = [run(p["ctx"], p["q"], job["new_tokens"]) for p in job["prompts"]]
    return {"results": results, "base_rss_mb": base / 2**20, "hwm_reset": reset, **_peak_since(base),
            "compile_run_s": compile_run_s,
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}


def _rel(path) -> str:
    """`path` relative to the checkout when inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _layout(cache) -> str:
    return "head-pool" if getattr(cache, "head_pool", False) else "slots"


# ----------------------------------------------------------------------------------------------------------------
# Driver (project venv)
# ----------------------------------------------------------------------------------------------------------------

def _prompts(tok, lengths: list[int], n: int) -> tuple[list[dict], list]:
    from fxbudget.harness.tasks import chat_ids, passkey

    prompts, samples = [], []
    for L in lengths:
        depths = [0.5] if n == 1 else [round(0.1 + 0.8 * i / (n - 1), 2) for i in range(n)]
        for i, depth in enumerate(depths):
            s = passkey(tok, L, depth=depth, seed=i)
            ctx, q = chat_ids(tok, s)
            prompts.append({"ctx": ctx[0].tolist(), "q": q[0].tolist(), "length": L, "depth": depth, "seed": i})
            samples.append(s)
    return prompts, samples


def _kept_stats(kept: list) -> dict:
    counts = [len(h) for layer in kept for h in layer]
    totals = {sum(len(h) for h in layer) for layer in kept}
    return {"min": min(counts), "max": max(counts), "layer_totals": sorted(totals)}


def _run(args, plan, prompts, samples, store: dict, base_job: dict) -> None:
    env_k = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env_k.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env_f = {**env_k, "PYTHONPATH": str(ROOT)}
    for side, rule, L in plan:
        from benchlib.env import load_str

        key = f"{side}|{rule}|{L}"
        print(f"[{time.strftime('%H:%M:%S')}] {key} (load {load_str()})", flush=True)
        ps = [p for p in prompts if L is None or p["length"] == L]
        job = {**base_job, "rule": rule, "side": side, "prompts": ps}
        if side != "kvpress" and args.head_pool is not None:
            job["head_pool"] = args.head_pool
        python = args.peer_python if side == "kvpress" else sys.executable
        res = _run_worker(python, "kvpress" if side == "kvpress" else "fxbudget", job,
                          env_k if side == "kvpress" else env_f, script=Path(__file__))
        res.update(side=side, rule=rule, length=L, date=time.strftime("%Y-%m-%d %H:%M"),
                   load_end=os.getloadavg(), prompt_lengths=[len(p["ctx"]) for p in ps])
        for r_, p in zip(res["results"], ps):
            r_["ok"] = samples[prompts.index(p)].answer in r_["answer"]
        print("   ", [(round(x["total_s"], 1), x["answer"], x["ok"], _kept_stats(x["kept"])) for x in res["results"]],
              f"peak +{res['peak_rss_delta_mb']:.0f} MB", flush=True)
        store[key] = res
        Path(args.store).parent.mkdir(parents=True, exist_ok=True)
        Path(args.store).write_text(json.dumps(store))  # after every row: an interrupted run keeps what it measured


def _overlap_vs(row: dict, ref: dict) -> list[float]:
    ov = []
    for a, b in zip(row["results"], ref["results"]):
        ov += _overlap(a["kept"], b["kept"])
    return ov


def _parity_report(args, store: dict) -> list[str]:
    from benchlib.output import md_table

    lines = ["## Kept sets after the context: fxbudget eager vs kvpress", "",
             "Per layer and KV head over every prompt: |kept by fxbudget & kept by kvpress| / max(sizes). Per-head "
             "counts: the fewest and most entries one KV head keeps (over layers and prompts); layer totals: the "
             "distinct sums over a layer's KV heads (the budget is kv_heads x B per layer).", ""]
    rows = []
    for rule in RULES:
        k, f = store.get(f"kvpress|{rule}|None"), store.get(f"eager|{rule}|None")
        if not (k and f):
            continue
        ov = _overlap_vs(f, k)
        ks = [_kept_stats(x["kept"]) for x in k["results"]]
        fs = [_kept_stats(x["kept"]) for x in f["results"]]
        rows.append([rule, f"{statistics.mean(ov):.4f}", f"{min(ov):.3f}", f"{sum(o == 1.0 for o in ov)}/{len(ov)}",
                     f"{min(s['min'] for s in ks)}-{max(s['max'] for s in ks)}",
                     f"{min(s['min'] for s in fs)}-{max(s['max'] for s in fs)}",
                     sorted({t for s in ks for t in s["layer_totals"]}), sorted({t for s in fs for t in s["layer_totals"]}),
                     f['results'][0].get('layout', '?'),
                     " / ".join(repr(x["answer"]) for x in k["results"]), " / ".join(repr(x["answer"]) for x in f["results"])])
    return lines + md_table(["rule", "mean overlap (goal >= 0.99)", "min", "heads identical", "kvpress per-head",
                             "fxbudget per-head", "kvpress layer totals", "fxbudget layer totals", "fxbudget layout",
                             "kvpress answers", "fxbudget answers"], rows) + [""]


def _memory_report(args, store: dict, lengths: list[int]) -> list[str]:
    from benchlib.output import md_table

    lines = ["## One-call prefill + greedy answer: peak memory above the weights", "",
             "Peak: RSS high-water mark over the run (context prefill, question, answer) minus the RSS after load and "
             "warm-up (Inductor: after a first run of the same prompt, which compiles; its seconds are `compile "
             "run s`). KV MB: keys + values held after the answer (kvpress: the whole cache, masked) / allocated "
             "(fxbudget: B + head-room slots per KV head). Overlap: kept sets vs kvpress's, as in the parity file.", ""]
    rows = []
    for L in lengths:
        k = store.get(f"kvpress|adakv:snapkv|{L}")
        for side in SIDES:
            r = store.get(f"{side}|adakv:snapkv|{L}")
            if r is None:
                continue
            x = r["results"][0]
            same = "" if side == "kvpress" or not k else ("same" if x["answer"] == k["results"][0]["answer"] else "differs")
            ov = "" if side == "kvpress" or not k else f"{statistics.mean(_overlap_vs(r, k)):.4f}"
            ratio = "" if side == "kvpress" or not k else f"{r['peak_rss_delta_mb'] / k['peak_rss_delta_mb']:.2f}"
            rows.append([r["prompt_lengths"][0], side, f"{x['prefill_s']:.1f}", f"{x['total_s']:.1f}",
                         "" if r.get("compile_run_s") is None else f"{r['compile_run_s']:.0f}",
                         f"{r['peak_rss_delta_mb']:.0f}", ratio, f"{x['kv_bytes'] / 2**20:.1f}", repr(x["answer"]),
                         x["ok"], same, ov, f"{r['load_end'][0]:.1f}", r["date"]])
    return lines + md_table(["context tokens", "side", "prefill s", "end-to-end s", "compile run s", "peak MB",
                             "peak / kvpress (goal <= 0.3)", "KV MB", "answer", "passkey", "answer vs kvpress",
                             "kept overlap", "load", "measured"], rows) + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["parity", "memory"], nargs="?")
    p.add_argument("--sides", default=None, help=f"comma list of {SIDES} (default: parity kvpress,eager; memory all)")
    p.add_argument("--rules", default=None, help="parity: comma list of adakv:snapkv,snapkv (default both)")
    p.add_argument("--context", type=int, default=1024, help="parity: context tokens per prompt")
    p.add_argument("--prompts", type=int, default=2, help="parity: prompts (needle depths spread)")
    p.add_argument("--lengths", default="4096,8192", help="memory: context tokens, one prompt each")
    p.add_argument("--budget", type=int, default=None, help="B per layer and KV head (parity 256, memory 1024)")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy answer tokens (parity 8, memory 32)")
    p.add_argument("--head-pool", type=lambda s: {"true": True, "false": False}[s.lower()], default=None,
                   help="fxbudget's head_pool (default: the rule's)")
    p.add_argument("--report-only", action="store_true", help="run nothing: the report from the stored rows")
    p.add_argument("--peer-python", default=str(PEER_PYTHON))
    p.add_argument("--store", default=None, help="raw rows (default benchmarks/results/vs_kvpress_adakv/MODE.json)")
    p.add_argument("--out", default=None)
    add_worker_args(p)
    args = p.parse_args()
    if serve_worker(args, _worker_kvpress, _worker_fxbudget):
        return 0
    if args.mode is None:
        p.error("give a mode: parity or memory")

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchlib.env import command_line, env_info, header_lines, load_str  # noqa: E402
    from benchlib.output import analysis_link, write_md  # noqa: E402

    import torch
    from transformers import AutoTokenizer

    from fxbudget.models import default_cache_dir

    torch.set_num_threads(1)
    parity = args.mode == "parity"
    args.budget = args.budget or (256 if parity else 1024)
    args.new_tokens = args.new_tokens or (8 if parity else 32)
    args.store = args.store or str(ROOT / "benchmarks" / "results" / "vs_kvpress_adakv" / f"{args.mode}.json")
    name = "vs_kvpress_adakv" if parity else "vs_kvpress_adakv_memory"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"{name}.md")
    sides = (args.sides or ("kvpress,eager" if parity else ",".join(SIDES))).split(",")
    rules = (args.rules or ",".join(RULES)).split(",") if parity else ["adakv:snapkv"]
    bad = [s for s in sides if s not in SIDES] + [r for r in rules if r not in RULES]
    if bad:
        p.error(f"unknown side or rule {bad}; sides {SIDES}, rules {RULES}")
    if "kvpress" in sides and not args.report_only and not Path(args.peer_python).exists():
        sys.exit(f"peer venv missing ({args.peer_python}): run `bash benchmarks/peers/setup_kvpress.sh` first")
    info, command = env_info(), command_line()
    model_dir = str(default_cache_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    lengths = [args.context] if parity else [int(x) for x in args.lengths.split(",")]
    prompts, samples = _prompts(tok, lengths, args.prompts if parity else 1)
    headroom = max(len(x["q"]) for x in prompts) + args.new_tokens + 8
    settings = {"budget": args.budget, "new_tokens": args.new_tokens, "prompts": [[x["length"], x["depth"], x["seed"]]
                                                                                  for x in prompts]}
    store = json.loads(Path(args.store).read_text()) if Path(args.store).exists() else {}
    if store.get("settings", settings) != settings:
        sys.exit(f"{args.store} holds rows of other settings ({store['settings']}); give another --store")
    store["settings"] = settings
    base_job = {"model_dir": model_dir, "budget": args.budget, "new_tokens": args.new_tokens, "headroom": headroom,
                "warmup": {"ctx": prompts[0]["ctx"][:160], "q": prompts[0]["q"]}}
    plan = [(s, r, None if parity else L) for L in ([None] if parity else lengths) for r in rules for s in sides]
    if not args.report_only:
        _run(args, plan, prompts, samples, store, base_job)
    runs = [v for k, v in store.items() if k != "settings"]
    title = "fxbudget AdaKV vs kvpress AdaKVPress: " + ("kept-set parity" if parity else "peak memory at long context")
    lines = header_lines(title, info, command, load_after=load_str())
    kv_v = next((r["versions"] for r in runs if r["side"] == "kvpress"), None)
    dates = sorted({r["date"] for r in runs})
    lines += [
        f"- Rows measured {dates[0] if dates else '-'} to {dates[-1] if dates else '-'} (each row's date and 1-min "
        f"load at its end are in the raw rows, `{_rel(args.store)}`); the header's date and load "
        "are this report's.",
        f"- Peer: kvpress {kv_v['kvpress']}, transformers {kv_v['transformers']}, torch {kv_v['torch']} (its own venv)"
        if kv_v else "- Peer: not run", f"- Model: the embedded Qwen2.5-Coder-0.5B-Instruct, fp32, SDPA, CPU, 1 thread. "
        f"Prompts: passkey (`fxbudget.harness.tasks.passkey`), chat-formatted, context "
        f"{[len(x['ctx']) for x in prompts]} tokens, question {[len(x['q']) for x in prompts]} tokens, identical ids "
        f"on both sides.",
        f"- B = {args.budget} per layer and KV head on average (kvpress ratio 1 - (B + 0.5)/L); greedy answer <= "
        f"{args.new_tokens} tokens (EOS stops); fxbudget head-room {headroom}. Rules: fxbudget `adakv:snapkv` / "
        f"`snapkv` {SNAP} (alpha 0.2) vs kvpress `AdaKVPress(SnapKVPress({KV_SNAP}))` (alpha_safeguard 0.2) / "
        f"`SnapKVPress`.", ""]
    lines += _parity_report(args, store) if parity else _memory_report(args, store, lengths)
    lines += analysis_link(name)
    write_md(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
