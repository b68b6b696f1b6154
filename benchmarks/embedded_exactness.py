"""How far a covering budget's logits are from a float64 model, against how far the unmodified model's are: an
accuracy study of the embedded models (no timing), issue 41's Gemma 3 table and its 2.4x.

For each prompt (random tokens, the passkey task's haystack, and a repetitive passkey prompt: the classic filler
sentences repeated, as Mohtashami & Jaggi's), the logits of the last `--keep` positions of one prefill:
  ref   the unmodified model in float64,
  plain the unmodified model in the dtype (SDPA, transformers' own path),
  fx    fxbudget's eager kernel (`backend=None`), rule snapkv at a covering budget (prompt + 16), same dtype,
  alt   (fp32 only) the unmodified model with transformers' "eager" attention (matmul + softmax, no SDPA): another
        valid fp32 order of the same sums, to show how much a reordering alone moves the error on this prompt.
Error = RMS over the kept logits of (x - ref) (the float64 logits' own RMS is given for scale); ratio =
error(x) / error(plain).

`--layers`: each layer's local error, every attention fed the float64 model's own input to that attention (cast to
the dtype), so a layer's error is its attention's alone, not what earlier layers passed on: RMS(out - out64) /
RMS(out64) per layer for plain, fx and alt, with the layer kind (sliding / full).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/embedded_exactness.py --model gemma3-270m --tokens 1476 --layers
"""

from __future__ import annotations

import argparse
import copy

import torch

import fxbudget
from fxbudget.models.embedded import EMBEDDED
from fxbudget.harness.tasks import chat_ids, passkey
from fxbudget.harness.tasks.prompt import bos_ids
from fxbudget.models import load_embedded

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz "
         "you about the important information there. ")


def repetitive_passkey(tok, n: int, key: int = 68391) -> torch.Tensor:
    """The classic passkey prompt (filler repeated, the key at 40%) of about `n` tokens, as a base model reads it."""
    per = len(tok(FILLER, add_special_tokens=False).input_ids)
    reps = max(2, (n - 60) // per)
    before = int(reps * 0.4)
    text = (INTRO + FILLER * before + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + FILLER * (reps - before) + "What is the pass key? The pass key is")
    return torch.tensor([bos_ids(tok) + tok(text, add_special_tokens=False).input_ids])


def prompts(tok, n: int, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(10, min(vocab, 150_000), (1, n), generator=gen)
    task = torch.cat(chat_ids(tok, passkey(tok, n, depth=0.4, seed=1)), dim=1)
    return {"random": rand, "passkey (haystack)": task, "passkey (repetitive)": repetitive_passkey(tok, n)}


def logits(model, ids, keep):
    with torch.no_grad():
        return model(input_ids=ids, logits_to_keep=keep).logits.double()


def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def attention_inputs(model, ids, keep: int = 1):
    """Each layer's attention input (`hidden_states`) and output in one run of `model`, and the logits of the last
    `keep` positions (float64)."""
    ins, outs, hooks = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        def pre(mod, args, kwargs, i=i):
            ins[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        def post(mod, args, kwargs, out, i=i):
            outs[i] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        hooks += [layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True),
                  layer.self_attn.register_forward_hook(post, with_kwargs=True)]
    try:
        out = logits(model, ids, keep)
    finally:
        for h in hooks:
            h.remove()
    return ins, outs, out


def local_errors(model, ids, ref_in, ref_out, dtype):
    """Per layer: RMS(attention output - the float64 one) / RMS(float64 one), the attention fed the float64 input."""
    outs, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        def pre(mod, args, kwargs, i=i):
            x = ref_in[i].to(dtype)
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        def post(mod, args, kwargs, out, i=i):
            outs[i] = (out[0] if isinstance(out, tuple) else out).detach().double()
        hooks += [layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True),
                  layer.self_attn.register_forward_hook(post, with_kwargs=True)]
    try:
        logits(model, ids, 1)
    finally:
        for h in hooks:
            h.remove()
    return [rms(outs[i] - ref_out[i]) / rms(ref_out[i]) for i in sorted(outs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m", choices=sorted(EMBEDDED))
    p.add_argument("--tokens", type=int, default=1476)
    p.add_argument("--keep", type=int, default=32, help="logits of the last KEEP positions")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", default="random,passkey (haystack),passkey (repetitive)")
    p.add_argument("--layers", action="store_true", help="per-layer local attention errors (fp32)")
    args = p.parse_args()
    base, tok = load_embedded(args.model, progress=False)
    f64 = copy.deepcopy(base).double()
    kinds = [t.split("_")[0] for t in getattr(base.config, "layer_types", None) or ["full"] * len(base.model.layers)]
    print(f"model {EMBEDDED[args.model].name}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"error = RMS of the last {args.keep} positions' logits minus the float64 model's")
    print("| prompt | tokens | logit RMS | dtype | error plain | error fx | ratio fx/plain | error alt | "
          "ratio alt/plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    chosen = args.prompts.split(",")
    for name, ids in prompts(tok, args.tokens, base.config.vocab_size).items():
        if name not in chosen:
            continue
        ref = logits(f64, ids, args.keep)
        for dt in args.dtypes.split(","):
            dtype = getattr(torch, dt)
            plain = copy.deepcopy(base).to(dtype)
            e_plain = rms(logits(plain, ids, args.keep) - ref)
            alt_cell = " | "
            if dtype == torch.float32:
                alt = copy.deepcopy(base)
                alt.config._attn_implementation = "eager"
                e_alt = rms(logits(alt, ids, args.keep) - ref)
                alt_cell = f"{e_alt:.3g} | {e_alt / e_plain:.2f}"
            fx = fxbudget.compile(copy.deepcopy(base).to(dtype), rule="snapkv", budget=ids.shape[1] + 16,
                                  backend=None)
            e_fx = rms(logits(fx, ids, args.keep) - ref)
            print(f"| {name} | {ids.shape[1]} | {rms(ref):.3g} | {dt} | {e_plain:.3g} | {e_fx:.3g} | "
                  f"{e_fx / e_plain:.2f} | {alt_cell} |", flush=True)
            if args.layers and dtype == torch.float32:
                ref_in, ref_out, _ = attention_inputs(f64, ids)
                lp = local_errors(plain, ids, ref_in, ref_out, dtype)
                lf = local_errors(fx, ids, ref_in, ref_out, dtype)
                la = local_errors(alt, ids, ref_in, ref_out, dtype)
                print(f"\n{name}, per layer (attention fed the float64 input; relative RMS error):\n")
                print("| layer | kind | plain | fx | alt | fx/plain |")
                print("|---|---|---|---|---|---|")
                for i, (a, b, c) in enumerate(zip(lp, lf, la)):
                    print(f"| {i} | {kinds[i]} | {a:.3g} | {b:.3g} | {c:.3g} | {b / a:.2f} |")
                print(flush=True)


if __name__ == "__main__":
    main()
