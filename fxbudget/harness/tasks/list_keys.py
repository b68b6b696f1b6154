"""A long-answer task: list every key of a key-value store spread through the haystack, in order.

The answer runs to a few hundred tokens (one key word and a comma each), so a rule that holds the budget while the
model decodes (the `streaming` protocol) is tested on a long output, and a rule that makes answers longer shows in
the report's output-length comparison. Scored as the fraction of the keys listed in order (`in_order_score`).
"""

from __future__ import annotations

import math
import re

from .haystack import _WORDS, _assemble
from .sample import Sample, _check_args, _check_count, _count, _rng

HEADER = ("A key-value store is written into the following text, one entry at a time. Memorize every key and the "
          "order in which they come.\n")
MAX_KEYS = 120  # about 300 answer tokens with the embedded model's tokenizer
TOKENS_PER_KEY = 16  # context tokens per key: each entry (about 8 tokens) has haystack around it
SCORING = "keys_in_order"  # `meta["scoring"]`: `prompt.score` scores the sample with `in_order_score`


def _entry(key: str, value: int) -> str:
    return f"Key {key} holds {value}."


# Key words: none in the header or the entry template, none part of another (a key found in the output is one key).
_TEMPLATE = set(re.findall(r"[a-z]+", (HEADER + _entry("", 0)).lower()))
_POOL = tuple(w for w in _WORDS if w not in _TEMPLATE and not any(w != o and w in o for o in _WORDS))


def n_keys(n_tokens: int) -> int:
    """How many keys a context of `n_tokens` holds: one per `TOKENS_PER_KEY` tokens, 2 to `MAX_KEYS`."""
    return max(2, min(MAX_KEYS, n_tokens // TOKENS_PER_KEY))


def list_keys(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, keys: int | None = None) -> Sample:
    """Entries "Key apple holds 482." spread evenly through the haystack; the question asks for every key in order.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: unused (the entries span the whole
            context), kept for the tasks' common signature.
        seed: fixes haystack, keys and values. keys: how many entries (default `n_keys(n_tokens)`).

    Returns:
        A :class:`Sample` whose answers are the keys in context order; `max_new_tokens` leaves a quarter more than
        the gold answer's tokens, plus 16.
    """
    _check_args(n_tokens, depth)
    k = n_keys(n_tokens) if keys is None else keys
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= len(_POOL):
        raise ValueError(f"keys must be an int in [1, {len(_POOL)}], got {keys!r}")
    rng = _rng("list_keys", seed)
    names, values = rng.sample(_POOL, k), rng.sample(range(100, 1000), k)
    needles = [_entry(n, v) for n, v in zip(names, values)]
    depths = [(i + 0.5) / k for i in range(k)]
    context, n, measured = _assemble(tokenizer, n_tokens, rng, HEADER, needles, depths)
    for name in names:
        _check_count(context, f"Key {name} ")
    question = ("List every key of the key-value store in the text above, in the order in which they appear, "
                "separated by commas. Answer with the keys only.")
    prefix = f"The {k} keys, in order, are:"
    answer = _count(tokenizer, [" " + ", ".join(names)])[0]
    return Sample("list_keys", context, question, names, prefix, None, n, seed, math.ceil(1.25 * answer) + 16,
                  {"scoring": SCORING, "keys": k, "answer_tokens": answer,
                   "needles": [{"text": t, "depth": d} for t, d in zip(needles, measured)]})


def in_order_score(prediction: str, keys: list[str]) -> float:
    """The fraction of `keys` listed in order: the longest common subsequence of `keys` and the key words of
    `prediction` (case-insensitive, other words ignored), over `len(keys)`. A key repeated or out of place does not
    count twice; an empty prediction scores 0."""
    if not keys:
        raise ValueError("in_order_score needs at least one key")
    gold = [k.lower() for k in keys]
    known = set(gold)
    said = [w for w in re.findall(r"[a-z]+", prediction.lower()) if w in known]
    best = [0] * (len(gold) + 1)  # LCS, one row at a time
    for w in said:
        prev = 0
        for j, g in enumerate(gold, 1):
            prev, best[j] = best[j], (prev + 1 if w == g else max(best[j], best[j - 1]))
    return best[-1] / len(gold)
