"""The kernel's settings shared by every rule of a run: the observation window and the query block."""

from __future__ import annotations

import torch

DEFAULT_WINDOW = 32  # observation window shared by all rules of a run (snapkv's paper default)
# Queries per block of `measure`: a kernel setting shared by every rule (None = `auto_block`). A call's attention
# temporaries are O(block x candidates) whatever its length.
DEFAULT_BLOCK = None


def auto_block(rows: int, n: int, device: torch.device) -> int:
    """The default query block of a call of `n` tokens with `rows` query rows per token (batch x query heads): the
    largest power of two in [16, 1024] whose [queries x new tokens] fp32 buffer stays within 8 MB on CPU (a block's
    five passes then run in cache: on the embedded model, 8K tokens took 1.6x SDPA's time with blocks of 16 and
    1.9x with 128) and 1 GB on an accelerator (fewer, larger launches). It depends on the call's length and shapes
    only, never on the rule or the number of slots (a shared prefill is branched bit-exactly).
    """
    floats = 2**21 if torch.device(device).type == "cpu" else 2**28
    fit = max(1, floats // max(1, rows * n))
    return 1 << max(4, min(10, fit.bit_length() - 1))


def check_block(block) -> None:
    """`block` is None (`auto_block`) or an int >= 2 (a block of one query is one loop step per token: never
    useful)."""
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 2):
        raise ValueError(f"block must be None (automatic) or an int >= 2 (queries per block of the measure phase), "
                         f"got {block!r}")
