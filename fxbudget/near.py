"""The nearest known name to a mistyped one, for "did you mean ...?" (rules, tasks, options, signals). Torch-free."""

from __future__ import annotations

import difflib


def nearest(name: str, known, cutoff: float = 0.6) -> str | None:
    """The known name closest to `name` without regard to case (as spelled in `known`), or None when none is near."""
    folded = {str(k).casefold(): k for k in known}
    near = difflib.get_close_matches(str(name).casefold(), list(folded), n=1, cutoff=cutoff)
    return folded[near[0]] if near else None
