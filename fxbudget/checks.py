"""Argument checks shared by the public entry points, the cache, the rules and the harness; no torch import.

Also the sizes in bytes a budget is written in (`"256MiB"`, `"1.5GB"`) and how reports label them, and the slot
storages the bytes may be spent in: the command line and the grid parse them before anything heavy loads. What a
size buys is `cache.byte_budget`'s; how each storage is laid out, `kernel.slot_storage`'s.
"""

from __future__ import annotations

import difflib
import re
from fractions import Fraction


def check_int(name: str, value, low: int = 1) -> None:
    """Refuse anything but an int >= `low` (a bool is not an int here) with a `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def nearest(name: str, known, cutoff: float = 0.6) -> str | None:
    """The known name closest to `name` without regard to case (as spelled in `known`), or None when none is near."""
    folded = {str(k).casefold(): k for k in known}
    near = difflib.get_close_matches(str(name).casefold(), list(folded), n=1, cutoff=cutoff)
    return folded[near[0]] if near else None


# How slots store keys and values: the model's dtype, quantized with a float32 scale per entry and head, or cast
# to bfloat16 (16-bit slots of a float32 model).
SLOT_DTYPES = ("model", "float8_e4m3fn", "int8", "int4", "bfloat16")


def check_slot_dtype(slot_dtype) -> str:
    """`slot_dtype` as a `SLOT_DTYPES` name (None = "model"). Raises `ValueError` listing the known ones."""
    name = "model" if slot_dtype is None else str(slot_dtype).removeprefix("torch.")
    if name not in SLOT_DTYPES:
        raise ValueError(f"slot_dtype must be one of {', '.join(SLOT_DTYPES)} (None = the model's dtype), got "
                         f"{slot_dtype!r}")
    return name


UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]i?B|B)")


def byte_size(spec) -> int | None:
    """The bytes of a size string (`"256MiB"` -> 268435456, `"1.5GB"`; floor), None for anything that is not a
    string ending in `B` (an int budget, a percentage).

    Raises:
        ValueError: a string ending in `B` that is not a size, or a size below one byte.
    """
    if not isinstance(spec, str) or not spec.strip().endswith("B"):
        return None
    m = _SIZE.fullmatch(spec.strip())
    if m is None or m.group(2) not in UNITS:
        raise ValueError(f"a byte budget is a number and a unit ({', '.join(UNITS)}) such as 256MiB or 1.5GB, "
                         f"got {spec!r}")
    total = int(Fraction(m.group(1)) * UNITS[m.group(2)])
    if total < 1:
        raise ValueError(f"a byte budget must be at least 1 B, got {spec!r}")
    return total


def size_label(n: int) -> str:
    """`n` bytes in the largest binary unit that leaves a number >= 1 (`1 MiB`, `1.5 MiB`, `100 B`): how reports
    label a byte budget, so `1MiB` and `1024KiB` are one budget."""
    for unit in ("GiB", "MiB", "KiB"):
        if n >= UNITS[unit]:
            return f"{n / UNITS[unit]:.4g} {unit}"
    return f"{n} B"
