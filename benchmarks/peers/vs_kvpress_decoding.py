"""fxbudget's decode-time eviction at an interval vs kvpress's DecodingPress: kept sets after N forced decode steps.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peers/vs_kvpress_decoding.py [--peer-python PY]

Issue 43 item 3's parity check, on one rule (knorm: `KnormPress`, a pointwise score, so the difference between the
two stacks is the step counting and the cache handling, not the scoring). Same plumbing as `vs_kvpress.py` (two
venvs, token ids as JSON, one fresh subprocess per side and configuration).

Protocol, per configuration (prompt of P tokens, budget / target B, interval k, N decode steps):
- fxbudget (project venv): `fxbudget.compile(model, rule="knorm", budget=B, interval=k, backend=None)`; the prompt in
  ONE call (evicts to B once, after the whole prompt, when P > B), then N greedy decode steps, one token per call.
  Its greedy tokens are the forced tokens of both sides.
- kvpress (peer venv): `DecodingPress(KnormPress(), compression_interval=k, target_size=B)`; when P > B it is wrapped
  in `PrefillDecodingPress(prefilling_press=KnormPress(1 - (B + 0.5) / P), decoding_press=...)` (kvpress's
  DecodingPress leaves the prefill alone; this compresses it once to exactly B, as fxbudget's one-call prefill does).
  The prompt in one call `model.model(prompt, cache)`, then the SAME N tokens fed one per call (teacher-forced); its
  own argmax at each step is recorded (agreement with the forced tokens is reported, never used).

Step counting, both sides: step i (1-based) feeds the i-th generated token. kvpress's hook runs after the layer's
attention of each decode call, counts the call (per layer; every layer sees every call, so the counts agree) and at
count k compresses the layer's cache (prompt + i tokens held, its own token included) to B and restarts the count:
steps k, 2k, ... evict. fxbudget counts decode calls per cache since the last evicting call (the prompt call evicts
and restarts the count): steps k, 2k, ... evict, after the attention, over up to B + k entries. The per-step held
counts of both sides are recorded and compared (row `held sequence`), so the alignment is measured, not assumed.

Kept sets: fxbudget `cache.head_positions(layer)`; kvpress has no positions, so the driver tracks them: each layer
holds a list of positions per KV head, row by row (the prompt; each decode call appends its position); the base
press's `compress` is wrapped and each kept key row is matched to the row it was gathered from (exact equality, as in
`vs_kvpress.py`), which maps the kept rows back to positions. kvpress's gather leaves the kept rows in top-k order,
not in position order, so the list follows the rows' order (sorting it would mislabel every later compression).
Compared after every evicting step and after step N: per layer and KV head, |A & B| / max(|A|, |B|).

Writes results/vs_kvpress_decoding.md and a small results/vs_kvpress_decoding.json (per-configuration summaries and
the forced tokens; `--json-out FILE` keeps the full kept sets).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vs_kvpress import PEER_PYTHON, ROOT, add_worker_args, _overlap, _run_worker, serve_worker  # noqa: E402

RULE = "knorm"
QUESTION = "Explain the following design notes in your own words, in detail, section by section:\n\n"


# ----------------------------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------------------------

def _worker_fxbudget(job: dict) -> dict:
    import torch

    import fxbudget
    from fxbudget.models import load_default

    torch.set_num_threads(1)
    model, _ = load_default(progress=False)
    k, B, N = job["interval"], job["budget"], job["steps"]
    model = fxbudget.compile(model, rule=RULE, budget=B, interval=k, backend=None)
    cache = model.forward.new_cache(1)
    n_layers = len(cache.layers)

    def kept():
        return [[sorted(int(x) for x in row if x >= 0) for row in cache.head_positions(i)[0].tolist()]
                for i in range(n_layers)]

    tokens, held, evicting, checkpoints = [], [], [], {}
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([job["prompt"]]), past_key_values=cache, logits_to_keep=1).logits
        held_prompt = [int(cache.head_counts(i)[0].max()) for i in range(n_layers)]
        for i in range(1, N + 1):
            t = int(logits[0, -1].argmax())
            tokens.append(t)
            logits = model(input_ids=torch.tensor([[t]]), past_key_values=cache).logits
            counts = cache.head_counts(0)[0].tolist()
            held.append(max(counts))
            evicting.append(bool(cache.evicting))
            if i % k == 0 or i == N:
                checkpoints[i] = kept()
    return {"tokens": tokens, "held": held, "held_after_prompt": held_prompt, "evicting": evicting,
            "checkpoints": checkpoints, "seconds": time.perf_counter() - t0, "n_layers": n_layers}


def _worker_kvpress(job: dict) -> dict:
    import torch
    import transformers
    from importlib.metadata import version

    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    k, B, N, P = job["interval"], job["budget"], job["steps"], len(job["prompt"])
    n_layers = model.config.num_hidden_layers
    kv_heads = model.config.num_key_value_heads
    held_pos: dict[int, list[list[int]]] = {}  # layer -> per KV head, the positions its cache rows hold, in order
    compressions: dict[int, list[int]] = {i: [] for i in range(n_layers)}  # layer -> steps at which it compressed
    step = {"i": 0}

    def track(module, keys, kept_k):
        """Map the kept key rows of one compression back to positions (rows appended since the last one: the newest
        positions, in order)."""
        i = module.layer_idx
        n, total = keys.shape[2], P + step["i"]
        prev = held_pos.get(i, [[] for _ in range(kv_heads)])
        rows = [h + list(range(total - (n - len(h)), total)) for h in prev]
        assert all(len(r) == n for r in rows)
        same = (kept_k[0].unsqueeze(2) == keys[0].unsqueeze(1)).all(-1)  # [heads, kept, n]
        assert bool(same.any(-1).all()), "a kept key matches no held key"
        idx = same.to(torch.int8).argmax(-1).tolist()
        assert all(len(set(ix)) == len(ix) for ix in idx), "two kept rows match one held key"
        # Kept row m was gathered from held row ix[m]: the top-k order, not the positions' order, so the list keeps
        # the rows' order (the rows appended later go after them).
        held_pos[i] = [[r[j] for j in ix] for r, ix in zip(rows, idx)]
        compressions[i].append(step["i"])

    def wrap(press):
        orig = press.compress

        def compress(module, hidden_states, keys, values, *a, **kw):
            kept_k, kept_v = orig(module, hidden_states, keys, values, *a, **kw)
            track(module, keys, kept_k)
            return kept_k, kept_v

        press.compress = compress
        return press

    decoding = kvpress.DecodingPress(base_press=wrap(kvpress.KnormPress()), compression_interval=k, target_size=B)
    if P > B:
        press = kvpress.PrefillDecodingPress(prefilling_press=wrap(kvpress.KnormPress(1 - (B + 0.5) / P)),
                                             decoding_press=decoding)
    else:
        press = decoding

    def kept(cache):
        out = []
        for i in range(n_layers):
            n = cache.layers[i].keys.shape[2]
            prev = held_pos.get(i, [[] for _ in range(kv_heads)])
            total = P + step["i"]
            out.append([sorted(h + list(range(total - (n - len(h)), total))) for h in prev])
        return out

    cache = DynamicCache()
    argmax, held, checkpoints = [], [], {}
    t0 = time.perf_counter()
    with torch.no_grad(), press(model):
        logits = model(input_ids=torch.tensor([job["prompt"]]), past_key_values=cache, logits_to_keep=1).logits
        held_prompt = [int(cache.layers[i].keys.shape[2]) for i in range(n_layers)]
        for i, t in enumerate(job["tokens"], 1):
            argmax.append(int(logits[0, -1].argmax()))
            step["i"] = i
            # The pipeline's `generate_answer` call: explicit RoPE positions (the compressed cache is shorter than
            # the sequence), the cache position derived from the cache's length.
            logits = model(input_ids=torch.tensor([[t]]), past_key_values=cache,
                           position_ids=torch.tensor([[P + i - 1]])).logits
            held.append(int(cache.layers[0].keys.shape[2]))
            if i % k == 0 or i == N:
                checkpoints[i] = kept(cache)
    return {"argmax": argmax, "held": held, "held_after_prompt": held_prompt, "checkpoints": checkpoints,
            "compressions": compressions, "seconds": time.perf_counter() - t0,
            "versions": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                         "torch": torch.__version__}}


# ----------------------------------------------------------------------------------------------------------------
# Driver (project venv)
# ----------------------------------------------------------------------------------------------------------------

def _prompt(tok, n: int) -> list[int]:
    """A chat prompt of about `n` tokens: the question, then the start of docs/DESIGN.md (natural text, so the
    answer is long and few keys repeat)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    body = tok(text, add_special_tokens=False)["input_ids"]

    def build(m):
        msg = QUESTION + tok.decode(body[:m])
        return tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)

    lo, hi = 1, len(body)
    while lo < hi:  # the longest body whose prompt has at most n tokens
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(build(mid)) <= n else (lo, mid - 1)
    ids = build(lo)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _steps(xs: list[int]) -> str:
    """A list of steps, an arithmetic progression of more than 4 written `a, b, ..., z (n steps)`."""
    if len(xs) > 4 and all(b - a == xs[1] - xs[0] for a, b in zip(xs, xs[1:])):
        return f"{xs[0]}, {xs[1]}, ..., {xs[-1]} ({len(xs)} steps)"
    return ", ".join(map(str, xs))


def _compare(f: dict, kv: dict, k: int, N: int) -> dict:
    per_ckpt = {}
    for i in sorted(int(x) for x in f["checkpoints"]):
        ov = _overlap(f["checkpoints"][str(i)] if str(i) in f["checkpoints"] else f["checkpoints"][i],
                      kv["checkpoints"][str(i)] if str(i) in kv["checkpoints"] else kv["checkpoints"][i])
        per_ckpt[i] = {"mean": statistics.mean(ov), "min": min(ov), "identical": sum(o == 1.0 for o in ov),
                       "heads": len(ov)}
    final = per_ckpt[N]
    comp_steps = sorted({tuple(v) for v in kv["compressions"].values()})
    return {"final": final, "checkpoints": per_ckpt, "held_same": f["held"] == kv["held"],
            "held_prompt_same": f["held_after_prompt"] == kv["held_after_prompt"],
            "fx_evicting_steps": [i for i, e in enumerate(f["evicting"], 1) if e],
            "kv_compression_steps": [list(c) for c in comp_steps],
            "argmax_agree": sum(a == t for a, t in zip(kv["argmax"], f["tokens"])),
            "first_argmax_diff": next((i for i, (a, t) in enumerate(zip(kv["argmax"], f["tokens"]), 1) if a != t),
                                      None)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="400:256,240:256",
                   help="comma list of PROMPT_TOKENS:BUDGET (prompt > budget: kvpress PrefillDecodingPress)")
    p.add_argument("--intervals", default="8,64")
    p.add_argument("--steps", type=int, default=128, help="N forced decode steps")
    p.add_argument("--peer-python", default=str(PEER_PYTHON))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_kvpress_decoding.md"))
    p.add_argument("--summary-json", default=str(ROOT / "benchmarks" / "results" / "vs_kvpress_decoding.json"))
    p.add_argument("--json-out", default=None, help="also keep the raw worker results (kept sets included)")
    add_worker_args(p)
    args = p.parse_args()
    if serve_worker(args, _worker_kvpress, _worker_fxbudget):
        return 0

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchlib.env import command_line, env_info, header_lines, load_str  # noqa: E402
    from benchlib.output import analysis_link, md_table, write_md  # noqa: E402
    from transformers import AutoTokenizer

    from fxbudget.models import default_cache_dir

    if not Path(args.peer_python).exists():
        sys.exit(f"peer venv missing ({args.peer_python}): run `bash benchmarks/peers/setup_kvpress.sh` first")
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    intervals = [int(x) for x in args.intervals.split(",")]
    if args.steps < 1 or any(k < 1 or k > args.steps for k in intervals):
        sys.exit(f"each interval must be in 1..steps ({args.steps}); got {intervals}")
    info, command = env_info(), command_line()
    model_dir = str(default_cache_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    env_k = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env_k.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env_f = {**env_k, "PYTHONPATH": str(ROOT)}
    rows, summary, raw, versions = [], [], [], None
    for n_prompt, B in configs:
        prompt = _prompt(tok, n_prompt)
        P = len(prompt)
        for k in intervals:
            job = {"model_dir": model_dir, "prompt": prompt, "budget": B, "interval": k, "steps": args.steps,
                   "rule": RULE}
            print(f"[{time.strftime('%H:%M:%S')}] P {P} B {B} k {k}: fxbudget (load {load_str()})", flush=True)
            f = _run_worker(sys.executable, "fxbudget", job, env_f, script=Path(__file__))
            print(f"[{time.strftime('%H:%M:%S')}] P {P} B {B} k {k}: kvpress", flush=True)
            kv = _run_worker(args.peer_python, "kvpress", {**job, "tokens": f["tokens"]}, env_k,
                             script=Path(__file__))
            versions = kv["versions"]
            c = _compare(f, kv, k, args.steps)
            fin = c["final"]
            press = "PrefillDecodingPress(KnormPress, DecodingPress)" if P > B else "DecodingPress"
            print("   ", json.dumps({x: c[x] for x in c if x != "checkpoints"}), flush=True)
            ck = c["checkpoints"]
            rows.append([P, B, k, args.steps, press, f"{fin['mean']:.4f}", f"{fin['min']:.3f}",
                         f"{fin['identical']}/{fin['heads']}",
                         f"{min(v['mean'] for v in ck.values()):.4f}",
                         "yes" if c["held_same"] and c["held_prompt_same"] else "NO",
                         _steps(c["fx_evicting_steps"]), " / ".join(_steps(s) for s in c["kv_compression_steps"]),
                         f"{c['argmax_agree']}/{args.steps}", f"{f['seconds']:.0f} / {kv['seconds']:.0f}"])
            summary.append({"prompt_tokens": P, "budget": B, "interval": k, "steps": args.steps, "kvpress_press": press,
                            "prompt_sha1": hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:12],
                            "forced_tokens": f["tokens"], "held_fxbudget": f["held"], "held_kvpress": kv["held"],
                            **{x: c[x] for x in c if x != "checkpoints"},
                            "checkpoints": {str(i): v for i, v in ck.items()}, "load_end": os.getloadavg()})
            raw.append({"config": [P, B, k], "fxbudget": f, "kvpress": kv})
    lines = header_lines("fxbudget decode-time eviction at an interval vs kvpress DecodingPress: kept sets", info,
                         command, load_after=load_str())
    lines += [
        f"- Peer: kvpress {versions['kvpress']}, transformers {versions['transformers']}, torch {versions['torch']} "
        "(its own venv)" if versions else "- Peer: not run",
        "- Model: the embedded Qwen2.5-Coder-0.5B-Instruct, fp32, SDPA, CPU, 1 thread. Prompt: a chat message (a "
        "request to explain the start of docs/DESIGN.md), identical ids on both sides, in one call.",
        f"- Rule: fxbudget `knorm` (eager kernel) vs kvpress `KnormPress`; {args.steps} decode steps, fxbudget's "
        "greedy tokens forced on both sides. Budget / `target_size` B, interval / `compression_interval` k.", "",
        "## Kept sets after the last step, per layer and KV head", "",
        "Overlap: |kept by fxbudget & kept by kvpress| / max(sizes) over layers x KV heads, after step N; `worst "
        "checkpoint mean`: the lowest mean over the checkpoints (after every evicting step and after step N). `held "
        "sequence same`: the entries layer 0 holds after the prompt and after every step are equal on both sides. "
        "`evicting steps`: fxbudget's evicting decode calls; `kvpress compressions`: the steps at which each layer's "
        "DecodingPress compressed (one list when every layer agrees). `kvpress argmax`: steps where kvpress's own "
        "greedy choice equals the forced token (0: the prompt's compression). Seconds: each side's prompt + N "
        "steps, the drivers' own bookkeeping included (kvpress's kept-set tracking runs at every checkpoint): not a "
        "timing result.", ""]
    lines += md_table(["P", "B", "k", "N", "kvpress press", "mean overlap (goal >= 0.99)", "min", "heads identical",
                       "worst checkpoint mean", "held sequence same", "fxbudget evicting steps",
                       "kvpress compressions", "kvpress argmax", "seconds fxbudget / kvpress"], rows)
    lines += analysis_link("vs_kvpress_decoding")
    write_md(args.out, lines)
    Path(args.summary_json).write_text(json.dumps({"command": command, "date": info["date"], "rows": summary}) + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
