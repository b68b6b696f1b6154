"""The kernel's settings shared by every rule of a run: the observation window, the query block, the measure
phase's form and the signal set it measures (`MeasureSpec`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .signals import TOKEN_SIGNALS

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
# `flex_measure`: no n x C scores, meant for GPUs), or "auto": `AUTO_FORM` of the device type, else "blocks" (the
# CPU's fastest exact form). The flex form runs only where its signals were checked against the block form's
# (`FLEX_VERIFIED`: the CPU in tests/test_flex_measure.py, CUDA on an H200 in benchmarks/results/gpu_lease.md; ROCm's
# torch device is "cuda" too, lowered for gfx942 in the codegen leg, never run), or anywhere with
# FXBUDGET_UNVERIFIED_FLEX=1 (to try it on another device). docs/gpu.md.
MEASURE_FORMS = ("auto", "blocks", "flex")
DEFAULT_MEASURE = "auto"
AUTO_FORM = {"cuda": "flex"}


def check_measure(form) -> None:
    form = form.form if isinstance(form, MeasureSpec) else form
    if form not in MEASURE_FORMS:
        raise ValueError(f"measure must be one of {MEASURE_FORMS} (the kernel's measure phase), got {form!r}")


# Device types where the flex form's signals were checked against the block form's.
FLEX_VERIFIED = ("cpu", "cuda")
UNVERIFIED_FLEX_ENV = "FXBUDGET_UNVERIFIED_FLEX"
# The dtypes flex_attention's GPU kernels compile: float64 fails in Triton (sm_90 codegen, torch 2.14.1), so there
# "auto" takes the block form and "flex" raises. The CPU's path takes any dtype.
FLEX_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def measure_form(form: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The form a call runs: `form`, with "auto" resolved by the device type (`AUTO_FORM`) and the call's dtype.

    Raises:
        RuntimeError: "flex" on a device where its signals were not verified (unless FXBUDGET_UNVERIFIED_FLEX=1).
        ValueError: "flex" off the CPU in a dtype flex's GPU kernels do not compile (`FLEX_GPU_DTYPES`).
    """
    form = form.form if isinstance(form, MeasureSpec) else form
    check_measure(form)
    kind = torch.device(device).type
    compiles = kind == "cpu" or dtype is None or dtype in FLEX_GPU_DTYPES
    if form == "auto":
        return AUTO_FORM.get(kind, "blocks") if compiles else "blocks"
    if form == "flex" and not compiles:
        raise ValueError(f"fxbudget: measure='flex' on {kind} takes {', '.join(map(str, FLEX_GPU_DTYPES))} "
                         f"(flex_attention's GPU kernels), got {dtype}; use measure='blocks' or 'auto'")
    if form == "flex" and kind not in FLEX_VERIFIED and os.environ.get(UNVERIFIED_FLEX_ENV) != "1":
        raise RuntimeError(f"fxbudget: measure='flex' is not verified on {kind} (docs/gpu.md); use "
                           f"measure='blocks', or set {UNVERIFIED_FLEX_ENV}=1 to run it anyway")
    return form


# The signals the kernel measures: the run's signal set is a subset of these: the attention signals, then the
# per-token ones (`signals.TOKEN_SIGNALS`: a signal added there is measured, and skippable, like these). Every other
# name a rule reads on `Signals` is one of the call's inputs (positions, queries, keys, values, RoPE frequencies,
# budget, window) or derived from them, there in every kernel.
ATTENTION_SIGNALS = ("attn", "window_attn", "last_attn", "acc_attn", "window_max_attn")
MEASURED_SIGNALS = ATTENTION_SIGNALS + tuple(TOKEN_SIGNALS)
ALL_SIGNALS = "all"  # every measured signal: for pooling a run's rows with other runs'


@dataclass(frozen=True)
class MeasureSpec:
    """What the measure phase runs, a kernel setting shared by every rule of a run: its `form` (`MEASURE_FORMS`) and
    the `signals` it measures (a subset of `MEASURED_SIGNALS`; `kernel.signal_set` derives a run's from its rules).
    A signal outside the set is absent from the rule's `Signals` (reading it raises), not zero; the flex form skips
    its transposed call when neither `attn` nor `acc_attn` is in it. A plain form string measures every signal."""

    form: str = DEFAULT_MEASURE
    signals: frozenset = frozenset(MEASURED_SIGNALS)

    def __post_init__(self):
        check_measure(self.form)
        unknown = set(self.signals) - set(MEASURED_SIGNALS)
        if unknown:
            raise ValueError(f"signals: {', '.join(sorted(unknown))} not measured by the kernel; the measured signals "
                             f"are {', '.join(MEASURED_SIGNALS)} (or {ALL_SIGNALS!r})")
        object.__setattr__(self, "signals", frozenset(self.signals))

    @property
    def label(self) -> str:
        """The set as rows, fingerprints and `fxbudget inspect` name it (`signals_label`)."""
        return signals_label(self.signals)


def signals_label(signals) -> str:
    """"all" for every measured signal, else the names in `MEASURED_SIGNALS` order joined by commas ("none" if
    empty)."""
    signals = set(signals)
    if signals >= set(MEASURED_SIGNALS):
        return ALL_SIGNALS
    return ",".join(n for n in MEASURED_SIGNALS if n in signals) or "none"


def measure_spec(measure) -> MeasureSpec:
    """`measure` (a form string, or a `MeasureSpec`) as a `MeasureSpec`; a string measures every signal."""
    return measure if isinstance(measure, MeasureSpec) else MeasureSpec(form=measure)
