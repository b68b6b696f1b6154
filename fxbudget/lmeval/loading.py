"""Load the model and tokenizer `pretrained=` names: a local directory, a local `.gguf`, a Hub id, or the embedded
default model (no `pretrained=`). Always SDPA attention (what fxbudget rewrites), in eval mode.

`fxbudget.models.load_model` takes local paths only and loads float32 on CPU; this module adds Hub ids, `dtype`
and `device` for lm-eval (the two should become one loader in `fxbudget.models` once it takes them too).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..models import DEFAULT_MODEL_NAME, load_default

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def model_name(pretrained: str | None) -> str:
    """What the results record as the model: the Hub id or path as given, or the embedded model's name."""
    return DEFAULT_MODEL_NAME if pretrained is None else pretrained


def load(pretrained: str | None, *, tokenizer: str | None = None, dtype: str = "float32", device: str = "cpu",
         revision: str | None = None, trust_remote_code: bool = False, use_fast_tokenizer: bool = True,
         progress: bool = True):
    """Load `(model, tokenizer)` for lm-eval.

    Args:
        pretrained: a local model directory, a local `.gguf` file, a Hugging Face Hub id, or None for the embedded
            default model (`fxbudget.models.load_default`, then cast to `dtype`).
        tokenizer: another tokenizer to load (directory or Hub id); default: the model's.
        dtype: "float32", "bfloat16", "float16" or "auto" (the checkpoint's). device: e.g. "cpu", "cuda", "cuda:1".
        revision, trust_remote_code, use_fast_tokenizer: as for transformers' `from_pretrained`.
        progress: print the load time to stderr.
    Returns:
        `(model, tokenizer)`, the model on `device` in eval mode with SDPA attention.
    """
    start = time.perf_counter()
    torch_dtype = _DTYPES[dtype]
    if pretrained is None:
        model, tok = load_default(progress=progress)
        if torch_dtype != "auto":
            model = model.to(torch_dtype)
        if tokenizer is not None:
            tok = AutoTokenizer.from_pretrained(tokenizer, use_fast=use_fast_tokenizer)
        return model.to(device).eval(), tok
    path = Path(pretrained).expanduser()
    source, extra = str(pretrained), {}
    if path.is_file() and path.suffix == ".gguf":
        source, extra = str(path.parent), {"gguf_file": path.name}
    elif path.exists() and not path.is_dir():
        raise FileNotFoundError(f"pretrained={pretrained}: not a model directory or a .gguf file")
    hub = {} if path.exists() else {"revision": revision or "main"}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, attn_implementation="sdpa",
                                                 trust_remote_code=trust_remote_code, **hub, **extra)
    tok_kwargs = {"trust_remote_code": trust_remote_code, **hub}
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer, use_fast=use_fast_tokenizer, **tok_kwargs)
    else:
        tok = AutoTokenizer.from_pretrained(source, **tok_kwargs, **(extra or {"use_fast": use_fast_tokenizer}))
    model = model.to(device).eval()
    if progress:
        import sys

        print(f"[fxbudget] loaded {pretrained} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return model, tok
