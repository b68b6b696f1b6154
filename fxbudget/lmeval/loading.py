"""Load the model and tokenizer `pretrained=` names, through `fxbudget.models.load_model` (the one loader of the
CLI and the harness): a local directory, a local `.gguf`, a Hub id, or the embedded default model (no
`pretrained=`). Always SDPA attention (what fxbudget rewrites), in eval mode.
"""

from __future__ import annotations

from ..models import DEFAULT_MODEL_NAME, load_model


def model_name(pretrained: str | None) -> str:
    """What the results record as the model: the Hub id or path as given, or the embedded model's name."""
    return DEFAULT_MODEL_NAME if pretrained is None else pretrained


def load(pretrained: str | None, *, tokenizer: str | None = None, dtype: str = "float32", device: str = "cpu",
         revision: str | None = None, trust_remote_code: bool = False, use_fast_tokenizer: bool = True,
         progress: bool = True):
    """Load `(model, tokenizer)` for lm-eval.

    Args:
        pretrained: a local model directory, a local `.gguf` file, a Hugging Face Hub id, or None for the embedded
            default model.
        tokenizer: another tokenizer to load (directory or Hub id); default: the model's.
        dtype: "float32", "bfloat16", "float16" or "auto" (the checkpoint's). device: e.g. "cpu", "cuda", "cuda:1".
        revision, trust_remote_code, use_fast_tokenizer: as for transformers' `from_pretrained`.
        progress: print the load time to stderr.
    Returns:
        `(model, tokenizer)`, the model on `device` in eval mode with SDPA attention.
    """
    model, tok, _ = load_model(pretrained, progress=progress, device=device, dtype=dtype, revision=revision,
                               trust_remote_code=trust_remote_code, tokenizer=tokenizer,
                               use_fast_tokenizer=use_fast_tokenizer)
    return model, tok
