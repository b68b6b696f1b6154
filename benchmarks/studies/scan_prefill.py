"""Time a one-call prefill (the query-blocked scan) eagerly and under Inductor, and count the traced graph's nodes.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/studies/scan_prefill.py [--tokens 8192] [--backends eager,inductor]

A tiny-but-wide Llama (1 layer, hidden 256, 8 query heads, 2 KV heads, head dim 32): the attention dominates. Prints
one JSON line per backend: compile seconds (first call minus a warm call) and the best of `--repeat` warm calls.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fxbudget


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--backends", default="eager,inductor")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=256, intermediate_size=256, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=args.tokens + 16,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    for backend in args.backends.split(","):
        torch._dynamo.reset()
        m = fxbudget.compile(model, rule="snapkv", budget=512, backend=None if backend == "eager" else backend)
        times = []
        try:
            for n in [args.tokens] * (1 + args.repeat):
                ids = torch.randint(0, 128, (1, n))
                t0 = time.perf_counter()
                with torch.no_grad():
                    m(input_ids=ids, logits_to_keep=1)
                times.append(time.perf_counter() - t0)
        finally:
            model.forward.restore()
        warm = min(times[1:])
        print(json.dumps({"backend": backend, "tokens": args.tokens, "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "first_s": round(times[0], 2),
                          "compile_s": round(times[0] - warm, 2) if backend != "eager" else None,
                          "warm_s": round(warm, 3)}), flush=True)


if __name__ == "__main__":
    main()
