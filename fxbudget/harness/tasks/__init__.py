"""Synthetic long-context tasks for the comparison harness: offline, seeded and deterministic.

The families follow RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv:2404.06654): needle-in-a-haystack retrieval (single, multi-key, multi-value, multi-query), multi-hop
variable tracking and common-words extraction, plus the classic passkey (Mohtashami & Jaggi 2023), a long-answer
task, `list_keys` (every key of a store, in order: a few hundred output tokens), and shared-context tasks whose
samples ask several questions of one context (`shared_niah`, `shared_passkey`: SCBench's setting, for the
`multi-request` and `multi-turn` protocols). Every generator is
``fn(tokenizer, n_tokens, *, depth=0.5, seed=0) -> Sample``; its context is ``n_tokens`` tokens of that tokenizer
(within 2%), and the same arguments give the same sample on every machine (per-sample seeded :mod:`random`, nothing
downloaded). :func:`load_jsonl` reads user tasks, :func:`score` is RULER's ``string_match_all``, and :func:`chat_ids`
turns a sample into the token ids the runner prefills. One module per task family (`passkey`, `niah`,
`variable_tracking`, `common_words`, `list_keys`, `shared`, user files in `jsonl`), as there is one per rule.

The haystack is built from sentences drawn independently from word lists, so no span of text is a copy of another (a
repeated essay makes retrieval too easy and blurs where the needle is). It holds no digits, no capitals but "The" and
none of the key words, so an answer cannot appear in it by accident.
"""


from __future__ import annotations

from typing import Callable

from .common_words import common_words
from .haystack import haystack_sentence
from .jsonl import FIELDS as TASK_FILE_FIELDS, load_jsonl
from .list_keys import list_keys
from .niah import niah_multikey, niah_multiquery, niah_multivalue, niah_single
from .passkey import passkey
from .prompt import answer_ids, answer_text, chat_ids, followup_ids, score
from .ruler import RULER_TASKS, SUITE as RULER_SUITE, check_task as _check_ruler_task, expand_tasks
from .sample import Sample
from .shared import SHARED_TASKS, requests, shared_niah, shared_passkey
from .variable_tracking import variable_tracking

TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey, "niah_single": niah_single, "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue, "niah_multiquery": niah_multiquery, "variable_tracking": variable_tracking,
    "common_words": common_words, "list_keys": list_keys, "shared_niah": shared_niah, "shared_passkey": shared_passkey,
}
# list_keys spreads its entries over the whole context: `depth` does not place them.
# The shared-context tasks (`shared.py`) place their needles evenly and ask them one per request: `depth` neither.
NEEDLE_TASKS: frozenset[str] = frozenset(TASKS) - {"common_words", "list_keys"} - set(SHARED_TASKS)
# RULER's 13 tasks, generated and scored as RULER does (`ruler/`): `ruler:<task>`; the suite name `ruler` expands to
# all 13 through `expand_tasks`. Not in NEEDLE_TASKS: RULER draws its needles' positions, `depth` does not set them.
TASKS.update(RULER_TASKS)


def make_samples(task: str, tokenizer, n_tokens: int, n: int, *, seed: int = 0) -> list[Sample]:
    """`n` samples of `task`; needle depths spread evenly, ``(i + 0.5) / n``, and sample `i` seeded ``seed*1000+i``.

    Raises:
        ValueError: unknown task (the message lists :data:`TASKS`) or `n` not a positive int.
    """
    _check_ruler_task(task)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    depth = (lambda i: (i + 0.5) / n) if task in NEEDLE_TASKS else (lambda i: 0.5)
    return [TASKS[task](tokenizer, n_tokens, depth=depth(i), seed=seed * 1000 + i) for i in range(n)]


__all__ = ["NEEDLE_TASKS", "RULER_SUITE", "RULER_TASKS", "SHARED_TASKS", "TASKS", "TASK_FILE_FIELDS", "Sample", "answer_ids",
           "answer_text", "chat_ids", "common_words", "followup_ids", "expand_tasks", "haystack_sentence", "list_keys", "load_jsonl",
           "make_samples", "niah_multikey", "niah_multiquery", "niah_multivalue", "niah_single", "passkey", "requests",
           "score", "shared_niah", "shared_passkey", "variable_tracking"]
