"""Models: the embedded models, declared once (`embedded`: name, packages, sha256, chat or base), what `--model`
names (`source`), loading it (`load`), `--device`/`--dtype` (`devices`, with `cpu_bf16`: whether the CPU computes
bf16 natively), what a config says about each attention layer (`layer_config`) and which attention is reproduced
exactly or refused by name (`architectures`), and a config's architecture with seeded random weights
(`random_weights`: `load_random`, for machines without weights). Torch-free at import.

May import: `checks` only.
"""

from .load import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_WEIGHTS, default_cache_dir, default_model_available,
                   embedded_available, embedded_tokenizer, load_default, load_embedded, load_model, load_tokenizer,
                   model_name, prepare_default)
from .random_weights import load_config, load_random

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_WEIGHTS", "default_cache_dir", "default_model_available",
           "embedded_available", "embedded_tokenizer", "load_config", "load_default", "load_embedded", "load_model",
           "load_random", "load_tokenizer", "model_name", "prepare_default"]
