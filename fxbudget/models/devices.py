"""Where and in what precision a model runs: `--device` and `--dtype`, checked before any model is loaded.

    device: "cpu", "cuda" or "cuda:N"; default "cuda" when a GPU is visible, else "cpu".
    dtype: "float32", "bfloat16" or "float16"; default bfloat16 on a GPU, float32 on the CPU.

Names are checked without importing torch (`check_names`); whether the device is present needs torch
(`resolve`). Both raise `ValueError` with a message saying what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "cuda:N")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class Placement:
    """A resolved device and dtype, as their names ("cuda:0", "bfloat16"): what result rows record."""

    device: str
    dtype: str

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
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: unknown dtype; use one of {', '.join(DTYPES)}")


def resolve(device: str | None = None, dtype: str | None = None) -> Placement:
    """The device and dtype a model is loaded with: the defaults filled in, the device checked to be present.

    Args:
        device: "cpu", "cuda", "cuda:N" or None (cuda when available, else cpu).
        dtype: "float32", "bfloat16", "float16" or None (bfloat16 on a GPU, float32 on the CPU).
    Returns:
        A `Placement`; a bare "cuda" becomes "cuda:0" (the device the parameters then report).
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
    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    return Placement(device, dtype)
