"""Models: the embedded models, declared once (`embedded`: name, packages, sha256, chat or base), what `--model`
names (`source`), loading it (`load`), `--device`/`--dtype` (`devices`, with `cpu_bf16`: whether the CPU computes
bf16 natively), what a config says about each attention layer (`layer_config`) and which attention is reproduced
exactly or refused by name (`architectures`). Torch-free at import.

May import: `checks` only.
"""

from .load import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_WEIGHTS, default_cache_dir, default_model_available,
                   embedded_available, embedded_tokenizer, load_default, load_embedded, load_model, load_tokenizer,
                   model_name, prepare_default)

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_WEIGHTS", "default_cache_dir", "default_model_available",
           "embedded_available", "embedded_tokenizer", "load_default", "load_embedded", "load_model", "load_tokenizer",
           "model_name", "prepare_default"]
