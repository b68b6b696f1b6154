"""The architecture matrix: every causal LM of the installed transformers, a tiny random model of each, and whether a
covering budget reproduces it exactly or fxbudget refuses it by name.

`tests/test_architectures.py` runs it; `python tests/architecture_matrix.py --write docs/architectures.md` writes the
supported/refused table from the same code (run it under each tested transformers).
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass, field

import torch

PROMPT, STEPS, COVERING = 37, 20, 64  # the prompt spans several windows; the budget covers prompt + steps
WINDOW = 8  # every sliding window of the matrix: shorter than the prompt
TOL = 1e-4
MAX_PARAMS = 6_000_000

# Tiny sizes shared by every architecture; a config takes those it has (many keep their own names for them:
# attribute_map translates e.g. GPT-2's n_embd).
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=0, tie_word_embeddings=False, rotary_dim=8,
            # mixture-of-experts knobs, under each family's name
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=0, moe_topk=2,
            # decoders of encoder-decoder and BERT-like families
            is_decoder=True, ffn_dim=96, decoder_ffn_dim=96, encoder_ffn_dim=96, d_model=64,
            decoder_layers=2, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4)


# The architectures issue 20 names, and what each comes to (transformers 5.23 and 5.24). Together they span every
# window kind (model-wide, per layer type, Qwen2's use_sliding_window) and rotary kind (default, partial,
# interleaved), so they also run under aot_eager in the test; `--compiled all` runs every one.
NAMED = {
    "llama": "supported", "mistral": "supported", "mixtral": "supported", "qwen2": "supported",
    "qwen2_moe": "supported", "qwen3": "supported", "qwen3_moe": "supported", "phi3": "supported",
    "gemma": "supported", "gemma2": "refused", "gemma3_text": "supported", "cohere2": "supported",
    "granite": "supported", "olmo2": "supported", "stablelm": "supported", "glm": "supported",
    "starcoder2": "supported", "smollm3": "supported", "gpt_neox": "supported",
}


def backends_for(model_type: str, compiled: str = "named") -> tuple:
    """Eager for every architecture; aot_eager too for the named ones (`compiled="named"`) or all (`"all"`)."""
    return (None, "aot_eager") if compiled == "all" or model_type in NAMED else (None,)


def causal_lm_types() -> dict[str, str]:
    """model_type -> causal-LM class name, from transformers' auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_class(name: str):
    import transformers

    return getattr(transformers, name)


def tiny_config(model_type: str):
    """A tiny config of `model_type`: TINY where the config has the attribute, windows of WINDOW tokens, and
    layers alternating sliding / full where the family has both kinds."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    text = base.get_text_config(decoder=True)
    names = set(vars(text)) | set(getattr(type(text), "__dataclass_fields__", {})) | set(text.attribute_map)
    kw = {k: v for k, v in TINY.items() if k in names}
    if "sliding_window" in names:
        kw["sliding_window"] = WINDOW
    if "use_sliding_window" in names:  # Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE: switch the windows on
        kw["use_sliding_window"] = True
        if "max_window_layers" in names:
            kw["max_window_layers"] = 1 if model_type != "qwen2_moe" else 2
    types = getattr(text, "layer_types", None)
    if "use_sliding_window" in kw:
        pass  # the config derives layer_types from use_sliding_window / max_window_layers
    elif types and set(types) == {"full_attention", "sliding_attention"}:
        kw["layer_types"] = ["sliding_attention", "full_attention"]
    elif types and set(types) <= {"full_attention", "sliding_attention"}:
        kw["layer_types"] = [types[0]] * 2
    elif types:
        kw["layer_types"] = list(types[:2]) if len(types) >= 2 else list(types) * 2
    if text is base:
        return type(base)(**kw)
    return type(text)(**kw)  # a composite model: its text model is what a causal LM runs


@dataclass
class Result:
    model_type: str
    cls: str
    status: str  # "supported", "refused", "not built", "failed"
    detail: str = ""
    windows: str = ""
    rotary: str = ""
    diffs: dict = field(default_factory=dict)  # backend -> max |logit difference|
    rope_check: str = ""  # "the model's", "unknown" or what is wrong with the RoPE frequencies rules get
    seconds: float = 0.0


def rope_check(model) -> str:
    """Whether the RoPE frequencies fxbudget gives rules (`BudgetLayer.inv_freq` of a cache built for the model, as
    `model_cache` builds it) are the model's own (those of a rotary-embedding buffer of the same length, partial
    rotary included), or unknown (NaN): never different."""
    import fxbudget
    from fxbudget.cache.rope import model_rope

    theirs = [b for n, b in model.named_buffers() if n.endswith("inv_freq") and "original" not in n]
    known = False
    cache = fxbudget.BudgetCache(model.config, 8)
    cache.set_rope(model_rope(model))
    for layer in cache.layers:
        if torch.isnan(layer.inv_freq).any():
            continue
        known = True
        if not any(t.shape == layer.inv_freq.shape and torch.allclose(t.float(), layer.inv_freq, rtol=1e-6)
                   for t in theirs):
            return f"wrong: layer {layer.layer}'s {layer.inv_freq.tolist()} is none of the model's {len(theirs)}"
    return "the model's" if known else "unknown"


def _greedy(model, ids, steps):
    from conftest import greedy

    return greedy(model, ids, steps)[0]


def build(model_type: str, cls_name: str):
    """The tiny random model of a causal-LM type, with SDPA attention where the class supports it (else its default,
    which fxbudget must refuse). Raises whatever building raises."""
    cls = model_class(cls_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        cfg = tiny_config(model_type)
        if getattr(cls, "_supports_sdpa", False):
            cfg._attn_implementation = "sdpa"
        with torch.device("meta"):  # count first: a config whose sub-models keep their full sizes is not tiny
            size = sum(p.numel() for p in cls(cfg).parameters())
        if size > MAX_PARAMS:
            raise ValueError(f"the tiny config still has {size / 1e6:.0f}M parameters (sizes TINY does not set)")
        return cls(cfg).eval()


REFUSALS = ("fxbudget cannot reproduce", "fxbudget supports full and sliding attention layers", "fxbudget needs SDPA")


def run_one(model_type: str, cls_name: str, backends=(None, "aot_eager")) -> Result:
    """Build the tiny model, and either record fxbudget's refusal or run a covering budget under each backend
    against the unmodified model. Raises nothing: the outcome is in the Result."""
    import copy

    import fxbudget
    from fxbudget.models.architectures import describe

    t0 = time.perf_counter()
    res = Result(model_type, cls_name, "")
    try:
        model = build(model_type, cls_name)
    except Exception as e:  # noqa: BLE001 - listed, not dropped
        res.status, res.detail = "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return res
    try:
        compiled = {b: fxbudget.compile(copy.deepcopy(model), rule="snapkv", budget=COVERING, backend=b)
                    for b in backends}
    except Exception as e:  # noqa: BLE001
        refused = isinstance(e, (NotImplementedError, ValueError)) and str(e).startswith(REFUSALS)
        res.status, res.detail = ("refused", str(e)) if refused else ("failed", f"{type(e).__name__}: {e}")
        res.seconds = time.perf_counter() - t0
        return res
    info = describe(model)
    res.windows, res.rotary = info.windows, info.rotary
    res.rope_check = rope_check(model)
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (1, PROMPT))
    try:
        with torch.no_grad():
            ref = _greedy(model, ids, STEPS)
            for backend, m in compiled.items():
                res.diffs[backend or "eager"] = (_greedy(m, ids, STEPS) - ref).abs().max().item()
    except Exception as e:  # noqa: BLE001
        res.status, res.detail = "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        res.seconds = time.perf_counter() - t0
        return res
    res.status = "supported" if all(d <= TOL for d in res.diffs.values()) else "failed"
    res.seconds = time.perf_counter() - t0
    return res


WINDOWS_NOTE = (
    "*windows*: which layers slide. A budget applies to the full-attention layers only; a sliding layer keeps "
    "its window (exactly the model's `sliding_window` newest tokens, under the `window` rule whatever rule is "
    "compared; docs/DESIGN.md), as the model computes it. `fxbudget compare` says it in its run header, e.g. "
    "for the embedded Gemma 3 270M (`--model gemma3-270m`): `a budget applies to 3 of 18 layers (full "
    "attention: 5, 11, 17); the 15 sliding layers keep their window of 512 tokens`. On real weights: "
    "Qwen2.5-Coder-0.5B-Instruct (qwen2, every layer full) and Gemma 3 270M (gemma3_text, five sliding layers "
    "in six), past the window: `tests/test_real_model.py`, `tests/test_real_gemma.py`, "
    "`tests/test_real_exactness.py` ([embedded models](embedded-models.md)).")


def markdown(results: list[Result]) -> str:
    import transformers

    lines = [f"# Architectures (transformers {transformers.__version__}, torch {torch.__version__})", "",
             "Generated by `python tests/architecture_matrix.py --write docs/architectures.md` from the matrix that "
             "`tests/test_architectures.py` runs: a tiny random 2-layer model of every causal LM of the installed "
             f"transformers, windows of {WINDOW} tokens, a {PROMPT}-token prompt and {STEPS} greedy steps. "
             f"*supported*: a covering budget reproduces the unmodified model (max logit difference <= {TOL}), eagerly "
             "and, where a second figure is given, under `backend=\"aot_eager\"` (the architectures issue 20 names, "
             "which span every window and rotary kind; `--compiled all` runs every one); *refused*: `fxbudget.compile` refuses it before any model work, "
             "naming the feature.", "",
             "*rotary*: the RoPE of the model's layers (*unknown to rules*: fxbudget cannot give rules its "
             "frequencies, even from the model's rotary embedding: interleaved dims, dynamic or LongRoPE scaling, "
             "`rotary_dim`); *RoPE to rules*: the frequencies fxbudget gives rules such as expected_attention, taken "
             "from the model's own rotary embedding (any RoPE type it computes once: default, llama3, YaRN, "
             "linear, ...), are its buffers (checked), or unknown (such rules are refused). *not built*: the matrix could not make a tiny config of it (the reason is given); not a "
             "statement about fxbudget.", "",
             WINDOWS_NOTE, "",
             "| architecture | class | status | windows | rotary | RoPE to rules | max logit diff (eager / aot_eager) "
             "| reason |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        diffs = " / ".join(f"{v:.1e}" for v in r.diffs.values())
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.model_type} | {r.cls} | {r.status} | {r.windows} | {r.rotary} | {r.rope_check} | {diffs} "
                     f"| {detail} |")
    counts = {s: sum(r.status == s for r in results) for s in dict.fromkeys(r.status for r in results)}
    lines += ["", "Totals: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + "."]
    return "\n".join(lines) + "\n"


def main():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--write", help="write the markdown table here")
    p.add_argument("--only", nargs="*", help="model types to run (default: all)")
    p.add_argument("--compiled", choices=("none", "named", "all"), default="named",
                   help="which architectures also run under aot_eager (~10 s each): none, the named ones, all")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for mt, name in causal_lm_types().items():
        if args.only and mt not in args.only:
            continue
        r = run_one(mt, name, backends=(None,) if args.compiled == "none" else backends_for(mt, args.compiled))
        print(f"{mt:28s} {r.status:18s} {r.seconds:5.1f}s {r.diffs} {r.rope_check} {r.detail[:150]}", flush=True)
        results.append(r)
    if args.write:
        Path(args.write).write_text(markdown(results))


if __name__ == "__main__":
    main()
