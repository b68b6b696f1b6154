"""RULER's metrics on one prediction (``scripts/eval/synthetic/constants.py`` and ``scripts/eval/evaluate.py``).

RULER scores a task as ``round(100 * mean, 2)`` of these per-sample values, after ``postprocess_pred``; the harness
averages the per-sample values (its tables show means in [0, 1]).
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, every control character (``\\x00``-``\\x1f``) made a newline, strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, refs: list[str]) -> float:
    """The fraction of `refs` found in `prediction`, case-insensitively (niah, vt, cwe, fwe)."""
    return sum(r.lower() in prediction.lower() for r in refs) / len(refs)


def string_match_part(prediction: str, refs: list[str]) -> float:
    """1 if any of `refs` is in `prediction`, case-insensitively, else 0 (qa: any of the gold answers)."""
    return float(max(r.lower() in prediction.lower() for r in refs))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def ruler_score(metric: str, prediction: str, refs: list[str]) -> float:
    """`metric` (a name in :data:`METRICS`) of RULER's post-processed `prediction` against `refs`."""
    return METRICS[metric](postprocess(prediction), refs)
