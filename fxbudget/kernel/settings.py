"""The kernel's settings shared by every rule of a run: the observation window, the query block and the measure
phase's form."""

from __future__ import annotations

import os

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


# The measure phase's form (`measure.measure`), a kernel setting shared by every rule of a run: "blocks" (query blocks
# against every candidate, `attention.Block`), "flex" (two fused `flex_attention` calls and a window block,
# `flex_measure`: no n x C scores, meant for GPUs), or "auto", which is "blocks" on every device today. The flex form is
# exact on a CPU (tests/test_flex_measure.py), but on an H200 (torch 2.11, compiled flex) its `attn` came out wrong
# while its output was right (benchmarks/results/gpu_lease.md): it runs only where it was verified
# (`FLEX_VERIFIED`), or anywhere with FXBUDGET_UNVERIFIED_FLEX=1 (to debug it on a GPU). docs/gpu.md.
MEASURE_FORMS = ("auto", "blocks", "flex")
DEFAULT_MEASURE = "auto"


def check_measure(form) -> None:
    if form not in MEASURE_FORMS:
        raise ValueError(f"measure must be one of {MEASURE_FORMS} (the kernel's measure phase), got {form!r}")


# Device types where the flex form's signals were checked against the block form's.
FLEX_VERIFIED = ("cpu",)
UNVERIFIED_FLEX_ENV = "FXBUDGET_UNVERIFIED_FLEX"


def measure_form(form: str, device: torch.device) -> str:
    """The form a call runs: `form`, with "auto" resolved ("blocks").

    Raises:
        RuntimeError: "flex" on a device where its signals were not verified (unless FXBUDGET_UNVERIFIED_FLEX=1).
    """
    check_measure(form)
    if form == "auto":
        return "blocks"
    kind = torch.device(device).type
    if form == "flex" and kind not in FLEX_VERIFIED and os.environ.get(UNVERIFIED_FLEX_ENV) != "1":
        raise RuntimeError(f"fxbudget: measure='flex' is not verified on {kind}: on an H200 (torch 2.11) its attn "
                           f"signal came out wrong (docs/gpu.md); use measure='blocks' (the default), or set "
                           f"{UNVERIFIED_FLEX_ENV}=1 to run it anyway")
    return form
