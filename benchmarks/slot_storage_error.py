"""Quantized slots against float64 (issue 58, item 3): what each slot storage costs in accuracy of the model itself.

    OMP_NUM_THREADS=2 python benchmarks/slot_storage_error.py [--length 1024] [--steps 16]

On the embedded Qwen2.5-Coder-0.5B-Instruct and a passkey prompt of `--length` tokens (the quick start's task), at a
budget covering the prompt and the decode (nothing is evicted: only the storage differs), for each slot storage
(`fxbudget.kernel.slot_storage`) and model dtype (float32, bfloat16): one prefill and `--steps` greedy decode steps
fed the float64 model's own tokens (teacher-forced, so every storage sees the same sequence), on fxbudget's eager
kernel. Against the unmodified model in float64:
- the keys and values the cache holds after the prefill: worst relative error per entry and head (|x - stored| /
  absmax over the head's numbers), over every layer;
- the decode steps' logits: worst absolute error (beside the logits' own spread);
- greedy agreement: the decode steps whose argmax equals float64's.
Writes benchmarks/results/slot_storage_error.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import env_info, header_lines, load_str  # noqa: E402
from benchlib.output import md_table  # noqa: E402

OUT = HERE / "results" / "slot_storage_error.md"


def _prompt(tok, length: int):
    import torch

    from fxbudget.harness.tasks import make_samples
    from fxbudget.harness.tasks.prompt import chat_ids

    ctx, question = chat_ids(tok, make_samples("passkey", tok, length, 1, seed=0)[0])
    return torch.cat([ctx, question], dim=1)


def _reference(model, ids, steps: int):
    """float64 unmodified: the prefill's cache (keys, values per layer), the greedy tokens and their logits."""
    import torch

    from fxbudget.cache.keyword import output_cache

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache = output_cache(out)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        tokens, logits = [], []
        last = out.logits[:, -1]
        for _ in range(steps):
            tok = last.argmax(-1, keepdim=True)
            tokens.append(tok)
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            last = out.logits[:, -1]
            logits.append(last)
    return kv, tokens, torch.cat(logits)


def _run(model, ids, tokens, budget: int, storage: str):
    """fxbudget at a covering budget: the stored keys/values after the prefill, then the teacher-forced logits."""
    import torch

    import fxbudget
    from fxbudget.kernel.slot_storage import decode

    m = fxbudget.compile(model, rule="snapkv", budget=budget, backend=None, slot_dtype=storage, progress=False)
    try:
        cache = m.forward.new_cache(1)
        with torch.no_grad():
            m(input_ids=ids, cache=cache)
            n = ids.shape[1]
            kv = []
            for layer in cache.layers:  # slots hold entries in no order: gather them by position
                order = layer.pos.argsort(dim=-1)[..., -n:].unsqueeze(-1)
                kv.append(tuple(decode(t, d, torch.float64).gather(2, order.expand(-1, -1, -1, d))
                                for t, d in ((layer.keys, layer.head_dim), (layer.values, layer.v_head_dim))))
            logits = torch.cat([m(input_ids=tok, cache=cache).logits[:, -1] for tok in tokens])
    finally:
        m.forward.restore()
    return kv, logits


def _kv_error(kv, ref) -> float:
    worst = 0.0
    for (k, v), (rk, rv) in zip(kv, ref):
        for x, r in ((k, rk), (v, rv)):
            x = x.double()
            worst = max(worst, float(((x - r).abs().amax(-1) / r.abs().amax(-1).clamp(min=1e-30)).max()))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    import torch

    from fxbudget.checks import SLOT_DTYPES
    from fxbudget.models import load_model

    t0 = time.time()
    info = env_info()
    model, tok, _ = load_model(None, progress=False, dtype="float32")
    model.to(torch.float64).eval()
    ids = _prompt(tok, args.length)
    ref_kv, tokens, ref_logits = _reference(model, ids, args.steps)
    budget = ids.shape[1] + args.steps + 8
    rows = []
    spread = float(ref_logits.std(dim=-1).mean())  # the logits' own scale: what an error is read against
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        for storage in SLOT_DTYPES:
            kv, logits = _run(model, ids.clone(), tokens, budget, storage)
            err = float((logits.double() - ref_logits).abs().max())
            agree = int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
            rows.append([str(dtype).removeprefix("torch."), storage, f"{_kv_error(kv, ref_kv):.2e}", f"{err:.3f}",
                         f"{agree}/{args.steps}"])
            print(rows[-1], flush=True)
        model.to(torch.float64)
    lines = header_lines("Quantized slots against float64", info,
                         command=f"OMP_NUM_THREADS={info['omp_num_threads']} python benchmarks/slot_storage_error.py "
                                 f"--length {args.length} --steps {args.steps}")
    lines += [f"The embedded Qwen2.5-Coder-0.5B-Instruct, a passkey prompt of {ids.shape[1]} tokens, budget "
              f"{budget} (covering: nothing evicted, only the storage differs), snapkv on the eager kernel, "
              f"{args.steps} decode steps fed the float64 model's greedy tokens. Errors against the unmodified model "
              "in float64; `K/V rel. error`: worst over every layer, entry and head of |x - stored| / absmax of the "
              "head's numbers after the prefill; `logit error`: worst absolute error of the decode steps' logits (their "
              f"standard deviation over the vocabulary is {spread:.2f} on average); `argmax`: decode steps whose "
              f"greedy token is float64's. In bfloat16 the K/V column measures the model's own bf16 arithmetic as "
              "much as the storage (its `model` row). The scale is per entry and head over all d numbers: a key's outlier "
              "channels, where it has them, set the step of the others (KIVI quantizes keys per channel). "
              f"{time.time() - t0:.0f} s; load at the end {load_str()}.", ""]
    lines += md_table(["model dtype", "slots", "K/V rel. error", "logit error", "argmax"], rows)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
