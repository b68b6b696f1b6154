"""Checks of kvpress 0.5.5 (transformers 5.2.0) on the text-only Gemma 3 270M (`Gemma3ForCausalLM`), run in the peer
venv on the prompts of a `vs_kvpress.py --model gemma3-270m --json-out FILE` run; they back
`benchmarks/results/vs_kvpress_gemma3-270m.analysis.md`.

    OMP_NUM_THREADS=1 benchmarks/peers/.venv-kvpress/bin/python benchmarks/peers/gemma_kvpress_check.py \\
        ~/.cache/fxbudget/gemma-3-270m benchmarks/results/vs_kvpress_gemma3-270m.json --reference knorm,streamingllm

kvpress's `BasePress.__call__` skips the sliding layers of `Gemma3ForConditionalGeneration` only: on
`Gemma3ForCausalLM` it hooks (and compresses) all 18 layers, and sets every layer's `self_attn.rotary_emb` to the
model's shared `Gemma3RotaryEmbedding` (one table per layer type: theta 1e6 for full attention, 1e4 for sliding).

1. RoPE of SnapKV's window queries on the full-attention layers (first prompt). SnapKVPress rotates them with
   `kwargs["position_embeddings"]`, the (cos, sin) the model hands that layer: printed, its largest difference from
   the full-attention table and from the sliding table; then what SnapKV would keep at B on each full layer if the
   window queries were rotated with the sliding table instead (overlap with what it keeps): the size of the error a
   wrong table would make. Also whether `module.rotary_emb` can be called the Llama way (no layer type).
2. The sliding layers, per prompt and rule (the driver's `RULES` rows): the greedy answer (kvpress's pipeline
   `generate_answer`, as the driver runs it) with no press, with the press as kvpress applies it (every layer), and
   with the press leaving the sliding layers uncompressed (its `compress` returns them unchanged: what kvpress does
   for `Gemma3ForConditionalGeneration`; then in the model's own hybrid cache, `DynamicCache(config)`, since in a
   plain one transformers sizes every layer's mask by layer 0's length and the question call fails); and how many
   cached entries of a sliding layer the question's sliding-window mask lets its first..last token see, and how
   many of the question's own columns the full-attention mask lets its first token see (causal: 1); the pipeline
   passes position ids but no cache positions, so the model counts them from the cache's (layer 0's) length.
3. The reference answer (`--reference` rules): the greedy answer of the model itself when the question and answer
   tokens see, on each full-attention layer, only the context positions kvpress kept there (the run's kept sets)
   and, on the sliding layers, their window; one uncached call per token with those masks (explicit 4D masks), set
   beside the answers the run recorded for fxbudget and kvpress.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_kvpress import kvpress_press  # noqa: E402  (stdlib only at import)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir", help="the converted Gemma 3 270M checkpoint (~/.cache/fxbudget/gemma-3-270m)")
    p.add_argument("run_json", help="a `vs_kvpress.py --model gemma3-270m --json-out` file: its prompts and budget")
    p.add_argument("--rules", default="snapkv,knorm,streamingllm")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--reference", default="knorm",
                   help="rules whose exact-mask reference answer is computed (check 3; slow: no cache)")
    args = p.parse_args()

    from importlib.metadata import version

    import transformers
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    run = json.loads(Path(args.run_json).read_text())
    B, prompts = run["args"]["budget"], run["prompts"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=AutoTokenizer.from_pretrained(args.model_dir),
                                         device="cpu")
    print(f"kvpress {version('kvpress')}, transformers {transformers.__version__}, torch {torch.__version__}; "
          f"{type(model).__name__}; B = {B}; prompts of {[len(p_['ctx']) for p_ in prompts]} tokens")
    kinds = model.config.layer_types
    full = [i for i, k in enumerate(kinds) if k == "full_attention"]
    rot = model.model.rotary_emb

    # ---- 1. RoPE
    ids = prompts[0]["ctx"]
    L = len(ids)
    pos = torch.arange(L)[None]
    dummy = torch.zeros(1, L, model.config.hidden_size)
    tables = {k: rot(dummy, pos, k) for k in ("full_attention", "sliding_attention")}
    press = kvpress_press("snapkv", B, L)
    seen: dict[int, dict] = {}

    def capture(module, _args, kwargs, _out):
        i = module.layer_idx
        seen[i] = {"rotary_emb": getattr(module, "rotary_emb", None), "pe": kwargs["position_embeddings"]}
        if i in full:  # before the press's hook (registered later) compresses this layer
            layer = kwargs["past_key_values"].layers[i]
            hs, keys, values = kwargs["hidden_states"], layer.keys, layer.values
            own = press.score(module, hs, keys, values, None, kwargs)
            swapped = press.score(module, hs, keys, values, None,
                                  {**kwargs, "position_embeddings": tables["sliding_attention"]})
            seen[i]["kept"] = [set(s[0, 0].topk(B).indices.tolist()) for s in (own, swapped)]

    hooks = [layer.self_attn.register_forward_hook(capture, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad(), press(model):
            model.model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    finally:
        for h in hooks:
            h.remove()
    print(f"\n1. RoPE on the full-attention layers {full} ({L}-token prompt, SnapKV window 64, B = {B})")
    for i in full:
        cos = seen[i]["pe"][0]
        d_full = (cos - tables["full_attention"][0]).abs().max().item()
        d_slide = (cos - tables["sliding_attention"][0]).abs().max().item()
        own, swapped = seen[i]["kept"]
        print(f"   layer {i}: max|cos - full table| = {d_full:.1e}, max|cos - sliding table| = {d_slide:.2f}; "
              f"SnapKV kept set with the sliding table instead: overlap {len(own & swapped) / B:.4f}")
    r = seen[full[0]]["rotary_emb"]
    print(f"   self_attn.rotary_emb set by BasePress: {type(r).__name__}, the model's shared one: {r is rot}")
    try:
        r(dummy[:, :4], pos[:, :4])
        print("   rotary_emb(x, position_ids) without a layer type: returned")
    except Exception as e:  # noqa: BLE001 - the error is what is reported
        print(f"   rotary_emb(x, position_ids) without a layer type: {type(e).__name__}: {e}")

    # ---- 2. sliding layers: answers, and the question's sliding mask
    logging.getLogger("kvpress.presses.base_press").setLevel(logging.ERROR)  # its "not tested" warning: printed once
    print("\n2. Answers (greedy, <= {} tokens) and the question's sliding mask".format(args.new_tokens))

    def answer(ctx, q, press, skip_sliding: bool):
        # Sliding layers left whole need the model's own hybrid cache (sliding cache layers): in a plain
        # DynamicCache transformers sizes every layer's mask by layer 0 (L + question) while a full layer holds B.
        cache = DynamicCache(config=model.config) if skip_sliding else DynamicCache()
        if press is not None and skip_sliding:
            orig = press.compress

            def compress(module, hidden_states, keys, values, *a, **k):
                return (keys, values) if module.is_sliding else orig(module, hidden_states, keys, values, *a, **k)

            press.compress = compress
        with torch.no_grad():
            if press is None:
                model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
            else:
                with press(model):
                    model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
            held = [int(layer.keys.shape[2]) for layer in cache.layers]
            # the question's masks as generate_answer's call builds them: cache positions from the cache's length
            n = cache.get_seq_length()
            cpos = torch.arange(n, n + len(q))
            mk = dict(config=model.config, inputs_embeds=torch.zeros(1, len(q), model.config.hidden_size),
                      attention_mask=None, cache_position=cpos, past_key_values=cache,
                      position_ids=torch.arange(len(ctx), len(ctx) + len(q))[None])
            mask, fmask = create_sliding_window_causal_mask(**mk), create_causal_mask(**mk)
            sl = [i for i, k in enumerate(kinds) if k == "sliding_attention"][0]
            vis = (f"{int(mask[0, 0, 0, :held[sl]].sum())}..{int(mask[0, 0, -1, :held[sl]].sum())}"
                   if mask is not None else "all (no mask)")
            # the question block of a full layer: how many question columns its first token sees (causal: 1)
            fq = int(fmask[0, 0, 0, -len(q):].sum()) if fmask is not None else "all (no mask)"
            vis += f"; question columns visible to the first question token on a full layer: {fq} of {len(q)}"
            text = pipe.generate_answer(question_ids=torch.tensor([q]), cache=cache, context_length=len(ctx),
                                        max_new_tokens=args.new_tokens)
        return text, held, vis

    for pr in prompts:
        ctx, q = pr["ctx"], pr["q"]
        print(f"   prompt of {len(ctx)} tokens (key {pr['answer']}):")
        text, held, vis = answer(ctx, q, None, False)
        print(f"      no press: {text!r}; held {sorted(set(held))}; cached entries of a sliding layer visible to "
              f"the question tokens: {vis}")
        for rule in [r for r in args.rules.split(",") if r]:
            for skip in (False, True):
                text, held, vis = answer(ctx, q, kvpress_press(rule, B, len(ctx)), skip)
                how = "sliding layers left whole" if skip else "every layer compressed (kvpress)"
                print(f"      {rule}, {how}: {text!r} ({'finds' if pr['answer'] in text else 'misses'} the key); "
                      f"held per layer {held[:6]}...; cached entries of a sliding layer visible to the question "
                      f"tokens: {vis}")

    # ---- 3. exact-mask reference
    rules = [r for r in args.reference.split(",") if r]
    if rules:
        print(f"\n3. Reference answers (the model with exact masks: full layers see the kept set, sliding layers "
              f"their window of {model.config.sliding_window})")
    W = model.config.sliding_window
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    for rule in rules:
        rows = {r["side"]: r for r in run["runs"] if r["rule"] == rule and not r.get("timing")}
        for pi, pr in enumerate(prompts):
            ctx, ids, L = pr["ctx"], pr["ctx"] + pr["q"], len(pr["ctx"])
            kept = rows["kvpress"]["results"][pi]["kept"]
            out, top = [], None
            for _ in range(args.new_tokens):
                T = len(ids)
                i, j = torch.arange(T)[:, None], torch.arange(T)[None]
                causal = j <= i
                masks = {}
                for li in full:
                    see = torch.zeros(T, dtype=torch.bool)
                    see[sorted(set(kept[li][0]))] = True
                    see[L:] = True
                    m = causal.clone()
                    m[L:] &= see[None]
                    masks[li] = torch.where(m, 0.0, float("-inf"))[None, None]
                sliding = torch.where(causal & (j > i - W), 0.0, float("-inf"))[None, None]

                def pre(module, a, kw):
                    return a, ({**kw, "attention_mask": masks[module.layer_idx]} if module.layer_idx in masks else kw)

                hooks = [layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True)
                         for layer in model.model.layers]
                try:
                    with torch.no_grad():
                        logits = model(input_ids=torch.tensor([ids]), use_cache=False,
                                       attention_mask={"full_attention": masks[full[0]],
                                                       "sliding_attention": sliding}).logits[0, -1]
                finally:
                    for h in hooks:
                        h.remove()
                if top is None:
                    v, x = logits.topk(2)
                    top = [(pipe.tokenizer.decode([int(t)]), round(float(s_), 3)) for s_, t in zip(v, x)]
                out.append(int(logits.argmax()))
                ids = ids + out[-1:]
                if out[-1] in eos:
                    break
            text = pipe.tokenizer.decode(out, skip_special_tokens=True)
            print(f"   {rule}, prompt of {L} tokens: reference {text!r} (first token's top 2: {top}); run's "
                  f"fxbudget {rows['fxbudget']['results'][pi]['answer']!r}, kvpress "
                  f"{rows['kvpress']['results'][pi]['answer']!r}")


if __name__ == "__main__":
    main()
