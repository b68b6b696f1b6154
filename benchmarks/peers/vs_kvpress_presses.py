"""Kept-set parity of issue 43's rules with kvpress's own presses, on the embedded model (no timing, no accuracy).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peers/vs_kvpress_presses.py      # ~1K-token passkey prompt, B 256

Same setup as `vs_kvpress.py` (whose worker helpers this module shares): two venvs, the same token ids handed to both
sides as JSON, one fresh subprocess per (side, row). Each row compresses once, in one prefill call, down to B entries
per layer and KV head (kvpress: ratio `1 - (B + 0.5) / L`, `L` the prefill's length), and reads the kept positions
per layer and KV head: kvpress's by matching each kept key row to the input row it was gathered from (exact equality,
`vs_kvpress_adakv._kvpress_kept`), fxbudget's from `cache.positions(layer)`.

Rows (fxbudget rule / kvpress press):
- `snapkv` (control): snapkv window 64, avg pool 5 / `SnapKVPress(window_size=64, kernel_size=5)`;
- `criticalkv`: defaults / `CriticalKVPress(SnapKVPress())` (epsilon 1e-4, first_stage_ratio 0.5);
- `simlayerkv`: `lazy_threshold=T` (`--lazy-threshold`, default 0.85: kvpress's recommendation for Qwen) /
  `SimLayerKVPress(lazy_threshold=T, n_initial=4, n_recent=B - 3)`: a lazy layer keeps B on both sides; a layer that
  is not lazy keeps the whole context in kvpress and B (snapkv's choice) in fxbudget, so the report gives the lazy
  decisions per layer and the overlap on the layers both call lazy (`--rows simlayerkv@0.6`: threshold 0.6);
- `finch`: query-aware, the prefill is context + question, `window` = the question's length /
  `FinchPress(rerotate_keys=False)` with its delimiter between context and question (re-rotation moves keys, not
  the kept set: off, so kept keys match input rows);
- `chunk(snapkv)`: `Chunk(snapkv(64, 5, avg), chunk_length=C)` / `ChunkPress(SnapKVPress(), chunk_length=C)`
  (`--chunk-length`, default 300: no chunk shorter than SnapKV's 64-token window on a ~1K prompt). kvpress scores
  each chunk by SnapKV run on that chunk alone (its last 64 tokens as the window); fxbudget's wrapped rule scores
  the whole call once: a departure the overlap measures; `chunk(knorm)`: `Chunk(knorm)` / `ChunkPress(KnormPress())`,
  a per-token score, the same whether a chunk is scored alone or not: the chunk quotas alone;
- `non_causal_attention`: defaults / `NonCausalAttnPress()` (chunk_size 256);
- `capkv`: defaults / `CapPress()` (tau 5, n_future_positions 512, n_sink 4).
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
from vs_kvpress import PEER_PYTHON, ROOT, add_worker_args, kvpress_ratio, _overlap, _run_worker, serve_worker  # noqa: E402
from vs_kvpress_adakv import record_kept  # noqa: E402

ROWS = ("snapkv", "criticalkv", "simlayerkv", "finch", "chunk(snapkv)", "chunk(knorm)", "non_causal_attention", "capkv")
QUERY_AWARE = {"finch"}


def _threshold(row: str, job: dict) -> float:
    """SimLayerKV's lazy_threshold of a row: `simlayerkv@T` -> T, plain `simlayerkv` -> `--lazy-threshold`."""
    return float(row.split("@")[1]) if "@" in row else job["lazy_threshold"]


def _worker_kvpress(job: dict) -> dict:
    import torch
    import transformers
    from importlib.metadata import version

    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    row, B = job["rule"], job["budget"]
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    if getattr(model.config, "head_dim", None) is None:  # CriticalKVPress reads config.head_dim; Qwen2's has none
        model.config.head_dim = model.config.hidden_size // model.config.num_attention_heads
    recorded: dict[int, list] = {}
    delim = None
    if row == "finch":
        finch = kvpress.FinchPress(rerotate_keys=False)
        tok = finch.update_model_and_tokenizer(model, tok)
        delim = finch.delimiter_token_id

    def make_press(L: int):
        ratio = kvpress_ratio(B, L)
        snap = dict(window_size=64, kernel_size=5)
        if row == "snapkv":
            press = kvpress.SnapKVPress(compression_ratio=ratio, **snap)
        elif row == "criticalkv":
            press = kvpress.CriticalKVPress(press=kvpress.SnapKVPress(compression_ratio=ratio, **snap))
        elif row.startswith("simlayerkv"):
            press = kvpress.SimLayerKVPress(lazy_threshold=_threshold(row, job), n_initial=4, n_recent=B - 3)
        elif row == "finch":
            press = finch
            press.compression_ratio = ratio
        elif row == "chunk(snapkv)":
            press = kvpress.ChunkPress(press=kvpress.SnapKVPress(compression_ratio=ratio, **snap),
                                       chunk_length=job["chunk_length"])
        elif row == "chunk(knorm)":
            press = kvpress.ChunkPress(press=kvpress.KnormPress(compression_ratio=ratio),
                                       chunk_length=job["chunk_length"])
        elif row == "non_causal_attention":
            press = kvpress.NonCausalAttnPress(compression_ratio=ratio)
        elif row == "capkv":
            press = kvpress.CapPress(compression_ratio=ratio)
        else:
            raise ValueError(row)
        return record_kept(press, recorded)

    results = []
    for p in job["prompts"]:
        ids = p["ctx"] + ([delim] + p["q"] if row == "finch" else [])
        L = len(ids) - (row == "finch")  # the delimiter is dropped from the embeddings
        press = make_press(L)
        recorded.clear()
        with torch.no_grad(), press(model):
            model.model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
        results.append({"kept": [recorded[i] for i in sorted(recorded)], "L": L})
    return {"results": results, "versions": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                                             "torch": torch.__version__}}


def _worker_fxbudget(job: dict) -> dict:
    import torch
    import transformers

    import fxbudget
    from fxbudget import rules
    from fxbudget.models import load_default

    torch.set_num_threads(1)
    model, _ = load_default(progress=False)
    row, B = job["rule"], job["budget"]
    (p,) = job["prompts"]  # one prompt: finch's window is its question's length, fixed when compiled
    snap = rules.get("snapkv", window=64, kernel=5, pooling="avg")
    if row.startswith("simlayerkv@"):
        row = "simlayerkv"
        job = {**job, "lazy_threshold": _threshold(job["rule"], job)}
    rule = {"snapkv": lambda: snap,
            "criticalkv": lambda: rules.get("criticalkv"),
            "simlayerkv": lambda: rules.get("simlayerkv", lazy_threshold=job["lazy_threshold"]),
            "finch": lambda: rules.get("finch", window=len(p["q"])),
            "chunk(snapkv)": lambda: rules.Chunk(snap, chunk_length=job["chunk_length"]),
            "chunk(knorm)": lambda: rules.Chunk(rules.get("knorm"), chunk_length=job["chunk_length"]),
            "non_causal_attention": lambda: rules.get("non_causal_attention"),
            "capkv": lambda: rules.get("capkv")}[row]()
    m = fxbudget.compile(model, rule=rule, budget=B, backend=None, headroom=8)
    ids = p["ctx"] + (p["q"] if row == "finch" else [])
    cache = m.forward.new_cache(1)
    with torch.no_grad():
        m(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
    kept = [[sorted(int(x) for x in r if x >= 0) for r in cache.positions(i)[0].tolist()]
            for i in range(len(cache.layers))]
    results = [{"kept": kept, "L": len(ids)}]
    return {"results": results, "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}


def _lazy(kept: list[list[int]], L: int, B: int) -> bool:
    """A layer kept as a lazy SimLayerKV layer keeps, in every head, the first 4 positions and the newest B - 4."""
    want = list(range(4)) + list(range(L - (B - 4), L))
    return all(h == want for h in kept)


def report(args, runs: dict) -> list[str]:
    from benchlib.env import header_lines

    lines = header_lines("Kept-set parity of issue 43's rules with kvpress's presses (embedded model)")
    lines += ["",
              f"- Budget B = {args.budget} per layer and KV head; prompt: one passkey prompt of ~{args.context} tokens "
              "(`fxbudget.harness.tasks.passkey`, seed 0, depth 0.5), chat-formatted; one prefill call on each side.",
              f"- Versions: kvpress side {runs.get(('kvpress', 'snapkv'), {}).get('versions')}.", "",
              "| row | mean overlap (goal >= 0.99) | min | heads identical | heads | note |",
              "|---|---|---|---|---|---|"]
    extra = sorted({r for _, r in runs} - set(ROWS))  # variants run with --rows (simlayerkv@T)
    for row in [*ROWS, *extra]:
        k, f = runs.get(("kvpress", row)), runs.get(("fxbudget", row))
        if not (k and f):
            lines.append(f"| {row} | not run | | | | |")
            continue
        ov, note = [], ""
        for xk, xf in zip(k["results"], f["results"]):
            if row.startswith("simlayerkv"):
                L = xk["L"]
                lazy_k = [all(len(h) < L for h in layer) for layer in xk["kept"]]
                lazy_f = [_lazy(layer, L, args.budget) for layer in xf["kept"]]
                both = [i for i, (a, b) in enumerate(zip(lazy_k, lazy_f)) if a and b]
                ov += _overlap([xf["kept"][i] for i in both], [xk["kept"][i] for i in both])
                note = (f"lazy layers: kvpress {sum(lazy_k)}/{len(lazy_k)}, fxbudget {sum(lazy_f)}/{len(lazy_f)}, "
                        f"same decision in {sum(a == b for a, b in zip(lazy_k, lazy_f))}; overlap over the layers "
                        "both call lazy")
            else:
                ov += _overlap(xf["kept"], xk["kept"])
                sizes = sorted({len(h) for la in xk["kept"] for h in la})
                note = f"kvpress kept {sizes[0]}" + (f"-{sizes[-1]}" if len(sizes) > 1 else "")
        if not ov:
            lines.append(f"| {row} | - | - | 0 | 0 | {note} |")
            continue
        lines.append(f"| {row} | {statistics.mean(ov):.4f} | {min(ov):.3f} | {sum(o == 1.0 for o in ov)} | "
                     f"{len(ov)} | {note} |")
    return lines + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--lazy-threshold", type=float, default=0.85)
    p.add_argument("--chunk-length", type=int, default=300)
    p.add_argument("--peer-python", default=str(PEER_PYTHON))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_kvpress_presses.md"))
    p.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "vs_kvpress_presses.json"))
    p.add_argument("--report-only", action="store_true", help="rewrite the report from --json-out")
    add_worker_args(p)
    args = p.parse_args()
    if serve_worker(args, _worker_kvpress, _worker_fxbudget):
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    from benchlib.output import write_md

    store = Path(args.json_out)
    runs = {tuple(k.split("|")): v for k, v in json.loads(store.read_text()).items()} if store.exists() else {}
    if not args.report_only:
        if not Path(args.peer_python).exists():
            sys.exit(f"peer venv missing ({args.peer_python}): run `bash benchmarks/peers/setup_kvpress.sh` first")
        from transformers import AutoTokenizer

        from fxbudget.harness.tasks import chat_ids, passkey
        from fxbudget.models import default_cache_dir

        model_dir = str(default_cache_dir())
        tok = AutoTokenizer.from_pretrained(model_dir)
        ctx, q = chat_ids(tok, passkey(tok, args.context, depth=0.5, seed=0))
        prompts = [{"ctx": ctx[0].tolist(), "q": q[0].tolist()}]
        env_k = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env_k.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        env_f = {**env_k, "PYTHONPATH": str(ROOT)}
        for row in [r for r in args.rows.split(",") if r]:
            for side in ("kvpress", "fxbudget"):
                print(f"[{time.strftime('%H:%M:%S')}] {side} {row}", flush=True)
                job = {"model_dir": model_dir, "budget": args.budget, "prompts": prompts, "rule": row,
                       "lazy_threshold": args.lazy_threshold, "chunk_length": args.chunk_length}
                runs[(side, row)] = _run_worker(args.peer_python if side == "kvpress" else sys.executable, side,
                                                job, env_k if side == "kvpress" else env_f, script=Path(__file__))
                store.write_text(json.dumps({"|".join(k): v for k, v in runs.items()}))
    write_md(args.out, report(args, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
