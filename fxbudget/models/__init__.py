"""Models: what `--model` names (`source`), loading it and the embedded default (`load`), `--device`/`--dtype`
(`devices`), what a config says about each attention layer (`layer_config`) and which attention is reproduced
exactly or refused by name (`architectures`). Torch-free at import.

May import: `checks` only.
"""

from .load import (DEFAULT_MODEL_NAME, DEFAULT_MODEL_WEIGHTS, default_cache_dir, default_model_available, load_default,
                   load_model, load_tokenizer, model_name)

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_WEIGHTS", "default_cache_dir", "default_model_available", "load_default",
           "load_model", "load_tokenizer", "model_name"]
