"""Argument checks shared by the public entry points, the cache, the rules and the harness."""

from __future__ import annotations

import difflib


def check_int(name: str, value, low: int = 1) -> None:
    """Refuse anything but an int >= `low` (a bool is not an int here) with a `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def nearest(name: str, known, cutoff: float = 0.6) -> str | None:
    """The known name closest to `name` without regard to case (as spelled in `known`), or None when none is near."""
    folded = {str(k).casefold(): k for k in known}
    near = difflib.get_close_matches(str(name).casefold(), list(folded), n=1, cutoff=cutoff)
    return folded[near[0]] if near else None
