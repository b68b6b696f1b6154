"""Shared-context tasks (SCBench, Li et al. 2024, arXiv:2412.10319): one long context, several requests over it.

A sample's context holds K needles spread evenly over it; its requests ask for them one by one, in an order rotated
by the seed (a Latin square: K consecutive samples ask every needle position at every turn once, so the turn index is
not the needle's depth). Under the `multi-request` protocol the context is compressed once and each
request starts from that compressed cache; under `multi-turn` the requests come one after another on the same cache,
each earlier question and its answer kept as a chat turn. A rule that kept only what one question needed fails the
next one. The sample's own `question`, `answers`, `answer_prefix` and `depth` are its first request's, so the
single-question protocols run it too (one question about a context with K needles); `meta["requests"]` lists every
request and :func:`requests` turns them into one `Sample` each.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace

from .haystack import _NIAH_HEADER, _WORDS, _assemble
from .niah import _numbers
from .sample import Sample, _check_args, _check_count, _rng

_PASSKEY_HEADER = ("There are several locked doors, each with its own pass key, hidden in the following text. Make "
                   "sure to memorize them. I will ask for them one by one.\n")
# Door names: key words that are not words of the header or the needle (a door named in them would be ambiguous).
_DOORS = tuple(w for w in _WORDS if w not in set(re.findall(r"[a-z]+", (_PASSKEY_HEADER + " pass key of the door is "
                                                                        "remember it").lower())))


def requests(sample: Sample) -> list[Sample]:
    """The sample's requests, one `Sample` each (same context; its own question, answers, answer prefix, depth and
    answer length), in the order they are asked; a single-question sample is its own one request."""
    listed = sample.meta.get("requests")
    if not listed:
        return [sample]
    return [replace(sample, question=r["question"], answers=list(r["answers"]), answer_prefix=r["answer_prefix"],
                    depth=r["depth"], max_new_tokens=r["max_new_tokens"]) for r in listed]


def _shared(task, tokenizer, n_tokens, seed, rng, header, needles, keys, values, ask, prefix) -> Sample:
    """A sample whose `len(needles)` needles sit at depths `(i + 0.5) / K`, asked one per request in the task's order
    rotated by `seed`."""
    k = len(needles)
    context, n, measured = _assemble(tokenizer, n_tokens, rng, header, needles, [(i + 0.5) / k for i in range(k)])
    for v in values:
        _check_count(context, v, needles[0].count(values[0]))
    # A Latin square over samples: one fixed order of the needles per task, rotated by the seed, so that k
    # consecutive seeds (`make_samples`' samples) ask every needle position at every turn once: the turn index is
    # not the needle's depth (a chance order over a few samples would confound them).
    base = random.Random(f"{task}:order").sample(range(k), k)
    order = [base[(j + seed) % k] for j in range(k)]
    listed = [{"question": ask(keys[i]), "answers": [values[i]], "answer_prefix": prefix(keys[i]),
               "depth": measured[i], "max_new_tokens": 16, "key": keys[i]} for i in order]
    first = listed[0]
    return Sample(task, context, first["question"], first["answers"], first["answer_prefix"], first["depth"], n, seed,
                  16, {"requests": listed, "needles": [{"text": t, "key": key, "value": v, "depth": d}
                                                       for t, key, v, d in zip(needles, keys, values, measured)]})


def shared_niah(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """Shared context, several requests (SCBench): 4 "special magic number" needles (RULER's NIAH needles) spread
    evenly over the context, each asked by its own request.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: unused (the needles span the context),
            kept for the tasks' common signature. seed: fixes haystack, keys and numbers; `seed % 4` rotates the
            order they are asked in.

    Returns:
        A :class:`Sample` with 4 requests in `meta["requests"]` (one number each, in the rotated order); its own
        question and answer are the first request's.
    """
    _check_args(n_tokens, depth)
    rng = _rng("shared_niah", seed)
    keys, values = rng.sample(_WORDS, 4), _numbers(rng, 4)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
    return _shared("shared_niah", tokenizer, n_tokens, seed, rng, _NIAH_HEADER, needles, keys, values,
                   lambda key: f"What is the special magic number for {key} mentioned in the provided text? "
                               "Answer with the number only.",
                   lambda key: f"The special magic number for {key} mentioned in the provided text is")


def shared_passkey(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """Shared context, several requests (SCBench): 3 pass keys, one per named door, spread evenly over the context
    (passkey's needle, stated twice); each request asks for one door's key.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: unused (the needles span the context),
            kept for the tasks' common signature. seed: fixes haystack, doors and keys; `seed % 3` rotates the
            order they are asked in.

    Returns:
        A :class:`Sample` with 3 requests in `meta["requests"]` (one 5-digit key each, in the rotated order); its
        own question and answer are the first request's.
    """
    _check_args(n_tokens, depth)
    rng = _rng("shared_passkey", seed)
    doors, keys = rng.sample(_DOORS, 3), [str(x) for x in rng.sample(range(10000, 100000), 3)]
    needles = [f"The pass key of the {d} door is {k}. Remember it. {k} is the pass key of the {d} door."
               for d, k in zip(doors, keys)]
    return _shared("shared_passkey", tokenizer, n_tokens, seed, rng, _PASSKEY_HEADER, needles, doors, keys,
                   lambda door: f"What is the pass key of the {door} door? Answer with the number only.",
                   lambda door: f"The pass key of the {door} door is")


# Shared-context tasks and how many requests each sample makes (known without a tokenizer: the grid counts rows).
SHARED_TASKS: dict[str, int] = {"shared_niah": 4, "shared_passkey": 3}
