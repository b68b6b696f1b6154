"""Whether this CPU computes bf16 natively, and what bf16 costs on one that does not (`--dtype auto` and the warning
of `--dtype bfloat16` on the CPU).

Native bf16 on a CPU means instructions that multiply bf16 and accumulate in fp32: x86's AVX512_BF16 or AMX-BF16
(`/proc/cpuinfo` flags `avx512_bf16`, `amx_bf16`), Arm's BF16 extension (`bf16` in its `Features`). Without them
PyTorch's CPU kernels convert bf16 to fp32 and back around fp32 arithmetic, so bf16 halves the memory but runs slower
than fp32. `torch.backends.cpu.get_cpu_capability()` ("AVX2", "AVX512", ...) does not say it: AVX512 CPUs without
AVX512_BF16 exist. Where `/proc/cpuinfo` cannot be read (not Linux), native bf16 is taken as absent and said so.
"""

from __future__ import annotations

import time
from pathlib import Path

NATIVE_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from `/proc/cpuinfo` (x86 `flags`, Arm `Features`), or None where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def native_bf16(flags: set[str] | None = None) -> tuple[bool, str]:
    """`(native, why)`: whether the CPU has native bf16 arithmetic, and the words saying how that was decided.

    Args:
        flags: the CPU flags (default: `cpu_flags()`); None when unknown.
    """
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return False, "native bf16 unknown (no /proc/cpuinfo), taken as absent"
    found = [f for f in NATIVE_FLAGS if f in flags]
    if found:
        return True, f"the CPU has native bf16 ({', '.join(found)})"
    return False, "the CPU has no native bf16 (no avx512_bf16, amx_bf16 or bf16 flag)"


def matmul_slowdown(m: int = 256, k: int = 896, n: int = 896, repeats: int = 5) -> float:
    """How many times longer a bf16 matmul takes than the fp32 one here, now: the best of `repeats` runs of an
    `m x k @ k x n` product in each dtype (the default shape is a 256-token slice of the embedded model's q/o
    projections; ~0.1 s in all on an AVX2 core). A measurement, not a constant: it varies with the machine's load."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)

    def best(x, y) -> float:
        torch.mm(x, y)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(a.bfloat16(), b.bfloat16()) / best(a, b)
