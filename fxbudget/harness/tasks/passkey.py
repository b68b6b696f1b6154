"""Passkey retrieval (Mohtashami & Jaggi 2023; RULER's simplest needle-in-a-haystack)."""

from __future__ import annotations

from .haystack import _assemble
from .sample import Sample, _check_args, _check_count, _rng


def passkey(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """Passkey retrieval (Mohtashami & Jaggi 2023; RULER's simplest NIAH): a 5-digit key at `depth` in a haystack.

    The needle states the key twice ("The pass key is K. Remember it. K is the pass key."), as in the original.

    Args:
        tokenizer: a Hugging Face tokenizer; lengths are counted in its tokens.
        n_tokens: context length in tokens (met within 2%).
        depth: requested needle position, 0 = start, 1 = end.
        seed: fixes the haystack and the key.

    Returns:
        A :class:`Sample` with ``answers == [key]`` and the measured depth.
    """
    _check_args(n_tokens, depth)
    rng = _rng("passkey", seed)
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    context, n, (measured,) = _assemble(tokenizer, n_tokens, rng, "", [needle], [depth])
    _check_count(context, key, 2)
    return Sample("passkey", context, "What is the pass key? Answer with the number only.", [key],
                  "The pass key is", measured, n, seed, 16,
                  {"requested_depth": depth, "needles": [{"text": needle, "depth": measured}]})
