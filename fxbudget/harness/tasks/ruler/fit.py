"""What every RULER task shares: its per-sample generator, the length fitter, and the split of RULER's prompt into the
`Sample` the runner prefills (context, then question and answer prefix, as kvpress splits it).

RULER's ``max_seq_length`` counts the whole prompt (template, context, question and answer prefix, no chat template)
plus the tokens the task lets the model generate. Its scripts binary-search the haystack size (noise sentences, essay
words, documents, list words) for the largest prompt that fits; :func:`fit` does the same with the given tokenizer.
"""

from __future__ import annotations

import random
from typing import Callable

from ..sample import Sample, _count
from .templates import FAMILIES, Family


def rng_for(task: str, seed: int, *salt) -> random.Random:
    """A generator fixed by (task, seed, salt): every haystack size tried for one sample draws the same needles."""
    return random.Random(":".join(map(str, ("ruler", task, seed, *salt))))


def count(tokenizer, text: str) -> int:
    return _count(tokenizer, [text])[0]


def fit(build: Callable[[int], str], tokenizer, n_tokens: int, reserve: int, lowest: int, task: str):
    """The largest haystack size ``k >= lowest`` whose prompt ``build(k)`` takes at most ``n_tokens - reserve``
    tokens (RULER's binary search; `reserve` is the task's ``tokens_to_generate``).

    Returns:
        ``(k, prompt, prompt_tokens)``.
    Raises:
        ValueError: even the smallest haystack (RULER's ``incremental``) does not fit: the message says the least
            length that works with this tokenizer.
    """
    def size(k):
        text = build(k)
        return text, count(tokenizer, text) + reserve

    text, total = size(lowest)
    if total > n_tokens:
        raise ValueError(f"too short for {task}: RULER's smallest haystack with its prompt and the {reserve} tokens "
                         f"it generates takes {total} tokens with this tokenizer; give at least {total}")
    best = (lowest, text, total)
    hi = lowest * 2
    while True:  # grow until over the budget, then bisect between the last fit and the first overshoot
        text, total = size(hi)
        if total > n_tokens:
            break
        best, hi = (hi, text, total), hi * 2
    lo = best[0] + 1
    hi -= 1
    while lo <= hi:
        mid = (lo + hi) // 2
        text, total = size(mid)
        if total <= n_tokens:
            best, lo = (mid, text, total), mid + 1
        else:
            hi = mid - 1
    k, text, total = best
    return k, text, total - reserve


def to_sample(task: str, family_name: str, prompt: str, prefix: str, answers: list[str], tokenizer, n_tokens: int,
              seed: int, meta: dict, needle: str | None = None) -> Sample:
    """A `Sample` from RULER's whole prompt (`prompt` ends with the answer `prefix`), split as kvpress splits it:
    the context ends where the question marker's last match starts; the question runs from there up to the answer
    prefix (and keeps the prefix's leading space, as kvpress's split does); the answer prefix follows the chat
    template's assistant header. ``context + question + answer_prefix`` is RULER's prompt, character for character.

    `needle`: the text whose token offset in the context is the sample's ``depth`` (None: no depth).
    """
    family: Family = FAMILIES[family_name]
    if not prompt.endswith(prefix):
        raise RuntimeError(f"{task}: the prompt does not end with its answer prefix")  # a bug, not bad input
    body = prompt[:len(prompt) - len(prefix)]
    starts = [m.start() for m in family.question_marker.finditer(body)]
    if not starts:
        raise RuntimeError(f"{task}: no question marker in the prompt")
    cut = starts[-1]
    lead = len(prefix) - len(prefix.lstrip(" "))
    context, question, answer_prefix = body[:cut], body[cut:] + prefix[:lead], prefix[lead:]
    n_context = count(tokenizer, context)
    depth = None
    if needle is not None:
        at = context.find(needle)
        depth = count(tokenizer, context[:at]) / max(n_context, 1) if at >= 0 else None
    meta = {"ruler_task": task.split(":", 1)[1], "family": family_name, "metric": family.metric,
            "max_seq_length": n_tokens, **meta}
    return Sample(task, context, question, list(answers), answer_prefix, depth, n_context, seed,
                  family.tokens_to_generate, meta, separator="", plain_suffix="")
