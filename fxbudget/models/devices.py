"""Where and in what precision a model runs: `--device` and `--dtype`, checked before any model is loaded.

    device: "cpu", "cuda" or "cuda:N"; default "cuda" when a GPU is visible, else "cpu".
    dtype: "float32", "bfloat16", "float16" or "auto"; default bfloat16 on a GPU, float32 on the CPU. "auto": bfloat16
        on a GPU and on a CPU with native bf16 (`cpu_bf16.native_bf16`: AVX512_BF16, AMX-BF16, Arm BF16), float32 on
        any other CPU. The CPU default stays float32 even where bf16 is native: fxbudget's committed results and its
        exactness checks are fp32, the bf16-vs-fp32 accuracy of the comparison grid is not measured yet
        (benchmarks/bf16_vs_fp32.py, unrun), and a default that followed the CPU's flags would make one command
        give different rows on two machines. On a CPU with native bf16 the start line points at `--dtype auto`.

Names are checked without importing torch (`check_names`); whether the device is present needs torch
(`resolve`). Both raise `ValueError` with a message saying what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
CHOICES = DTYPES + ("auto",)  # what --dtype takes: "auto" resolves to one of DTYPES
DEVICES = ("cpu", "cuda", "cuda:N")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class Placement:
    """A resolved device and dtype, as their names ("cuda:0", "bfloat16"): what result rows record."""

    device: str
    dtype: str
    # Why this dtype (the run's start line says it) and, for bf16 on a CPU without native bf16, a warning with its
    # measured cost; neither is part of the placement's identity.
    why: str = field(default="", compare=False)
    warning: str = field(default="", compare=False)

    def torch_dtype(self):
        """The `torch.dtype` of `dtype`."""
        import torch

        return getattr(torch, self.dtype)


def check_names(device: str | None, dtype: str | None) -> None:
    """Refuse a device or dtype name fxbudget does not know (no torch import).

    Args:
        device: None (the default) or a device name.
        dtype: None (the default) or a dtype name.
    Raises:
        ValueError: naming the valid values.
    """
    if device is not None and not _DEVICE.fullmatch(device):
        raise ValueError(f"--device {device}: unknown device; use one of {', '.join(DEVICES)} (N: a GPU index)")
    if dtype is not None and dtype not in CHOICES:
        raise ValueError(f"--dtype {dtype}: unknown dtype; use one of {', '.join(DTYPES)} or auto")


def resolve(device: str | None = None, dtype: str | None = None) -> Placement:
    """The device and dtype a model is loaded with: the defaults filled in, the device checked to be present.

    Args:
        device: "cpu", "cuda", "cuda:N" or None (cuda when available, else cpu).
        dtype: "float32", "bfloat16", "float16", "auto" (bfloat16 on a GPU or a CPU with native bf16, else float32)
            or None (bfloat16 on a GPU, float32 on the CPU).
    Returns:
        A `Placement`; a bare "cuda" becomes "cuda:0" (the device the parameters then report). Its `why` says how
        the dtype was chosen; `warning` is set for bfloat16 on a CPU without native bf16 (with the bf16/fp32 time
        of a small matmul measured here, now: ~0.1 s).
    Raises:
        ValueError: an unknown name, or a GPU that is not there (saying how many there are).
    """
    import torch

    check_names(device, dtype)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if count == 0:
            raise ValueError(f"--device {device}: no CUDA GPU is visible to torch {torch.__version__} here "
                             f"(torch.cuda.is_available() is False); use --device cpu")
        if index >= count:
            raise ValueError(f"--device {device}: only {count} CUDA GPU(s) are visible (cuda:0 to cuda:{count - 1})")
        device = f"cuda:{index}"
    return choose(device, dtype)


def choose(device: str, dtype: str | None) -> Placement:
    """The dtype on a resolved device (see `resolve`), with why it was chosen (no check that the device is here)."""
    if device != "cpu":
        if dtype in (None, "auto"):
            return Placement(device, "bfloat16", f"{'--dtype auto' if dtype else 'the default'} on a GPU")
        return Placement(device, dtype, "as --dtype asked")
    from .cpu_bf16 import matmul_slowdown, native_bf16

    native, how = native_bf16()
    if dtype == "auto":
        return Placement(device, "bfloat16" if native else "float32", f"--dtype auto; {how}")
    if dtype is None:
        hint = "; --dtype auto would run bfloat16" if native else ""
        return Placement(device, "float32", f"the CPU default; {how}{hint}")
    warning = ""
    if dtype == "bfloat16" and not native:
        slow = matmul_slowdown()
        warning = (f"--dtype bfloat16 on a CPU without native bf16: a 256x896x896 matmul took {slow:.1f}x its float32 "
                   "time here just now (bf16 is converted to fp32 around every op); it halves the weights' and cache's "
                   "memory, not the time; --dtype float32 (or auto) runs faster here")
    return Placement(device, dtype, f"as --dtype asked; {how}", warning)
