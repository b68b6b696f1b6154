"""The RoPE frequencies rules read (`Signals.inv_freq`), taken from the model's own rotary embedding.

A cache built from a config alone knows only default RoPE (`layer_config.rope_inv_freq`). A cache built for a model
(`cache.for_model`, so `model.forward.new_cache()` and every compiled run) takes each layer's inverse frequencies from the
rotary embedding module the model applies, whatever its RoPE type computed them with (llama3 as in Llama-3.1, YaRN,
linear, default, ...): the buffer transformers multiplies positions by, `rotary_emb.inv_freq`, or
`rotary_emb.<layer_type>_inv_freq` for models that keep one per layer type (Gemma 3). Refused (None: rules that need
RoPE are refused by name) when the model's decoder holds no rotary embedding or several (which layer uses which is
not known: Granite-SWA keeps one per theta), when its RoPE type changes the frequencies with the sequence length
(`dynamic`, `longrope`: `layer_config.DYNAMIC_ROPE`), when the dims are paired otherwise (interleaved: GLM, Cohere),
or when the frequencies do not cover the layer's rotated dims. NoPE layers (`config.no_rope_layers`) get zeros.

Each layer also records the embedding's `attention_scaling` (transformers multiplies cos and sin by it: YaRN's
`0.1 ln(factor) + 1`; 1 for default, llama3, linear), so the cached post-RoPE keys and the queries are that factor
times a rotation of the pre-RoPE ones. Un-rotating (`Signals.prerope_keys`, expected_attention's queries) keeps it:
expected_attention then models the queries and keys the model really multiplies (as kvpress's average rotation,
built from the model's own cos/sin, does); leverage and compactor see the pre-RoPE keys times that factor (the
leverage depends on it only through its 1e-2 ridge term, relative to the keys' scale).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from ..models.layer_config import (DYNAMIC_ROPE, layer_types, layer_windows, partial_rotary_factor, rope_inv_freq, rope_kind,
                           rope_refusal, text_config, uses_rope)


def _decoder(model: nn.Module) -> nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if isinstance(decoder, nn.Module) else model


def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The rotary-embedding modules of the model's decoder: those holding an `inv_freq` buffer (or one per layer type,
    `<layer_type>_inv_freq`), by name."""
    return [(name, m) for name, m in _decoder(model).named_modules()
            if any(b.endswith("inv_freq") and "original" not in b for b, _ in m.named_buffers(recurse=False))]


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


# model -> (its rotary state, `model_rope`'s entries): every cache built for a model (each prefill without one)
# reads its frequencies, and reading them back from a GPU is a sync; they are read once per rotary state.
_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plain(v) -> bool:
    """A number or string, or a dict of them (per-layer-type RoPE types): compared by value, no tensor read."""
    if isinstance(v, dict):
        return all(isinstance(x, (str, int, float)) for x in v.values())
    return isinstance(v, (str, int, float))


def _rotary_state(model: nn.Module) -> tuple:
    """What `model_rope` reads, without reading a value: the config object, each rotary module's buffers (identity,
    in-place version, dtype, device) and its plain attributes (RoPE type, attention scaling)."""
    return (id(model.config), tuple(
        (name, tuple((b, id(t), t._version, t.dtype, t.device) for b, t in m.named_buffers(recurse=False)),
         repr(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and _plain(v))))
        for name, m in rotary_modules(model)))


def model_rope(model: nn.Module) -> list[tuple[Tensor, float] | str | None]:
    """Each decoder layer's RoPE as the model applies it: `(inv_freq [r/2] float32 on CPU, attention_scaling)`, zeros
    and 1 for a NoPE layer, (a str) why it is unknown, or None where the decoder holds no rotary embedding module
    (a model from outside transformers: the config's default RoPE stands, `layer_config.rope_inv_freq`).

    The frequencies are copied to the CPU once per model and rotary state (`_rotary_state`: a replaced or
    modified buffer is read again), not on every call: a copy from a GPU waits for its queue.

    Args:
        model: a transformers causal LM (its `config` names the layers and their types).
    """
    state = _rotary_state(model)
    kept = _READ.get(model)
    if kept is None or kept[0] != state:
        kept = _READ[model] = (state, _read_rope(model))
    return [(e[0].clone(), e[1]) if isinstance(e, tuple) else e for e in kept[1]]


def _read_rope(model: nn.Module) -> list[tuple[Tensor, float] | str | None]:
    cfg = text_config(model.config)
    head_dim = _head_dim(cfg)
    found = rotary_modules(model)
    out: list[tuple[Tensor, float] | str | None] = []
    for i, t in enumerate(layer_types(model.config)):
        if not uses_rope(cfg, i):
            out.append((torch.zeros(head_dim // 2), 1.0))
            continue
        reason = rope_refusal(cfg, t, head_dim)
        if reason is None and not found:
            out.append(None)  # no rotary embedding module to read: the config's default RoPE, if it is that
            continue
        if reason is None and len(found) > 1:
            reason = (f"its decoder holds {len(found)} rotary embeddings ({', '.join(n for n, _ in found)}): which "
                      "layer applies which is not known")
        entry = None
        if reason is None:
            reason, entry = _layer_rope(found[0][1], t, head_dim, cfg)
        out.append(f"layer {i} ({t}): {reason}" if reason else entry)
    return out


def _layer_rope(rot: nn.Module, layer_type: str, head_dim: int, cfg) -> tuple[str | None, tuple[Tensor, float] | None]:
    """(reason, None) or (None, (inv_freq, attention_scaling)) of one layer type from the rotary embedding `rot`."""
    kind = getattr(rot, "rope_type", None)
    if isinstance(kind, dict):
        kind = kind.get(layer_type)
    per_type = hasattr(rot, f"{layer_type}_inv_freq")
    inv_freq = getattr(rot, f"{layer_type}_inv_freq" if per_type else "inv_freq", None)
    scaling = getattr(rot, f"{layer_type}_attention_scaling" if per_type else "attention_scaling", 1.0)
    if isinstance(kind, str) and any(d in kind for d in DYNAMIC_ROPE):
        return f"its rotary embedding's {kind!r} RoPE changes its frequencies with the sequence length", None
    if not isinstance(inv_freq, Tensor):
        return f"its rotary embedding has no inverse frequencies for {layer_type} layers", None
    rotated = int(head_dim * partial_rotary_factor(cfg, layer_type))
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] != rotated:
        return (f"its rotary embedding's {tuple(inv_freq.shape)} frequencies do not cover the {rotated} rotated dims "
                "of each head"), None
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        return f"its rotary embedding's attention_scaling is {scaling!r}", None
    return None, (inv_freq.detach().to("cpu", torch.float32).clone(), float(scaling))


def rope_refusal_for(model: nn.Module) -> str | None:
    """Why a rule that reads RoPE frequencies (`needs_rope`) cannot run on this model: the first budgeted layer whose
    frequencies are unknown (sliding layers are not budgeted, so no rule scores them), or None."""
    cfg = text_config(model.config)
    for i, (entry, window, t) in enumerate(zip(model_rope(model), layer_windows(cfg), layer_types(cfg))):
        if window:
            continue
        if isinstance(entry, str):
            return entry
        if entry is None and rope_inv_freq(cfg, t, _head_dim(cfg)) is None:
            return f"layer {i} ({t}): no rotary embedding module found in the decoder, and the config's RoPE is " \
                   f"not default RoPE ({rope_kind(cfg, t)})"
    return None
