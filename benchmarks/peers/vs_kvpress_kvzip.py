"""fxbudget `kvzip` vs kvpress `KVzipPress` on the embedded model: the replay's scores, as kept sets per layer and head.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peers/vs_kvpress_kvzip.py [--context 1024 --budget 256]

Two stacks, two venvs (as `vs_kvpress.py`): this driver (project venv) builds passkey prompts with
`fxbudget.harness.tasks` and runs fxbudget's side itself; kvpress 0.5.5 runs in a subprocess of the peer venv
(`--peer-python`, default `/work/venvs/rules-kvpress/bin/python`) on the same context ids.

kvpress: `with KVzipPress(compression_ratio=1 - (B + 0.5) / L)(model): model.model(context)`; the press replays the
context on exit and `compress_post` allocates the pruning over all layers and heads (its default `layerwise=False`).
fxbudget keeps `B` per layer and KV head (the budget contract), so the press's `compress_post` is wrapped and its
`score_val` (every context token's max attention over the replay, per layer and KV head) recorded; the kvpress kept
set compared is that score's top `B` per layer and KV head, the first `n_sink` positions first. fxbudget:
`kvzip_protocol.compress` then `cache.positions(layer)`. Overlap per (layer, KV head) = |A & B| / B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEER_PYTHON = "/work/venvs/rules-kvpress/bin/python"


def _worker_kvpress(job: dict) -> dict:
    import torch
    from importlib.metadata import version

    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    out = []
    for ctx_ids in job["contexts"]:
        L, B = len(ctx_ids), job["budget"]
        press = kvpress.KVzipPress(compression_ratio=1 - (B + 0.5) / L)
        seen = {}
        orig = press.compress_post

        def compress_post(m, _orig=orig, _press=press, _seen=seen):
            _seen["score"] = _press.score_val.clone()  # [layers, 1, kv_heads, L], before the sinks are raised
            return _orig(m)

        press.compress_post = compress_post
        with torch.no_grad(), press(model):
            model.model(input_ids=torch.tensor([ctx_ids]), past_key_values=DynamicCache())
        score = seen["score"][:, 0].double()
        score[..., :press.n_sink] = float("inf")
        kept = [[sorted(torch.topk(row, B).indices.tolist()) for row in layer] for layer in score]
        out.append({"kept": kept, "prefix_length": None})
    return {"results": out, "versions": {"kvpress": version("kvpress"), "torch": torch.__version__}}


def _fxbudget(contexts: list, budget: int) -> tuple[list, dict]:
    import torch
    import transformers

    import fxbudget
    from fxbudget.harness.kvzip_protocol import compress, replay_ids, template_parts
    from fxbudget.models import load_default

    torch.set_num_threads(1)
    model, tok = load_default(progress=False)
    from fxbudget import rules

    prefix = template_parts(tok)[0]  # the header kvpress derives from the tokenizer too
    model = fxbudget.compile(model, rule=rules.get("kvzip", prefix_length=prefix), budget=budget, backend=None)
    out = []
    for ctx_ids in contexts:
        ctx = torch.tensor([ctx_ids])
        done = compress(model, ctx, replay_ids(tok, ctx, prefix_length=prefix))
        kept = [[sorted(p for p in row if p >= 0) for row in done.cache.positions(i)[0].tolist()]
                for i in range(len(done.cache.layers))]
        out.append({"kept": kept, "replay_tokens": done.replay_tokens, "prefill_s": done.prefill_s,
                    "replay_s": done.replay_s, "prefix_length": prefix})
    return out, {"transformers": transformers.__version__, "torch": torch.__version__}


def _explain(contexts: list, budget: int, n_sink: int = 4) -> dict:
    """Where the kept sets differ: the unmodified model (eager attention, fp32) on context + replay, each context
    token's max attention over the replay's queries and the group, top `budget` per layer and KV head (header
    scored 0, sinks first) from (a) each query's own softmax, fxbudget's score, and (b) that softmax renormalized
    over the sinks, the context after the header and the replay, as kvpress's `_compute_cross_attention`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fxbudget.harness.kvzip_protocol import replay_ids, template_parts
    from fxbudget.models import default_cache_dir

    tok = AutoTokenizer.from_pretrained(default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(default_cache_dir(), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    kv = model.config.num_key_value_heads
    prefix = template_parts(tok)[0]
    out = []
    for ctx_ids in contexts:
        ctx = torch.tensor([ctx_ids])
        L = ctx.shape[1]
        kept = {"own softmax": [], "renormalized": []}

        def hook(mod, args, kwargs, output):
            rows = output[1][0][:, L:]  # [heads, replay, tokens]
            for name in kept:
                x = rows
                if name == "renormalized":
                    seen = torch.ones(rows.shape[-1], dtype=torch.bool)
                    seen[min(n_sink, prefix):prefix] = False
                    x = rows * seen / (rows * seen).sum(-1, keepdim=True)
                score = x[..., :L].reshape(kv, -1, L).amax(1).double()
                score[:, :prefix] = 0.0
                score[:, :n_sink] = float("inf")
                kept[name].append([sorted(torch.topk(r, budget).indices.tolist()) for r in score])
            return (output[0], None)  # the weights are not kept: one layer's at a time

        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
        with torch.no_grad():
            model.model(input_ids=torch.cat([ctx, replay_ids(tok, ctx, prefix_length=prefix)], 1),
                        output_attentions=True)
        for h in hooks:
            h.remove()
        out.append(kept)
    return out


def _overlaps(a: list, b: list, budget: int) -> list[float]:
    return [len(set(ha) & set(hb)) / budget for la, lb in zip(a, b) for ha, hb in zip(la, lb)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=1024, help="context tokens (passkey haystack)")
    p.add_argument("--budget", type=int, default=256, help="KV entries per layer and KV head")
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--peer-python", default=PEER_PYTHON)
    p.add_argument("--explain", action="store_true", help="also the unmodified model's top-B, own and renormalized "
                   "softmax, against both stacks (eager attention: memory O(context^2) per layer)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_kvpress_kvzip.md"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        Path(args.result).write_text(json.dumps(_worker_kvpress(json.loads(Path(args.job).read_text()))))
        return 0

    from transformers import AutoTokenizer

    from fxbudget.harness.tasks import chat_ids, make_samples
    from fxbudget.models import default_cache_dir, load_default

    model_dir = default_cache_dir()
    if not (model_dir / "config.json").is_file():
        load_default(progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    contexts = [chat_ids(tok, s)[0][0].tolist() for s in make_samples("passkey", tok, args.context, args.prompts)]
    with tempfile.TemporaryDirectory(prefix="vs_kvpress_kvzip_") as d:
        jp, rp = Path(d) / "job.json", Path(d) / "result.json"
        jp.write_text(json.dumps({"model_dir": str(model_dir), "contexts": contexts, "budget": args.budget}))
        env = {**os.environ, "PYTHONPATH": ""}
        proc = subprocess.run([args.peer_python, __file__, "--worker", "kvpress", "--job", str(jp), "--result",
                               str(rp)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"kvpress worker failed (rc {proc.returncode})")
        peer = json.loads(rp.read_text())
    ours, versions = _fxbudget(contexts, args.budget)
    lines = ["# fxbudget `kvzip` vs kvpress `KVzipPress`: kept sets per layer and KV head",
             "", "Generated by `benchmarks/peers/vs_kvpress_kvzip.py` "
             f"`--context {args.context} --budget {args.budget} --prompts {args.prompts}"
             f"{' --explain' if args.explain else ''}` (embedded model, "
             f"fp32, CPU; kvpress {peer['versions']['kvpress']}, torch {peer['versions']['torch']}; fxbudget side "
             f"transformers {versions['transformers']}, torch {versions['torch']}). kvpress's set: the top B of its "
             "`score_val` per layer and KV head (sinks first); fxbudget's: the cache after `kvzip_protocol.compress`.",
             "", "| prompt | context tokens | replay tokens | header tokens | mean overlap | worst head | "
             "heads identical |", "|---|---|---|---|---|---|---|"]
    for i, (a, b, ctx) in enumerate(zip(peer["results"], ours, contexts)):
        ov = _overlaps(a["kept"], b["kept"], args.budget)
        lines.append(f"| {i} | {len(ctx)} | {b['replay_tokens']} | {b['prefix_length']} | "
                     f"{statistics.mean(ov):.4f} | {min(ov):.4f} | {sum(o == 1 for o in ov)}/{len(ov)} |")
    if args.explain:
        lines += ["", "The unmodified model's top B (`--explain`, eager attention), mean overlap [worst head] with "
                  "each stack:", "", "| prompt | score | vs kvpress | vs fxbudget |", "|---|---|---|---|"]
        for i, kept in enumerate(_explain(contexts, args.budget)):
            for name, sets in kept.items():
                pairs = (_overlaps(sets, peer["results"][i]["kept"], args.budget),
                         _overlaps(sets, ours[i]["kept"], args.budget))
                cells = [(statistics.mean(o), min(o)) for o in pairs]
                lines.append(f"| {i} | {name} | " + " | ".join(f"{m:.4f} [{w:.4f}]" for m, w in cells) + " |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
