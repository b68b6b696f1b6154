"""RULER's needle-in-a-haystack family (Hsieh et al. 2024, arXiv:2404.06654): single, multi-key, multi-value and
multi-query "special magic number" retrieval."""

from __future__ import annotations

import random

from .haystack import _NIAH_HEADER, _WORDS, _assemble
from .sample import Sample, _check_args, _check_count, _rng


def _niah(task, tokenizer, n_tokens, depth, seed, rng, pairs, depths, asked, answers, meta) -> Sample:
    """NIAH sample from (key, value) needles; `asked` are the keys the question names."""
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in pairs]
    context, n, measured = _assemble(tokenizer, n_tokens, rng, _NIAH_HEADER, needles, depths)
    for _, v in pairs:
        _check_count(context, v)
    keys = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    if len(answers) == 1:
        question = f"What is the special magic number for {keys} mentioned in the provided text? " \
                   "Answer with the number only."
        prefix = f"The special magic number for {keys} mentioned in the provided text is"
    else:
        question = f"What are all the special magic numbers for {keys} mentioned in the provided text? " \
                   "Answer with the numbers only."
        prefix = f"The special magic numbers for {keys} mentioned in the provided text are"
    meta = {"requested_depth": depth, **meta,
            "needles": [{"text": t, "key": k, "value": v, "depth": d}
                         for t, (k, v), d in zip(needles, pairs, measured)]}
    return Sample(task, context, question, answers, prefix, measured[0], n, seed, 16 if len(answers) == 1 else 64,
                  meta)


def _numbers(rng: random.Random, k: int) -> list[str]:
    return [str(x) for x in rng.sample(range(1_000_000, 10_000_000), k)]  # distinct 7-digit: none inside another


def _near(depth: float, offsets) -> list[float]:
    return [depth + o if 0 <= depth + o <= 1 else depth - o for o in offsets]


def niah_single(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """RULER NIAH single (Hsieh et al. 2024, arXiv:2404.06654): one "special magic number" needle at `depth`.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: needle position in [0, 1].
        seed: fixes haystack, key word and 7-digit number.

    Returns:
        A :class:`Sample` whose one answer is the number; ``depth`` is the needle's measured depth.
    """
    _check_args(n_tokens, depth)
    rng = _rng("niah_single", seed)
    key, value = rng.choice(_WORDS), _numbers(rng, 1)[0]
    return _niah("niah_single", tokenizer, n_tokens, depth, seed, rng, [(key, value)], [depth], [key], [value], {})


def niah_multikey(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """RULER NIAH multi-key: the asked needle at `depth` plus 3 distractor needles (other keys, other numbers).

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: asked needle's position.
        seed: fixes haystack, keys, numbers and the distractors' depths (at least 0.1 away from `depth`).

    Returns:
        A :class:`Sample` whose one answer is the asked key's number; ``meta["distractors"]`` lists the others.
    """
    _check_args(n_tokens, depth)
    rng = _rng("niah_multikey", seed)
    keys, values = rng.sample(_WORDS, 4), _numbers(rng, 4)
    depths = [depth]
    while len(depths) < 4:
        d = rng.random()
        if abs(d - depth) >= 0.1:
            depths.append(d)
    distractors = [{"key": k, "value": v, "requested_depth": d} for k, v, d in zip(keys[1:], values[1:], depths[1:])]
    return _niah("niah_multikey", tokenizer, n_tokens, depth, seed, rng, list(zip(keys, values)), depths, keys[:1],
                 values[:1], {"distractors": distractors})


def niah_multivalue(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """RULER NIAH multi-value: 4 needles with the same key and different numbers, at `depth` and 0.05-0.1 around it.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: first needle's position.
        seed: fixes haystack, key and numbers.

    Returns:
        A :class:`Sample` whose answers are the 4 numbers; ``depth`` is the first needle's measured depth.
    """
    _check_args(n_tokens, depth)
    rng = _rng("niah_multivalue", seed)
    key, values = rng.choice(_WORDS), _numbers(rng, 4)
    return _niah("niah_multivalue", tokenizer, n_tokens, depth, seed, rng, [(key, v) for v in values],
                 _near(depth, (0, 0.05, -0.05, 0.1)), [key], values, {})


def niah_multiquery(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """RULER NIAH multi-query: 4 needles with different keys, one per quarter of the context; all 4 are asked.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: first needle's position; the
            others follow at `depth` + 0.25, 0.5, 0.75 (wrapped into [0, 1)).
        seed: fixes haystack, keys and numbers.

    Returns:
        A :class:`Sample` whose answers are the 4 numbers, in the order the question names their keys.
    """
    _check_args(n_tokens, depth)
    rng = _rng("niah_multiquery", seed)
    keys, values = rng.sample(_WORDS, 4), _numbers(rng, 4)
    depths = [depth] + [(depth + k / 4) % 1.0 for k in (1, 2, 3)]
    return _niah("niah_multiquery", tokenizer, n_tokens, depth, seed, rng, list(zip(keys, values)), depths, keys,
                 values, {})
