"""What a model config says about each attention layer: shapes, sliding window, RoPE frequencies.

Each layer's window is read the way the installed transformers' mask code decides it:
- a modeling module that picks its mask with `create_causal_mask if config.sliding_window is None else
  create_sliding_window_causal_mask` (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE, ...) slides every layer over
  `config.sliding_window` tokens, whatever `layer_types` says;
- otherwise `layer_types` decides per layer (`sliding_attention` layers slide over `config.sliding_window`); Qwen2's
  and Qwen3's `use_sliding_window` / `max_window_layers` are already folded into `layer_types` by their configs;
- otherwise, as transformers' `create_masks_for_generate`: a model-wide `sliding_window` slides every layer, unless
  the model's modeling module never builds a sliding mask (then it is ignored, as the model ignores it).
A window `w` lets a query at position `q` see keys at `k > q - w` (`masking_utils.sliding_window_overlay`): `w` keys,
the query's own included; the kernel's `sliding` means the same (`kp > qp - sliding`).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
from torch import Tensor

_WIDE_MASK = "sliding_window is None else create_sliding_window_causal_mask"
FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedArchitectureError(NotImplementedError):
    """The model uses an attention feature fxbudget cannot reproduce exactly (named in the message)."""


def text_config(config):
    """The decoder's config of a (possibly composite) config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


@functools.lru_cache(maxsize=None)
def _module_source(config_module: str) -> str | None:
    """Source of the modeling module next to a transformers configuration module (None if there is none)."""
    if not config_module.startswith("transformers.models.") or ".configuration_" not in config_module:
        return None
    try:
        return inspect.getsource(importlib.import_module(config_module.replace(".configuration_", ".modeling_")))
    except (ImportError, OSError, TypeError):
        return None


def modeling_source(config) -> str | None:
    """Source of the transformers modeling module of a config's model (None for configs from elsewhere)."""
    return _module_source(type(text_config(config)).__module__)


def _window(cfg, why: str) -> int:
    w = getattr(cfg, "sliding_window", None)
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise UnsupportedArchitectureError(f"{why}, but its sliding_window is {w!r}: not a window fxbudget (or "
                                           "transformers' mask code) can apply")
    return w


def layer_windows(config) -> tuple[int, ...]:
    """Each layer's sliding window in tokens (0 = full attention), as the model's mask code decides it.

    Args:
        config: a transformers config (or any object with `num_hidden_layers`, optional `layer_types`,
            `sliding_window`).
    Returns:
        One int per layer.
    Raises:
        UnsupportedArchitectureError: a layer type other than full or sliding attention (chunked, linear, hybrid,
            ...), chunked attention, or a sliding layer without a usable window.
    """
    cfg = text_config(config)
    n = cfg.num_hidden_layers
    src = modeling_source(cfg)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        for t in dict.fromkeys(types):
            if t not in (FULL, SLIDING):
                raise UnsupportedArchitectureError(
                    f"fxbudget supports full and sliding attention layers, not {t!r} layers (config.layer_types)")
    if src is not None and _WIDE_MASK in src:
        w = getattr(cfg, "sliding_window", None)
        return (_window(cfg, "every layer of this model slides") if w is not None else 0,) * n
    if types is not None:
        types = list(types)
        if len(types) != n:
            raise UnsupportedArchitectureError(f"config.layer_types has {len(types)} entries for {n} layers")
        w = _window(cfg, "config.layer_types has sliding_attention layers") if SLIDING in types else 0
        return tuple(w if t == SLIDING else 0 for t in types)
    if getattr(cfg, "attention_chunk_size", None) is not None:
        raise UnsupportedArchitectureError("chunked attention (config.attention_chunk_size) is not supported")
    if getattr(cfg, "sliding_window", None) is not None and (src is None or "create_sliding_window_causal_mask"
                                                             in src):
        if src is not None:  # a sliding mask built some other way: which layers it reaches is not known here
            raise UnsupportedArchitectureError(
                f"cannot tell which layers of {type(cfg).__name__} slide (a sliding_window and no layer_types, and "
                "its modeling code builds sliding masks in a way fxbudget does not read)")
        return (_window(cfg, "every layer slides (a model-wide sliding_window)"),) * n
    return (0,) * n


def budgeted_layers_line(config) -> str:
    """Which layers a budget applies to, for a run's header: the full-attention layers; sliding layers keep their
    window (never budgeted). E.g. "a budget applies to 3 of 18 layers (full attention: 5, 11, 17); the 15 sliding
    layers keep their window of 512 tokens".

    Raises:
        UnsupportedArchitectureError: as `layer_windows`.
    """
    windows = layer_windows(config)
    full = [i for i, w in enumerate(windows) if not w]
    n = len(windows)
    if len(full) == n:
        return f"a budget applies to all {n} layers (full attention)"
    sliding = sorted(set(w for w in windows if w))
    keep = f"keep their window of {'/'.join(map(str, sliding))} tokens"
    if not full:
        return f"a budget applies to no layer: all {n} layers slide and {keep}"
    return (f"a budget applies to {len(full)} of {n} layers (full attention: {', '.join(map(str, full))}); the "
            f"{n - len(full)} sliding layers {keep}")


def layer_types(config) -> tuple[str, ...]:
    """`full_attention` / `sliding_attention` per layer, from `layer_windows`."""
    return tuple(SLIDING if w else FULL for w in layer_windows(config))


def rope_parameters(cfg, layer_type: str) -> dict:
    """The RoPE parameters of a layer type (per-type dicts, as Gemma 3 keeps them, or one for all layers)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict) or layer_type in params:
        params = params.get(layer_type) or {}
    return dict(params)


def partial_rotary_factor(cfg, layer_type: str) -> float:
    """The fraction of each head's dims that RoPE rotates: from `rope_parameters` (transformers 5: GLM, StableLM,
    GPT-NeoX, Phi), else the config's top level, else 1."""
    params = rope_parameters(cfg, layer_type)
    return float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))


@functools.lru_cache(maxsize=None)
def _rotation_layout(config_module: str) -> str:
    """How the model's `rotate_half` pairs dims: "half" (i with i + d/2, as Llama) or "interleaved" (2i with 2i+1,
    as GLM and Cohere), "unknown" when its modeling module has none."""
    src = _module_source(config_module)
    if src is None:
        return "half"  # not a transformers model: fxbudget's convention, the one the rule documents
    fn = getattr(importlib.import_module(config_module.replace(".configuration_", ".modeling_")), "rotate_half", None)
    if fn is None:
        return "unknown"
    x = torch.arange(4.0)
    out = fn(x)
    if torch.equal(out, torch.tensor([-2.0, -3.0, 0.0, 1.0])):
        return "half"
    if torch.equal(out, torch.tensor([-1.0, 0.0, -3.0, 2.0])):
        return "interleaved"
    return "unknown"


def rope_kind(config, layer_type: str = FULL) -> str:
    """A description of a layer type's RoPE (the architecture table's `rotary` column), marked "(unknown to rules)"
    when fxbudget cannot give rules its frequencies even from the model's rotary embedding (`rope_refusal`)."""
    cfg = text_config(config)
    params = rope_parameters(cfg, layer_type)
    if "rope_theta" not in params:
        return "none"
    kind = params.get("rope_type", "default")
    factor = partial_rotary_factor(cfg, layer_type)
    layout = _rotation_layout(type(cfg).__module__)
    parts = [kind] + ([f"partial {factor:g}"] if factor != 1.0 else []) + ([layout] if layout != "half" else [])
    return " ".join(parts) + ("" if rope_refusal(config, layer_type) is None else " (unknown to rules)")


def uses_rope(config, layer: int) -> bool:
    """Whether layer `layer` rotates its queries and keys: False for the NoPE layers of `config.no_rope_layers`
    (SmolLM3: 1 = RoPE, 0 = none, per layer, as its attention reads it)."""
    flags = getattr(text_config(config), "no_rope_layers", None)
    return not flags or layer >= len(flags) or bool(flags[layer])


def layer_inv_freq(config, layer: int, layer_type: str, head_dim: int) -> Tensor | None:
    """The RoPE frequencies of layer `layer` (`rope_inv_freq`), or zeros for a NoPE layer (`uses_rope`): a rotation
    by angle 0 is the identity, so a rule's pre-RoPE keys of that layer are its keys, exactly."""
    if not uses_rope(config, layer):
        return torch.zeros(head_dim // 2)
    return rope_inv_freq(config, layer_type, head_dim)


# RoPE types whose rotary embedding changes its frequencies with the sequence length during the forward
# (transformers' `dynamic_rope_update`): one fixed `inv_freq` per layer cannot describe them.
DYNAMIC_ROPE = ("dynamic", "longrope")


def rope_refusal(config, layer_type: str, head_dim: int | None = None) -> str | None:
    """Why fxbudget cannot give rules a layer type's RoPE frequencies even from the model's own rotary embedding
    (`fxbudget.cache.rope`), or None when it can: no RoPE, dims paired otherwise than `rotate_half` (interleaved:
    GLM, Cohere), rotated dims named by `rotary_dim` (GPT-J, CodeGen), an odd rotated width, or a RoPE type whose
    frequencies change with the sequence length (`DYNAMIC_ROPE`: dynamic NTK, LongRoPE)."""
    cfg = text_config(config)
    params = rope_parameters(cfg, layer_type)
    if "rope_theta" not in params:
        return "no RoPE parameters (rope_theta) in the config"
    kind = params.get("rope_type", "default")
    if any(d in kind for d in DYNAMIC_ROPE):
        return f"{kind!r} RoPE changes its frequencies with the sequence length"
    layout = _rotation_layout(type(cfg).__module__)
    if layout != "half":
        return f"its rotate_half pairs dims {layout}, not as halves"
    if getattr(cfg, "rotary_dim", None) is not None:
        return "rotated dims named directly (config.rotary_dim): each family derives its frequencies"
    head_dim = head_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * partial_rotary_factor(cfg, layer_type))
    if dim < 2 or dim % 2:
        return f"{dim} rotated dims per head"
    return None


def rope_inv_freq(config, layer_type: str, head_dim: int | None = None) -> Tensor | None:
    """Default-RoPE inverse frequencies of a layer type computed from the config alone, as transformers computes them
    (`1 / theta ** (arange(0, r, 2) / r)`, `r = int(head_dim * partial_rotary_factor)` rotated dims, the first `r` of
    each head, paired as `rotate_half` pairs them): `[r // 2]`. None (unknown: rules that need it are refused) for any
    other RoPE type (llama3, YaRN, linear, ...: a cache attached to a model takes those from the model's rotary
    embedding, `fxbudget.cache.rope`), or when `rope_refusal` names a reason.

    Args:
        config: the model config. layer_type: "full_attention" or "sliding_attention".
        head_dim: the layer's head dim (default: the config's).
    """
    cfg = text_config(config)
    params = rope_parameters(cfg, layer_type)
    if rope_refusal(cfg, layer_type, head_dim) is not None or params.get("rope_type", "default") != "default":
        return None
    head_dim = head_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * partial_rotary_factor(cfg, layer_type))
    return 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
