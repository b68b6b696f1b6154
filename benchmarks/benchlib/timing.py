"""Interleaved timing and its statistics: medians, quartiles, paired ratios and their verdicts."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable, Sequence


def sync(device: str = "cpu") -> None:
    """Wait for the device (CUDA) so wall-clock timings are honest; no-op on CPU."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str = "cpu") -> float:
    """Seconds one call of `fn` takes (device synchronized before and after)."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def interleaved(fns: dict[str, Callable[[], object]], reps: int, *, warmup: int = 3, device: str = "cpu",
                inner: int = 1) -> dict[str, list[float]]:
    """Time every callable `reps` times, round-robin (a, b, c, a, b, c, ...), so all see the same machine state.

    `warmup` rounds are run first and dropped. With `inner > 1` each sample is the mean of `inner` back-to-back
    calls (for calls too short to time alone). The starting callable rotates every round, so none always runs first.
    Returns seconds per call for each name.
    """
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(warmup + reps):
        rot = names[r % len(names):] + names[:r % len(names)]
        for k in rot:
            f = fns[k]
            sync(device)
            t = time.perf_counter()
            for _ in range(inner):
                f()
            sync(device)
            dt = (time.perf_counter() - t) / inner
            if r >= warmup:
                out[k].append(dt)
    return out


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def median_us(xs: Iterable[float]) -> float:
    """Median of seconds, in microseconds."""
    return 1e6 * statistics.median(list(xs))


def quartiles(xs: Iterable[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of `xs` (the interquartile range is the first to the last)."""
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Quartiles of the per-round ratios a[i] / b[i] of two interleaved series (`interleaved` keeps rounds aligned):
    the ratio's own spread, machine drift between rounds cancelling out."""
    return quartiles([x / y for x, y in zip(a, b)])


def verdict(ratio: tuple[float, float, float], goal: float) -> str:
    """'within noise' when 1.0 lies inside the ratio's interquartile range; else whether the median meets `goal`
    (a ratio that should stay <= goal)."""
    lo, mid, hi = ratio
    if lo <= 1.0 <= hi:
        return "within noise"
    return "met" if mid <= goal else "NOT met"


def fmt_ratio(ratio: tuple[float, float, float]) -> str:
    """'1.023 [0.998-1.051]': median and interquartile range."""
    return f"{ratio[1]:.3f} [{ratio[0]:.3f}-{ratio[2]:.3f}]"
