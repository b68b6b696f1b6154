"""Argument checks shared by the public entry points, the cache, the rules and the harness."""

from __future__ import annotations


def check_int(name: str, value, low: int = 1) -> None:
    """Refuse anything but an int >= `low` (a bool is not an int here) with a `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
