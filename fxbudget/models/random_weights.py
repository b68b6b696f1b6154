"""A real architecture with seeded random weights, built on the device: `load_random(config, device, dtype, seed)`.

For machines that have no weights (a borrowed GPU with no network): the architecture comes from a config (a
`config.json`-style file or dict: benchmarks/configs/ holds Qwen2.5-0.5B's, Llama-3.1-8B's and Qwen2.5-7B's), the
weights from a seed. Such a model answers nothing useful, so it measures no accuracy; it measures correctness
(fxbudget against the same model unmodified) and cost, which depend on the shapes, not on the weights.

Every parameter is drawn from its own generator, seeded by `seed` and the parameter's name, so a model built twice
with the same seed is identical, whatever the number of layers asked (layer i's weights do not depend on how many
follow). With `generate_on="cpu"` (default) the values are drawn on the CPU and copied to the device: the same weights
on every device (what a GPU-vs-CPU comparison needs). `generate_on="device"` draws them on the device itself: fast for
8B-shaped layers on a GPU, identical from run to run on one device type, not across devices.

Torch and transformers are imported inside the functions (`fxbudget.models` is torch-free at import).
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from pathlib import Path

__all__ = ["load_config", "load_random"]


def load_config(config: str | os.PathLike | dict, layers: int | None = None):
    """A transformers config from a `config.json`-style file or dict (its `model_type` picks the class), with SDPA
    attention; `layers` overrides `num_hidden_layers` (and cuts `layer_types` to match, where the config has them).

    Raises:
        ValueError: no `model_type`, or `layers` not a positive int.
    """
    from transformers import AutoConfig

    if isinstance(config, dict):
        values, where = dict(config), "the config dict"
    else:
        values, where = json.loads(Path(config).read_text()), str(config)
    values = {k: v for k, v in values.items() if not k.startswith("_")}  # "_source" notes are not config values
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{where}: no model_type (e.g. \"llama\", \"qwen2\")")
    if layers is not None:
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(f"layers must be a positive int, got {layers!r}")
        values["num_hidden_layers"] = layers
        for key in ("layer_types", "no_rope_layers"):
            if isinstance(values.get(key), list):
                values[key] = values[key][:layers]
        if "max_window_layers" in values:
            values["max_window_layers"] = min(values["max_window_layers"], layers)
    values.pop("architectures", None)
    values.pop("torch_dtype", None)
    values.pop("dtype", None)
    cfg = AutoConfig.for_model(model_type, **values)
    cfg._attn_implementation = "sdpa"
    return cfg


def _no_init():
    """transformers' context that skips its weight initialization (every parameter is written below anyway)."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return __import__(module, fromlist=["no_init_weights"]).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def _tensor_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


def load_random(config: str | os.PathLike | dict, device: str = "cpu", dtype=None, seed: int = 0,
                layers: int | None = None, generate_on: str = "cpu"):
    """A causal LM of `config`'s architecture with seeded random weights, on `device`, in eval mode, SDPA attention.

    Args:
        config: a `config.json`-style path or dict (`load_config`).
        device: where the model is built ("cpu", "cuda", "cuda:1").
        dtype: a torch dtype or its name ("bfloat16"); None: float32.
        seed: the weights' seed: the same seed gives the same model.
        layers: overrides `num_hidden_layers` (an 8B-shaped model with 2-4 layers: the per-layer cost is the same).
        generate_on: "cpu" (the same weights on every device) or "device" (drawn on the device: fast, same from run
            to run on one device type only).

    Weights: 2-D and larger parameters and biases ~ N(0, `initializer_range`) (0.02 by default), norm weights 1.

    Raises:
        ValueError: as `load_config`; `generate_on` not "cpu" or "device".
    """
    import torch
    from transformers import AutoModelForCausalLM

    if generate_on not in ("cpu", "device"):
        raise ValueError(f"generate_on must be 'cpu' or 'device', got {generate_on!r}")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
    cfg = load_config(config, layers)
    std = float(getattr(cfg, "initializer_range", 0.02) or 0.02)
    with torch.device(device), _no_init():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.tie_weights()  # tied as the config says (skipped with the initialization); then each tensor is drawn once
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
                continue
            s = _tensor_seed(seed, name)
            if generate_on == "cpu":
                g = torch.Generator().manual_seed(s)
                p.copy_(torch.randn(p.shape, generator=g).mul_(std))
            else:
                g = torch.Generator(device=p.device).manual_seed(s)
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype).mul_(std))
    return model.eval().requires_grad_(False)
