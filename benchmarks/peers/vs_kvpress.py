"""fxbudget vs kvpress (the peer) on the embedded model: accuracy, end-to-end time, peak memory, kept-set overlap.

    bash benchmarks/peers/setup_kvpress.sh                                   # once: the peer venv
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peers/vs_kvpress.py [--quick] [--model gemma3-270m]

Two stacks, two venvs, never imported into each other: the kvpress side (kvpress 0.5.5, transformers 5.2.0) runs in
`benchmarks/peers/.venv-kvpress`, the fxbudget side in the project venv; this driver (project venv) builds the passkey
prompts once with `fxbudget.harness.tasks`, hands both sides the SAME token ids as JSON, and starts one fresh
subprocess per configuration (stack, rule, prefill mode), so each peak-memory figure is that configuration's own.

Protocol: query-agnostic (kvpress's pipeline default). The context is prefilled with compression down to the same
absolute budget B per layer and KV head; the question and a greedy answer (<= `--new-tokens`, EOS stops) are then
appended without compression. kvpress: `with press(model): model.model(context)` then the pipeline's own
`generate_answer` (its code, run on our ids). fxbudget: a `BudgetCache` with head-room; context through the compiled
model (eager kernel, `backend=None`), question and answer inside `cache.frozen()`.

kvpress takes a ratio: it keeps `int(L * (1 - ratio))` of an L-token context, so the driver passes
`ratio = 1 - (B + 0.5) / L` (exactly B kept; `1 - B/L` can round to B - 1) and checks the count.

Faithfulness: the kept token positions after the context, per layer and KV head. kvpress: the press's `compress` is
wrapped, and each kept key row is matched (exact equality) to the context row it was gathered from, so presses that
do not keep a plain top-k of one score (ChunkKVPress keeps whole chunks) are measured by what they really keep.
fxbudget: `cache.positions(layer)`. fxbudget runs each rule twice: one-shot prefill (the context in one call, so
eviction happens once after the whole context, as in kvpress: the semantics coincide) and chunked prefill
(`--chunk`; evicts as it goes, bounded memory: the configuration the memory goal is about).

`--model` picks another embedded model (`fxbudget.models.embedded`; a base model is prompted as plain text). On a
model with sliding layers (Gemma 3) fxbudget budgets the full-attention layers only and keeps each sliding layer's
window, while kvpress's BasePress hooks every layer of a text-only `Gemma3ForCausalLM` (it skips sliding layers for
`Gemma3ForConditionalGeneration` only): the overlap is taken over the full-attention layers (whose prefill does not
depend on what any layer's cache keeps, within one call) and reported per layer, beside what each stack holds on the
sliding layers.

Peak memory: in each fresh worker, after loading the model and a short warm-up (which pages in every weight), the
kernel's RSS high-water mark is reset (`/proc/self/clear_refs` = 5, which also resets `ru_maxrss`); the figure is
the high-water mark over the runs minus the RSS at that point. KV bytes held are reported beside it.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEER_PYTHON = HERE / ".venv-kvpress" / "bin" / "python"

# Rule parameters matched across the stacks (row name -> (fxbudget params, kvpress press class, press params)). A row
# name `rule@variant` runs fxbudget's `rule` with other parameters than its defaults.
RULES = {
    # kvpress SnapKVPress defaults: window 64, avg pool 5; fxbudget's own defaults are window 32, max pool 7.
    "snapkv": ({"window": 64, "kernel": 5, "pooling": "avg"}, "SnapKVPress", {"window_size": 64, "kernel_size": 5}),
    "knorm": ({}, "KnormPress", {}),
    "streamingllm": ({"n_sink": 4}, "StreamingLLMPress", {"n_sink": 4}),
    # kvpress TOVAPress averages the last query's attention over all heads of the layer: share_heads=True.
    "tova": ({"share_heads": True}, "TOVAPress", {}),
    "keydiff": ({}, "KeyDiffPress", {}),
    "observed_attention": ({}, "ObservedAttentionPress", {}),  # kvpress needs the eager attention (PEER_EAGER)
    # ChunkKVPress wraps a ScorerPress (here SnapKVPress at its defaults), which takes the compression ratio.
    "chunkkv": ({"window": 64, "kernel": 5, "chunk_length": 20}, "ChunkKVPress", {"chunk_length": 20}),
    "lagkv": ({}, "LagKVPress", {}),
    "cur": ({}, "CURPress", {}),
    # kvpress draws an unseeded Gaussian sketch per call (48 columns by default), fxbudget a fixed seeded one: the
    # default rows compare two draws. With more columns than the head dimension (64) the leverage hardly depends on
    # the sketch (exactly not, but for the 1e-2 jitter both add to the Gram matrix); with exactly 64 it still does:
    # a square Gaussian sketch is ill-conditioned and the jitter then matters.
    "leverage": ({}, "LeverageScorePress", {}),
    "leverage@64": ({"sketch_dimension": 64}, "LeverageScorePress", {"sketch_dimension": 64}),
    "leverage@128": ({"sketch_dimension": 128}, "LeverageScorePress", {"sketch_dimension": 128}),
    "compactor": ({}, "CompactorPress", {}),
    "compactor@64": ({"sketch_dimension": 64}, "CompactorPress", {"sketch_dimension": 64}),
    "compactor@128": ({"sketch_dimension": 128}, "CompactorPress", {"sketch_dimension": 128}),
}
PEER_EAGER = {"observed_attention"}  # presses that read the attention weights: the peer model runs eager attention


def fx_rule(row: str) -> str:
    """The fxbudget rule of a row name (`leverage@64` -> `leverage`)."""
    return row.split("@")[0]


# ----------------------------------------------------------------------------------------------------------------
# Worker side (runs in either venv: stdlib + torch at module level only)
# ----------------------------------------------------------------------------------------------------------------

def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_peak() -> int:
    """Free what can be freed, reset the RSS high-water mark; returns the RSS now (bytes)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    s = _status()
    return s["VmRSS"], reset


def _peak_since(base: int) -> dict:
    import resource

    s = _status()
    return {"peak_rss_delta_mb": (s["VmHWM"] - base) / 2**20,
            "ru_maxrss_delta_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / 2**20}


def _greedy(step, first_logits, eos: list[int], max_new: int) -> list[int]:
    """kvpress's generate_answer loop: first token from the question's logits, then max_new - 1 steps, EOS stops."""
    ids = [int(first_logits[0, -1].argmax())]
    for _ in range(max_new - 1):
        if ids[-1] in eos:
            break
        ids.append(int(step(ids[-1])[0, -1].argmax()))
    return ids


def kvpress_ratio(budget: int, L: int) -> float:
    """kvpress's compression ratio that keeps exactly `budget` of `L` context tokens: it keeps `int(L * (1 - ratio))`,
    and `1 - budget / L` can round to budget - 1."""
    return 1 - (budget + 0.5) / L


def kvpress_press(rule: str, budget: int, L: int):
    """kvpress's press of a `RULES` row, keeping `budget` of an `L`-token context (peer venv: imports kvpress)."""
    import kvpress

    _, cls, params = RULES[rule]
    ratio = kvpress_ratio(budget, L)
    if cls == "ChunkKVPress":  # wraps a ScorerPress (SnapKVPress at its defaults), which takes the ratio
        return kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=ratio), **params)
    return getattr(kvpress, cls)(compression_ratio=ratio, **params)


def _worker_kvpress(job: dict) -> dict:
    import torch
    import transformers
    from importlib.metadata import version

    from kvpress.pipeline import KVPressTextGenerationPipeline
    from kvpress.utils import compute_n_kept
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    rule, budget = job["rule"], job["budget"]
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32,
                                                 attn_implementation="eager" if rule in PEER_EAGER else "sdpa").eval()
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device="cpu")
    recorded: dict[int, list] = {}

    def make_press(L: int, budget: int):
        if rule == "full":
            return None, L
        press = kvpress_press(rule, budget, L)
        orig = press.compress

        def compress(module, hidden_states, keys, values, *a, **k):
            # Record which context positions each layer kept: every kept key row is one of the input rows (pruning
            # gathers rows), found by exact equality, so this holds for presses that do not rank by one score.
            kept_k, kept_v = orig(module, hidden_states, keys, values, *a, **k)
            same = (kept_k[0].unsqueeze(2) == keys[0].unsqueeze(1)).all(-1)  # [heads, kept, L]
            assert bool(same.any(-1).all()), "a kept key matches no input key"
            recorded[module.layer_idx] = sorted_rows(same.to(torch.int8).argmax(-1))
            return kept_k, kept_v

        def sorted_rows(idx):
            return [sorted(set(row)) for row in idx.tolist()]

        press.compress = compress
        return press, compute_n_kept(L, kvpress_ratio(budget, L))

    def run(ctx_ids, q_ids, max_new, budget=budget):
        ctx = torch.tensor([ctx_ids])
        q = torch.tensor([q_ids])
        L = ctx.shape[1]
        press, n_kept = make_press(L, budget)
        recorded.clear()
        cache = DynamicCache()
        t0 = time.perf_counter()
        with torch.no_grad():
            with press(model) if press is not None else _null():
                model.model(input_ids=ctx, past_key_values=cache)  # the pipeline's prefill, verbatim
            t1 = time.perf_counter()
            kv_after_ctx = sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
                               for l in cache.layers)
            answer = pipe.generate_answer(question_ids=q, cache=cache, context_length=L, max_new_tokens=max_new)
        t2 = time.perf_counter()
        kept = [recorded[i] for i in sorted(recorded)] if press is not None else None
        kv_end = sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
                     for l in cache.layers)
        return {"answer": answer, "prefill_s": t1 - t0, "answer_s": t2 - t1, "total_s": t2 - t0, "n_kept": n_kept,
                "kept": kept, "kv_bytes_after_context": kv_after_ctx, "kv_bytes_end": kv_end,
                "held_after_context": int(cache.layers[0].keys.shape[2])}

    w = job["warmup"]
    run(w["ctx"], w["q"], 2, budget=len(w["ctx"]) // 2)  # pages in every weight, first-call overheads
    base, reset = _reset_peak()
    results = [run(p["ctx"], p["q"], job["new_tokens"]) for p in job["prompts"]]
    return {"side": "kvpress", "rule": rule, "mode": "full prefill", "results": results, "base_rss_mb": base / 2**20,
            "hwm_reset": reset, **_peak_since(base),
            "versions": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                         "torch": torch.__version__}, "load": os.getloadavg(),
            "threads": torch.get_num_threads()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _worker_fxbudget(job: dict) -> dict:
    import torch
    import transformers

    import fxbudget
    from fxbudget.models import load_embedded

    torch.set_num_threads(1)
    model, tok = load_embedded(job["model"], progress=False)
    rule, budget, chunk = job["rule"], job["budget"], job["chunk"]
    params = RULES[rule][0]
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    model = fxbudget.compile(model, rule=fx_rule(rule), budget=budget, chunk_size=chunk, backend=None,
                             headroom=job["headroom"], **params)

    def run(ctx_ids, q_ids, max_new):
        ctx = torch.tensor([ctx_ids])
        q = torch.tensor([q_ids])
        cache = model.forward.new_cache(1)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
            t1 = time.perf_counter()
            kept = []
            for i in range(len(cache.layers)):
                pos = cache.positions(i)[0]
                kept.append([sorted(int(x) for x in row if x >= 0) for row in pos.tolist()])
            with cache.frozen():
                out = model(input_ids=q, past_key_values=cache, logits_to_keep=1)
                ids = _greedy(lambda t: model(input_ids=torch.tensor([[t]]), past_key_values=cache).logits,
                              out.logits, eos, max_new)
        t2 = time.perf_counter()
        return {"answer": tok.decode(ids, skip_special_tokens=True), "prefill_s": t1 - t0, "answer_s": t2 - t1,
                "total_s": t2 - t0, "kept": kept, "kv_bytes_allocated": cache.kv_bytes(),
                "held_after_context": len(kept[0][0])}

    w = job["warmup"]
    run(w["ctx"], w["q"], 2)
    base, reset = _reset_peak()
    results = [run(p["ctx"], p["q"], job["new_tokens"]) for p in job["prompts"]]
    return {"side": "fxbudget", "rule": rule, "mode": f"chunked {chunk}" if chunk else "one-shot",
            "results": results, "base_rss_mb": base / 2**20, "hwm_reset": reset, **_peak_since(base),
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
            "load": os.getloadavg(), "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------------------------------------------
# Driver (project venv)
# ----------------------------------------------------------------------------------------------------------------

def _overlap(a: list, b: list) -> list[float]:
    """Per (layer, head): |A & B| / max(|A|, |B|)."""
    out = []
    for la, lb in zip(a, b):
        for ha, hb in zip(la, lb):
            sa, sb = set(ha), set(hb)
            out.append(len(sa & sb) / max(len(sa), len(sb), 1))
    return out


def _run_worker(python: str, side: str, job: dict, env: dict, script: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="vs_kvpress_") as d:
        jp, rp = Path(d) / "job.json", Path(d) / "result.json"
        jp.write_text(json.dumps(job))
        proc = subprocess.run([python, str(Path(script or __file__).resolve()), "--worker", side, "--job", str(jp),
                               "--result", str(rp)], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not rp.exists():
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise RuntimeError(f"{side} worker failed for {job['rule']} (rc {proc.returncode})")
        return json.loads(rp.read_text())


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """The hidden options a driver's subprocess side is started with (`_run_worker`): which stack, job and result."""
    p.add_argument("--worker", choices=["kvpress", "fxbudget"], help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)


def serve_worker(args, kvpress_worker, fxbudget_worker) -> bool:
    """In a worker subprocess (`--worker`): run the job file with that stack's worker, write its JSON result; True.
    False in the driver itself."""
    if not args.worker:
        return False
    job = json.loads(Path(args.job).read_text())
    res = (kvpress_worker if args.worker == "kvpress" else fxbudget_worker)(job)
    Path(args.result).write_text(json.dumps(res))
    return True


def _span(sizes: list[int]) -> str:
    """Sorted set sizes as `n` when all equal, else `min-max`."""
    return f"{sizes[0]}" if len(set(sizes)) == 1 else f"{sizes[0]}-{sizes[-1]}"


def per_layer_section(args, runs: list, rules: list, find, compared: list, L: list) -> list[str]:
    """For a model with sliding layers: the overlap per compared (full-attention) layer and prompt, and what each
    stack holds on the other layers (kvpress's BasePress compresses every layer of a text-only model, fxbudget keeps a
    sliding layer's window)."""
    sliding = [i for i in range(len(runs[0]["results"][0]["kept"])) if i not in compared]
    modes = ("one",) if args.no_chunked else ("one", "chunk")
    out = ["## Per full-attention layer", "",
           f"Overlap per compared layer, per prompt (context lengths {L}), one KV head each; the last columns: the "
           f"sizes of the sets held after the context on the {len(sliding)} other (sliding) layers.", "",
           "| rule | fxbudget prefill | layer | " + " | ".join(f"{n} tokens" for n in L) + " | mean | "
           "kvpress held on sliding layers | fxbudget held on sliding layers |",
           "|---|---|---|" + "---|" * len(L) + "---|---|---|"]

    def held(res) -> str:
        return _span(sorted({len(h) for x in res for i in sliding for h in x["kept"][i]}))

    for rule in rules:
        k = find("kvpress", rule, "full")
        for mode in modes:
            f = find("fxbudget", rule, mode)
            for i in compared:
                per = [statistics.mean(_overlap([xf["kept"][i]], [xk["kept"][i]]))
                       for xk, xf in zip(k["results"], f["results"])]
                out.append(f"| {rule} | {f['mode']} | {i} | " + " | ".join(f"{o:.4f}" for o in per)
                           + f" | {statistics.mean(per):.4f} | {held(k['results'])} | {held(f['results'])} |")
    return out + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 prompt of 1K tokens, budget 256, snapkv and knorm only")
    p.add_argument("--model", default=None,
                   help="an embedded model's `--model` key (fxbudget.models.embedded; default: the default one, "
                        "Qwen2.5-Coder-0.5B-Instruct); on a model with sliding layers the overlap is over its "
                        "full-attention layers, the ones a budget applies to, with a per-layer table")
    p.add_argument("--context", type=int, nargs="+", default=[2048],
                   help="context length(s) in tokens (passkey haystack); --prompts prompts at each")
    p.add_argument("--budget", type=int, default=512, help="absolute KV budget per layer and KV head")
    p.add_argument("--chunk", type=int, default=256, help="fxbudget's chunked-prefill chunk size")
    p.add_argument("--prompts", type=int, default=2, help="passkey prompts (depths spread over the context)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--no-full", action="store_true", help="skip the uncompressed reference row")
    p.add_argument("--no-chunked", action="store_true",
                   help="fxbudget one-shot prefill only (the faithfulness rows; no chunked rows, no goals table)")
    p.add_argument("--timing-rounds", type=int, default=0,
                   help="extra rounds, after the main rows: kvpress and fxbudget chunked alternated per rule on the "
                        "first prompt, for a side-by-side time ratio on a shared machine")
    p.add_argument("--timing-only", action="store_true", help="only the --timing-rounds rows (no main table)")
    p.add_argument("--peer-python", default=str(PEER_PYTHON))
    p.add_argument("--out", default=None,
                   help="the report (default: benchmarks/results/vs_kvpress.md; with --model: vs_kvpress_<key>.md)")
    p.add_argument("--json-out", default=None, help="also write the raw results here (rewritten after every row)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="run nothing: write the report from the raw results of earlier runs with the same prompt "
                        "options (a later file's row replaces an earlier one's for the same stack, rule and mode)")
    add_worker_args(p)
    args = p.parse_args()

    if serve_worker(args, _worker_kvpress, _worker_fxbudget):
        return 0

    if args.quick:
        args.context, args.budget, args.prompts, args.rules = [1024], 256, 1, "snapkv,knorm"
    if not Path(args.peer_python).exists():
        sys.exit(f"peer venv missing ({args.peer_python}): run `bash benchmarks/peers/setup_kvpress.sh` first")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    from benchlib.env import command_line, env_info, header_lines, load_str  # noqa: E402
    from benchlib.output import analysis_link, md_table, write_md  # noqa: E402

    import torch
    from transformers import AutoConfig

    from fxbudget.harness.tasks import chat_ids, passkey
    from fxbudget.models import default_cache_dir, embedded_tokenizer
    from fxbudget.models.embedded import DEFAULT, EMBEDDED
    from fxbudget.models.layer_config import FULL, budgeted_layers_line, layer_types

    torch.set_num_threads(1)
    info = env_info()
    command = command_line()
    if args.model is not None and args.model not in EMBEDDED:
        sys.exit(f"--model {args.model}: not an embedded model (one of {', '.join(EMBEDDED)})")
    entry = EMBEDDED[args.model] if args.model else DEFAULT
    args.out = args.out or str(ROOT / "benchmarks" / "results" /
                               ("vs_kvpress.md" if entry is DEFAULT else f"vs_kvpress_{entry.key}.md"))
    model_dir = str(default_cache_dir(entry))
    tok = embedded_tokenizer(entry, model_dir)  # a base model's without a chat template: plain-text prompts
    config = AutoConfig.from_pretrained(model_dir)
    # The layers compared: those a budget applies to (full attention); kvpress may compress the others too.
    compared = [i for i, t in enumerate(layer_types(config)) if t == FULL]
    every_layer = len(compared) == config.num_hidden_layers
    depths = [0.5] if args.prompts == 1 else [round(0.1 + 0.8 * i / (args.prompts - 1), 2) for i in range(args.prompts)]
    prompts, samples = [], []
    for n_tokens in args.context:
        for i, depth in enumerate(depths):
            s = passkey(tok, n_tokens, depth=depth, seed=i)
            ctx, q = chat_ids(tok, s)
            prompts.append({"ctx": ctx[0].tolist(), "q": q[0].tolist()})
            samples.append(s)
    warm = {"ctx": prompts[0]["ctx"][:160], "q": prompts[0]["q"]}
    headroom = max(len(p_["q"]) for p_ in prompts) + args.new_tokens + 8
    rules = [r for r in args.rules.split(",") if r]
    base_job = {"model": entry.key, "model_dir": model_dir, "budget": args.budget, "prompts": prompts, "warmup": warm,
                "new_tokens": args.new_tokens, "headroom": headroom}
    env_k = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env_k.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env_f = {**env_k, "PYTHONPATH": str(ROOT)}
    runs = []
    plan = ([] if args.no_full else [("kvpress", "full", None)])
    for r in rules:
        plan += [("kvpress", r, None), ("fxbudget", r, None)]
        plan += [] if args.no_chunked else [("fxbudget", r, args.chunk)]
    if args.timing_only:
        plan = []
    for i in range(args.timing_rounds):
        for r in rules:  # alternate which stack goes first
            pair = [("kvpress", r, None, "timing"), ("fxbudget", r, args.chunk, "timing")]
            plan += pair if i % 2 == 0 else pair[::-1]
    if args.from_json:
        plan, merged = [], {}
        for f in args.from_json:
            for r_ in json.loads(Path(f).read_text())["runs"]:
                merged[(r_["side"], r_["rule"], r_["mode"], r_.get("timing", False))] = r_
        runs = [r_ for r_ in merged.values() if r_["rule"] in rules or r_["rule"] == "full"]
    for side, rule, chunk, *tag in plan:
        print(f"[{time.strftime('%H:%M:%S')}] {side} {rule} {'chunk ' + str(chunk) if chunk else ''} {tag} "
              f"(load {load_str()})", flush=True)
        job = {**base_job, "rule": rule, "chunk": chunk}
        if tag:
            job["prompts"] = prompts[:1]
        res = _run_worker(args.peer_python if side == "kvpress" else sys.executable, side, job,
                          env_k if side == "kvpress" else env_f)
        res["timing"] = bool(tag)
        for r_, s in zip(res["results"], samples):
            r_["ok"] = s.answer in r_["answer"]
        print("   ", [(round(x["total_s"], 1), x["answer"], x["ok"]) for x in res["results"]],
              f"peak +{res['peak_rss_delta_mb']:.0f} MB", flush=True)
        runs.append(res)
        if args.json_out:  # after every row: a long run interrupted keeps what it measured
            Path(args.json_out).write_text(json.dumps({"args": vars(args), "runs": runs, "prompts": [
                {**p_, "answer": s.answer} for p_, s in zip(prompts, samples)]}))

    # ---- report
    timing_runs = [r for r in runs if r.get("timing")]
    runs = [r for r in runs if not r.get("timing")]

    def find(side, rule, mode_prefix):
        return next((r for r in runs if r["side"] == side and r["rule"] == rule and r["mode"].startswith(mode_prefix)),
                    None)

    def timing_section() -> list[str]:
        if not timing_runs:
            return []
        out = ["## Side-by-side time (kvpress and fxbudget chunked alternated, first prompt)", "",
               f"{args.timing_rounds} rounds; in each round the two stacks run back to back in fresh processes "
               "(the first of the pair alternates between rounds); end-to-end seconds (prefill s in brackets) and "
               "the 1-min load average at the end of each run.", "",
               "| rule | round | kvpress s | fxbudget chunked s | kvpress / fxbudget | load |", "|---|---|---|---|---|---|"]
        for rule in rules:
            ks = [r for r in timing_runs if r["rule"] == rule and r["side"] == "kvpress"]
            fs = [r for r in timing_runs if r["rule"] == rule and r["side"] == "fxbudget"]
            for i, (k, f) in enumerate(zip(ks, fs)):
                tk, tf = k["results"][0], f["results"][0]
                out.append(f"| {rule} | {i + 1} | {tk['total_s']:.1f} ({tk['prefill_s']:.1f}) | {tf['total_s']:.1f} "
                           f"({tf['prefill_s']:.1f}) | {tk['total_s'] / tf['total_s']:.2f} | "
                           f"{k['load'][0]:.1f} / {f['load'][0]:.1f} |")
        return out + [""]

    if args.timing_only:
        lines = header_lines("fxbudget vs kvpress: side-by-side time", info, command, load_after=load_str())
        write_md(args.out, lines + timing_section())
        return 0

    kv_versions = next(r["versions"] for r in runs if r["side"] == "kvpress")
    L = [len(p_["ctx"]) for p_ in prompts]
    lines = header_lines("fxbudget vs kvpress (query-agnostic, embedded model)", info, command,
                         load_after=load_str())
    lines += [
        f"- Peer stack: kvpress {kv_versions['kvpress']}, transformers {kv_versions['transformers']}, torch "
        f"{kv_versions['torch']} (separate venv, `benchmarks/peers/setup_kvpress.sh`); fxbudget side: the project venv "
        f"above, eager kernel (`backend=None`).",
        f"- Model: {entry.name} fp32, SDPA, CPU, 1 thread. Prompts: {len(prompts)} passkey prompts "
        f"(`fxbudget.harness.tasks.passkey`, seeds 0..{args.prompts - 1}, depths {depths}"
        f"{'' if len(args.context) == 1 else ' at each context length'}), "
        f"{'chat-formatted' if entry.chat else 'plain text (a base model: no chat template)'}, context "
        f"{L} tokens + question {[len(p_['q']) for p_ in prompts]} tokens; identical token ids on both sides.",
        f"- Budget B = {args.budget} entries per layer and KV head on both sides (kvpress ratio = 1 - (B + 0.5)/L, "
        f"kept = {sorted({x['n_kept'] for r in runs if r['side'] == 'kvpress' and r['rule'] != 'full' for x in r['results']})}); "
        f"greedy answer <= {args.new_tokens} tokens; fxbudget head-room {headroom} slots for question + answer; "
        f"fxbudget chunked prefill: chunks of {args.chunk}.",
        "- Rule parameters: " + "; ".join(f"{r}: fxbudget {RULES[r][0] or '{}'} / kvpress {RULES[r][1]}"
                                             f"{RULES[r][2] or ''}" for r in rules), "",
    ]
    if not every_layer:
        lines[-1:] = [f"- Layers: {budgeted_layers_line(config)} (fxbudget); the overlap tables compare layers "
                      f"{compared} only (see the per-layer table).", ""]
    # Table 1: accuracy + time + memory
    lines += ["## Accuracy, end-to-end time, peak memory", "",
              "Time: context prefill + question + greedy answer, median over prompts (fresh process per row, rows run "
              "one after another, so neighbouring rows saw similar machine states; load: 1-min load average at the end of the row). Peak: RSS "
              "high-water mark over the prompts minus RSS after load + warm-up. KV: bytes of keys + values held after "
              "the context (kvpress) / allocated (fxbudget: B + head-room slots, fixed).", ""]
    rows = []
    for r in runs:
        res = r["results"]
        acc = sum(x["ok"] for x in res)
        tot = statistics.median(x["total_s"] for x in res)
        pre = statistics.median(x["prefill_s"] for x in res)
        kv = res[0].get("kv_bytes_after_context", res[0].get("kv_bytes_allocated"))
        rows.append([r["side"], r["rule"], r["mode"], f"{acc}/{len(res)}", " / ".join(repr(x["answer"]) for x in res),
                     f"{pre:.1f}", f"{tot:.1f}", f"{r['peak_rss_delta_mb']:.0f}", f"{kv / 2**20:.1f}",
                     "/".join(f"{x:.1f}" for x in r["load"][:1])])
    lines += md_table(["stack", "rule", "prefill", "passkey", "answers", "prefill s", "end-to-end s", "peak MB",
                       "KV MB", "load"], rows)
    lines += [""]
    # Table 2: ratios for the goals
    if not args.no_chunked:
        lines += ["## Goals: fxbudget chunked vs kvpress (same rule)", "",
                  "| rule | time kvpress / fxbudget chunked (goal >= 2) | time kvpress / fxbudget one-shot | peak "
                  "fxbudget chunked / kvpress (goal <= 0.5) | peak fxbudget one-shot / kvpress |",
                  "|---|---|---|---|---|"]
        for rule in rules:
            k, f1, fc = find("kvpress", rule, "full"), find("fxbudget", rule, "one"), find("fxbudget", rule, "chunk")
            tk = statistics.median(x["total_s"] for x in k["results"])
            t1 = statistics.median(x["total_s"] for x in f1["results"])
            tc = statistics.median(x["total_s"] for x in fc["results"])
            lines.append(f"| {rule} | {tk / tc:.2f} | {tk / t1:.2f} | "
                         f"{fc['peak_rss_delta_mb'] / k['peak_rss_delta_mb']:.2f}"
                         f" | {f1['peak_rss_delta_mb'] / k['peak_rss_delta_mb']:.2f} |")
        lines += [""]
    # Table 3: overlap
    lines += ["## Faithfulness: overlap of the kept position sets after the context", "",
              "Per layer and KV head, |kept by fxbudget & kept by kvpress| / max(sizes) (= / B where both keep B); "
              "over all layers x KV heads x prompts. `kvpress kept`: the sizes of kvpress's kept sets; `kvpress "
              "set covered`: |both| / |kept by kvpress| (mean), which differs from the overlap only where kvpress "
              "keeps fewer than B (chunkkv keeps whole chunks).",
              "", "| rule | fxbudget prefill | mean overlap (goal >= 0.99) | min | heads identical | heads | "
              "kvpress kept | kvpress set covered |", "|---|---|---|---|---|---|---|---|"]
    overlaps = {}

    def layers(kept: list) -> list:
        """The compared layers' kept sets (every layer but sliding ones)."""
        assert len(kept) == config.num_hidden_layers, "kept sets of some layers only"
        return [kept[i] for i in compared]

    for rule in rules:
        k = find("kvpress", rule, "full")
        for mode in ("one",) if args.no_chunked else ("one", "chunk"):
            f = find("fxbudget", rule, mode)
            ov, cov = [], []
            for xk, xf in zip(k["results"], f["results"]):
                kf, kk = layers(xf["kept"]), layers(xk["kept"])
                ov += _overlap(kf, kk)
                cov += [len(set(a) & set(b)) / max(len(b), 1) for la, lb in zip(kf, kk) for a, b in zip(la, lb)]
            sizes = sorted({len(h) for x in k["results"] for la in layers(x["kept"]) for h in la})
            overlaps[(rule, mode)] = ov
            lines.append(f"| {rule} | {f['mode']} | {statistics.mean(ov):.4f} | {min(ov):.3f} | "
                         f"{sum(o == 1.0 for o in ov)} | {len(ov)} | "
                         f"{_span(sizes)} | {statistics.mean(cov):.4f} |")
    lines += [""]
    if not every_layer:
        lines += per_layer_section(args, runs, rules, find, compared, L)
    lines += timing_section()
    lines += analysis_link(Path(args.out).stem)
    write_md(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
