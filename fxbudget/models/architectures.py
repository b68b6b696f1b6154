"""Which attention fxbudget reproduces exactly, and the refusal, by name, of everything else.

fxbudget replaces each SDPA call fed by its cache with exact softmax attention over the cached candidates, visibility
from positions (causal, optionally a sliding window). Anything else a model folds into its attention scores would be
dropped, so such a model is refused before any model work, with the feature named: logit soft-capping, attention
sinks, ALiBi and other position biases, chunked or linear/recurrent layers, KV sharing, multi-head latent attention,
bidirectional attention, and attention computed outside transformers' SDPA interface. The architecture matrix
(`tests/test_architectures.py`, table in `docs/architectures.md`) checks that whatever is not refused is exact.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

from torch import nn

from .layer_config import UnsupportedArchitectureError, layer_types, layer_windows, rope_kind, text_config

__all__ = ["UnsupportedArchitectureError", "ArchitectureInfo", "check_config", "check_model", "describe",
           "layer_shapes"]

# Config attributes that, when set (not None / False / 0), put something into the attention scores or the cached
# keys that fxbudget's kernel does not compute.
_CONFIG_FEATURES = (
    ("attn_logit_softcapping", "attention logit soft-capping"),
    ("alibi", "ALiBi position biases"),
    ("relative_attention_num_buckets", "relative position biases (T5-style)"),
    ("use_bidirectional_attention", "bidirectional attention"),
    ("num_kv_shared_layers", "KV sharing between layers"),
    ("kv_lora_rank", "multi-head latent attention (compressed KV)"),
    ("q_lora_rank", "multi-head latent attention (compressed KV)"),
    ("is_encoder_decoder", "encoder-decoder attention"),
    ("add_cross_attention", "cross-attention"),
)

# Features visible only in a family's modeling code, found by running its tiny model (the architecture matrix):
# model_type -> what its attention does besides exact softmax attention over cached keys.
_MODEL_FEATURES: dict[str, str] = {
    "ctrl": "a forward that reassigns a tensor attribute (self.pos_encoding), which torch.compile cannot trace",
    "dory": "looped layers that attend over the cache outside update() (a cache offset per loop)",
    "diffllama": "differential attention (the difference of two softmax maps)",
    "doge": "dynamic mask attention (a learned additive bias on the scores)",
    "jetmoe": "mixture-of-attention-heads (keys reach SDPA through expert routing)",
    "moshi": "a sliding-window mask of its own (moshi's modeling code)",
    "musicgen_decoder": "several codebooks per token (audio inputs)",
    "musicgen_melody_decoder": "several codebooks per token (audio inputs)",
    "whisper": "a decoder built for cross-attention to an encoder",
}


def _refuse(name: str, feature: str, where: str) -> None:
    raise UnsupportedArchitectureError(
        f"fxbudget cannot reproduce {name}'s attention exactly: {feature} ({where}) is not supported, and a budget "
        "would silently drop it")


def check_config(config) -> None:
    """Raise `UnsupportedArchitectureError` naming the feature if a config's attention is one fxbudget cannot
    reproduce (see the module docstring); also checks every layer's window (`layer_windows`).

    Args:
        config: a transformers config (or any object with the attributes `layer_config` reads).
    """
    cfg = text_config(config)
    name = getattr(cfg, "model_type", None) or type(cfg).__name__
    for attr, feature in _CONFIG_FEATURES:
        val = getattr(cfg, attr, None)
        if val not in (None, False, 0):
            _refuse(name, feature, f"config.{attr}={val!r}")
    if getattr(cfg, "position_embedding_type", None) not in (None, "absolute", "rope"):
        _refuse(name, f"{cfg.position_embedding_type!r} position embeddings", "config.position_embedding_type")
    modes = getattr(cfg, "kv_sharing_modes", None)
    if modes is not None and any(m == "reuse" for m in modes):
        _refuse(name, "KV sharing between layers", "config.kv_sharing_modes")
    for family in dict.fromkeys((getattr(config, "model_type", None), name)):
        if model_feature(family) is not None:
            _refuse(family, model_feature(family), f"modeling_{family}")
    v_dim, heads = getattr(cfg, "v_head_dim", None), getattr(cfg, "num_attention_heads", None)
    k_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if v_dim is not None and v_dim != k_dim:
        _refuse(name, "value heads of another size than key heads", f"config.v_head_dim={v_dim}")
    layer_windows(cfg)


def model_feature(model_type: str) -> str | None:
    """The feature a model family's code adds to its attention, if fxbudget knows of one (`_MODEL_FEATURES`)."""
    return _MODEL_FEATURES.get(model_type)


def _dispatches_through_interface(cls: type) -> bool | None:
    """Whether a transformers model class computes attention with transformers' attention interface (so with
    `sdpa_attention_forward` under SDPA); None for classes from elsewhere (checked at call time instead)."""
    return _module_dispatches(getattr(cls, "__module__", ""))


@functools.lru_cache(maxsize=None)
def _module_dispatches(module: str) -> bool | None:
    if not module.startswith("transformers.models."):
        return None
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(importlib.import_module(module))
    except (OSError, TypeError):
        return None


def check_model(model: nn.Module) -> None:
    """`check_config` on the model's config, then what only the model shows: attention computed outside
    transformers' SDPA interface, attention-sink parameters.

    Args:
        model: a transformers model (modules without a `config` are checked at call time instead).
    Raises:
        UnsupportedArchitectureError: naming the feature.
    """
    config = getattr(model, "config", None)
    if config is None:
        return
    check_config(config)
    name = getattr(text_config(config), "model_type", None) or type(model).__name__
    if _dispatches_through_interface(type(model)) is False:
        _refuse(name, "attention computed outside transformers' SDPA interface (sdpa_attention_forward)",
                f"{type(model).__module__}")
    forward = getattr(type(model), "forward", None)
    if forward is not None and "position_ids" not in inspect.signature(forward).parameters:
        _refuse(name, "positions counted from the cache length, not taken from position_ids (BART-style learned "
                "positions; fxbudget pads compiled calls and must tell the model each token's position)",
                f"{type(model).__name__}.forward")
    for mname, module in model.named_modules():
        if hasattr(type(module), "create_position_ids_from_input_ids"):  # RoBERTa and its family
            _refuse(name, "position ids computed from the input ids, offset past padding_idx (RoBERTa-style)",
                    f"module {mname or type(module).__name__}")
    for pname, _ in model.named_parameters():
        leaf = pname.rsplit(".", 1)[-1]
        if leaf in ("sinks", "s_aux", "attention_sinks"):
            _refuse(name, "attention sinks (a learned logit added to every softmax)", f"parameter {pname}")


@dataclass(frozen=True)
class ArchitectureInfo:
    """What the architecture table reports of a supported model."""

    windows: str  # e.g. "full", "model-wide 4096", "layer types: sliding 512 / full"
    rotary: str  # e.g. "default", "default partial 0.25", "llama3 (unknown to rules)", "none"


def describe(model: nn.Module) -> ArchitectureInfo:
    """`check_model`, then the model's window kind and rotary kind.

    Raises:
        UnsupportedArchitectureError: as `check_model`.
    """
    check_model(model)
    cfg = text_config(model.config)
    windows = layer_windows(cfg)
    if not any(windows):
        kind = "full"
    elif all(windows) and getattr(cfg, "layer_types", None) is None:
        kind = f"model-wide {windows[0]}"
    elif all(windows):
        kind = f"every layer sliding {windows[0]}"
    else:
        kind = f"per layer: {sum(map(bool, windows))} sliding {max(windows)}, {windows.count(0)} full"
    types = dict.fromkeys("sliding_attention" if w else "full_attention" for w in windows)
    rotary = " / ".join(dict.fromkeys(rope_kind(cfg, t) for t in types))
    return ArchitectureInfo(kind, rotary)


def layer_shapes(config) -> tuple[int, int, int, int, tuple[str, ...]]:
    """(layers, kv heads, head dim, query heads, layer types) of a config; raises `UnsupportedArchitectureError`
    (naming the feature) for attention fxbudget cannot reproduce (`check_config`)."""
    check_config(config)
    cfg = text_config(config)
    heads = cfg.num_attention_heads
    # GPT-BigCode keeps multi-query attention as a flag rather than num_key_value_heads=1
    kv_heads = 1 if getattr(cfg, "multi_query", False) else getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim, heads, layer_types(config)
