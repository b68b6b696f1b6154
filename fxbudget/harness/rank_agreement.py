"""Whether two experiments rank the same rules alike: Kendall's tau-b of their rankings by mean, with a bootstrap
interval (the findings page compares the two embedded models so)."""

from __future__ import annotations

import math

import numpy as np

from .stats import LEVEL, SEED


def kendall_tau(x, y) -> float:
    """Kendall's tau-b of two rankings of the same items (`x[i]`, `y[i]`: item i's scores; ties allowed):
    `(concordant - discordant) / sqrt((n0 - ties in x) * (n0 - ties in y))` over the n0 = n(n-1)/2 pairs; a pair tied
    in x or y is neither. NaN when either has every item tied.

    Raises:
        ValueError: arrays of different lengths or fewer than two items.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"kendall_tau needs two 1-D arrays of the same length >= 2, got {x.shape} and {y.shape}")
    i, j = np.triu_indices(len(x), 1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    n0 = len(i)
    denom = math.sqrt(float(n0 - np.sum(dx == 0)) * float(n0 - np.sum(dy == 0)))
    return float(np.sum(dx * dy)) / denom if denom > 0 else math.nan


def kendall_tau_interval(a: dict, b: dict, level: float = LEVEL, n_boot: int = 2000,
                         seed: int = SEED) -> tuple[float, float, float]:
    """Kendall's tau-b between the rankings by mean of the same rules in two experiments (`a`, `b`: rule ->
    per-sample values, each experiment's arrays aligned on its own samples), and its percentile bootstrap interval:
    each experiment's samples resampled (together across its rules, apart from the other experiment's).

    Returns:
        `(tau, lower, upper)`; draws whose ranking is all ties (tau NaN) are left out of the interval.
    """
    rules = sorted(set(a) & set(b))
    if len(rules) < 2 or set(a) != set(b):
        raise ValueError(f"kendall_tau_interval needs the same two or more rules in both, got {sorted(a)} and "
                         f"{sorted(b)}")
    A = np.array([np.asarray(a[r], dtype=np.float64) for r in rules])  # rules x samples
    B = np.array([np.asarray(b[r], dtype=np.float64) for r in rules])
    tau = kendall_tau(A.mean(axis=1), B.mean(axis=1))
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_boot):
        ia, ib = rng.integers(0, A.shape[1], A.shape[1]), rng.integers(0, B.shape[1], B.shape[1])
        t = kendall_tau(A[:, ia].mean(axis=1), B[:, ib].mean(axis=1))
        if not math.isnan(t):
            draws.append(t)
    if not draws:
        return tau, math.nan, math.nan
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return tau, float(lo), float(hi)
