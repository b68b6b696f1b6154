"""RULER's 13 tasks as RULER generates and scores them (Hsieh et al. 2024, arXiv:2404.06654; NVIDIA/RULER), split
into context and question as kvpress splits them for query-agnostic runs.

Task names are ``ruler:<name>`` with RULER's names (``scripts/synthetic.yaml``); the suite ``ruler`` is all 13.
Each generator is ``fn(tokenizer, n_tokens, *, depth=0.5, seed=0, data_dir=None) -> Sample`` like FlexBudget's own
tasks: `n_tokens` is RULER's ``max_seq_length`` (the whole prompt without a chat template, plus the tokens the task
generates), the haystack grown to the largest that fits (RULER's binary search); `depth` is ignored (RULER draws the
positions). Six tasks are generated offline from the seed (:data:`OFFLINE_TASKS`: the three needle tasks with a
noise or needle haystack, vt, cwe, fwe); the five essay-haystack needle tasks and qa_1 / qa_2 read the user's copy
of RULER's files (:mod:`.data`), refused in one line when missing. Scoring: ``string_match_all`` (niah, vt, cwe,
fwe) or ``string_match_part`` (qa), per :mod:`.scoring`, after RULER's post-processing.

One module per RULER script: :mod:`.niah`, :mod:`.variable_tracking`, :mod:`.common_words`, :mod:`.freq_words`,
:mod:`.qa`; RULER's strings in :mod:`.templates`.
"""

from __future__ import annotations

from typing import Callable

from . import common_words, freq_words, niah, qa, variable_tracking
from .data import ENV as DATA_ENV
from .scoring import postprocess, ruler_score, string_match_all, string_match_part
from .templates import CONFIGS, FAMILIES, needs_files

PREFIX = "ruler:"
SUITE = "ruler"
_MODULES = {"niah": niah, "variable_tracking": variable_tracking, "common_words_extraction": common_words,
            "freq_words_extraction": freq_words, "qa": qa}

RULER_TASKS: dict[str, Callable] = {PREFIX + name: _MODULES[cfg.family].generator(name)
                                    for name, cfg in CONFIGS.items()}
# The tasks that need none of the user's files.
OFFLINE_TASKS: tuple[str, ...] = tuple(PREFIX + name for name in CONFIGS if not needs_files(name))


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown RULER task {name!r}; RULER's tasks: {', '.join(CONFIGS)} (as ruler:<task>, or "
                      f"{SUITE!r} for all 13)")


def expand_tasks(names) -> list[str]:
    """Task names with the suite ``ruler`` replaced by RULER's 13 tasks (in RULER's order), duplicates dropped.

    Raises:
        ValueError: a ``ruler:`` name that is not one of RULER's tasks (the message lists them).
    """
    out: list[str] = []
    for name in names:
        for n in (list(RULER_TASKS) if name == SUITE else [name]):
            if n.startswith(PREFIX) and n not in RULER_TASKS:
                raise _unknown(n)
            if n not in out:
                out.append(n)
    return out


def check_task(name: str) -> None:
    """Raise the one-line ValueError of an unknown ``ruler:`` task (nothing for other names)."""
    if name.startswith(PREFIX) and name not in RULER_TASKS:
        raise _unknown(name)


def question_start(prompt: str, family: str) -> int:
    """Where the question starts in a RULER prompt of `family` (kvpress's marker, its last match), -1 if absent:
    what a query-agnostic run that receives RULER's whole prompt (e.g. lm-eval's ``ruler`` tasks) cuts on."""
    starts = [m.start() for m in FAMILIES[family].question_marker.finditer(prompt)]
    return starts[-1] if starts else -1


def find_question(prompt: str) -> int:
    """Where the question of a RULER prompt of any family starts, -1 if no family's marker is in it: the last match of
    the family whose last match comes latest. For a caller that does not know the family (lm-eval's ``ruler`` tasks
    hand over the whole prompt; ``python -m fxbudget.lmeval --tasks ruler`` could cut here without a hand-written
    ``question_marker``)."""
    return max(question_start(prompt, family) for family in FAMILIES)


__all__ = ["CONFIGS", "DATA_ENV", "FAMILIES", "OFFLINE_TASKS", "PREFIX", "RULER_TASKS", "SUITE", "check_task",
           "expand_tasks", "find_question", "needs_files", "postprocess", "question_start", "ruler_score",
           "string_match_all", "string_match_part"]
