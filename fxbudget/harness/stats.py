"""Small statistics for comparison reports: intervals of a mean and paired rule-vs-rule tests (numpy only).

- A cell's 95% interval: **Clopper-Pearson** (exact binomial) when every score of the cell is 0 or 1 (single-answer
  tasks), else a **percentile bootstrap** over samples (multi-answer tasks score fractions; the likelihood metric is
  continuous). Clopper-Pearson is used where it applies because a bootstrap collapses to a point when all scores are
  equal (0/6 would read [0.00, 0.00]) and undercovers at a handful of samples; the exact interval keeps its 95%.
  A mean of paired differences of a continuous metric (a rule's likelihood minus the reference's) gets the interval
  of the paired test below instead (`mean_interval(..., paired=True)`).
- Paired differences: every rule runs on the same samples, so rule A is compared with rule B on the per-sample
  differences `d = a - b`. The p-value is a two-sided **sign-flip permutation test** of `mean(d) = 0` (exact
  enumeration of the sign patterns of the non-zero differences up to `EXACT_MAX` of them, else a seeded Monte Carlo
  with the +1 correction). The interval of `mean(d)` agrees with that test: the shifts the test does not reject,
  or, for 0/1 scores, Clopper-Pearson intervals of the two discordant proportions (Bonferroni-combined); both
  unbounded at five samples or fewer, where the test rejects nothing.
- Ranking: the top rule (highest mean; ties by name) is compared with every other one, p-values Holm-adjusted over
  those comparisons; the rules not separated from it at `alpha` form tier 1, and the procedure repeats on the rest.
- What a sample size can show at all: with n paired samples the sign-flip test's smallest p is 2/2^n (every
  difference non-zero and of one sign), Holm multiplies it by the number of comparisons; `smallest_p` and
  `samples_to_separate` say whether a pair can be separated and from how many samples on, `no_interval_reason` why
  an interval is unbounded (a report prints that sentence, never `[-inf, inf]`).

Every random draw uses a fixed seed, so a report is reproducible bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
ALPHA = 0.05
N_BOOT = 10_000
N_PERM = 20_000
EXACT_MAX = 16  # non-zero paired differences up to which the permutation test enumerates all 2^n sign patterns
SEED = 0


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (exact to double precision for any n used here)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _solve(f, target: float) -> float:
    """The p in [0, 1] where the monotone decreasing `f(p)` crosses `target` (bisection to 1e-12)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion.

    Args:
        k: successes, 0 <= k <= n. n: trials, >= 1. level: coverage, e.g. 0.95.
    Returns:
        `(lower, upper)`: the p whose one-sided tail probabilities of observing k are (1 - level) / 2.
    """
    if not (isinstance(n, int) and n >= 1 and isinstance(k, int) and 0 <= k <= n):
        raise ValueError(f"need integers 0 <= k <= n, n >= 1; got k={k!r}, n={n!r}")
    tail = (1 - level) / 2
    # P(X >= k; p) grows with p; P(X <= k; p) falls with p.
    lower = 0.0 if k == 0 else _solve(lambda p: _binom_cdf(k - 1, n, p), 1 - tail)
    upper = 1.0 if k == n else _solve(lambda p: _binom_cdf(k, n, p), tail)
    return lower, upper


def bootstrap_means(x: np.ndarray, n_boot: int = N_BOOT, seed: int = SEED) -> np.ndarray:
    """Means of `n_boot` resamples (with replacement, same size) of the 1-D array `x`."""
    rng = np.random.default_rng(seed)
    return x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)


def bootstrap_ci(x, level: float = LEVEL, n_boot: int = N_BOOT, seed: int = SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `x` (a point when every value is equal)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    means = bootstrap_means(x, n_boot, seed)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def smallest_p(n: int, comparisons: int = 1) -> float:
    """The smallest Holm-adjusted p the two-sided sign-flip test can reach with `n` paired samples and
    `comparisons` comparisons in the family: `comparisons x 2 / 2^n` (at most 1)."""
    return min(1.0, comparisons * 2.0 ** (1 - n)) if n >= 1 else 1.0


def samples_to_separate(comparisons: int = 1, alpha: float = ALPHA) -> int:
    """The fewest paired samples at which the sign-flip test, Holm-adjusted over `comparisons`, can reject at
    `alpha` (every sample won by the same rule): 6 for one comparison at 0.05, 7 for two or three."""
    n = 1
    while smallest_p(n, comparisons) >= alpha:
        n += 1
    return n


def no_interval_reason(n: int) -> str:
    """Why a sign-flip interval of `n` paired values is unbounded, in the words a report prints instead of it."""
    return f"n={n}: too few samples for an interval"


@dataclass(frozen=True)
class Interval:
    """A mean with its interval; `method` is "clopper-pearson", "bootstrap" or "sign-flip inversion" (the last is
    unbounded, `bounded` False, at five paired samples or fewer)."""

    mean: float
    lo: float
    hi: float
    n: int
    method: str

    @property
    def bounded(self) -> bool:
        """Both ends finite (a report prints `no_interval_reason(n)` otherwise)."""
        return math.isfinite(self.lo) and math.isfinite(self.hi)


def mean_interval(scores, level: float = LEVEL, *, paired: bool = False) -> Interval:
    """The mean of `scores` and its interval: Clopper-Pearson if every score is 0 or 1, else percentile bootstrap;
    for paired differences of a continuous metric (`paired=True`) the inverted sign-flip test instead.

    Args:
        scores: per-sample values (accuracy scores in [0, 1], or any continuous metric).
        paired: `scores` are per-sample differences between two configurations (e.g. a rule minus the reference).
    """
    x = np.asarray(scores, dtype=np.float64)
    if len(x) == 0:
        raise ValueError("mean_interval needs at least one score")
    if paired:
        lo, hi = sign_flip_interval(x, level)
        return Interval(float(x.mean()), lo, hi, len(x), "sign-flip inversion")
    if np.all((x == 0) | (x == 1)):
        lo, hi = clopper_pearson(int(x.sum()), len(x), level)
        return Interval(float(x.mean()), lo, hi, len(x), "clopper-pearson")
    lo, hi = bootstrap_ci(x, level)
    return Interval(float(x.mean()), lo, hi, len(x), "bootstrap")


class _Flips:
    """Sums of `d` and of the signs under every sign pattern (exact, up to `exact_max` values) or under `n_perm`
    seeded random ones: enough to test `mean(d) = delta` for any shift `delta` without flipping again."""

    def __init__(self, d: np.ndarray, exact_max: int, n_perm: int, seed: int):
        self.d, n = d, len(d)
        self.exact = n <= exact_max
        if self.exact:
            signs = 1.0 - 2.0 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
            self.sums, self.signs = signs @ d, signs.sum(axis=1)
            return
        rng, sums, totals = np.random.default_rng(seed), [], []
        for start in range(0, n_perm, 4096):  # chunks keep the sign matrix small
            signs = rng.choice((-1.0, 1.0), size=(min(4096, n_perm - start), n))
            sums.append(signs @ d), totals.append(signs.sum(axis=1))
        self.sums, self.signs = np.concatenate(sums), np.concatenate(totals)

    def p(self, delta: float = 0.0) -> float:
        """Two-sided p of `mean(d) = delta`: patterns whose |flipped sum of d - delta| reach the observed one."""
        observed = abs(self.d.sum() - len(self.d) * delta)
        tol = 1e-12 * max(1.0, float(np.abs(self.d - delta).sum()))  # equal sums in another order count as equal
        hits = np.abs(self.sums - delta * self.signs) >= observed - tol
        return float(hits.mean()) if self.exact else (1 + int(hits.sum())) / (1 + len(hits))


def sign_flip_pvalue(d, *, exact_max: int = EXACT_MAX, n_perm: int = N_PERM, seed: int = SEED) -> float:
    """Two-sided paired permutation test of `mean(d) = 0`: under the null each difference's sign is a coin flip.

    Zero differences do not change any flipped sum, so only the non-zero ones are flipped. Up to `exact_max` of
    them every sign pattern is enumerated (exact p); beyond, `n_perm` seeded random patterns give
    `(1 + hits) / (1 + n_perm)`.

    Returns:
        The fraction of sign patterns whose |sum| is at least the observed |sum| (1.0 when every d is 0).
    """
    d = np.asarray(d, dtype=np.float64)
    d = d[d != 0]
    if len(d) == 0:
        return 1.0
    return _Flips(d, exact_max, n_perm, seed).p()


def sign_flip_interval(d, level: float = LEVEL, *, exact_max: int = EXACT_MAX, n_perm: int = N_PERM,
                       seed: int = SEED) -> tuple[float, float]:
    """Interval of `mean(d)` that inverts the sign-flip test: the shifts `delta` it does not reject at
    `1 - level` (differences assumed symmetric about their mean), its two ends found by bisection.

    Returns:
        `(lower, upper)`; `(-inf, inf)` when no shift can be rejected: with n values the smallest p is 2/2^n, so
        at 95% five or fewer samples bound nothing.
    """
    d = np.asarray(d, dtype=np.float64)
    if len(d) == 0:
        raise ValueError("sign_flip_interval needs at least one value")
    alpha, flips = 1 - level, _Flips(d, exact_max, n_perm, seed)
    center, span = float(d.mean()), float(d.max() - d.min()) + 1.0
    if flips.p(float(d.min()) - span) >= alpha:  # beyond every value: the most extreme p there is
        return -math.inf, math.inf

    def edge(outside: float) -> float:  # bisection between a rejected shift and the (never rejected) mean
        inside = center
        for _ in range(60):
            mid = (outside + inside) / 2
            if flips.p(mid) >= alpha:
                inside = mid
            else:
                outside = mid
        return inside

    return edge(float(d.min()) - span), edge(float(d.max()) + span)


def binary_diff_interval(d, level: float = LEVEL) -> tuple[float, float]:
    """Interval of `mean(d)` for paired 0/1 outcomes (`d` in {-1, 0, 1}): `p(+1) - p(-1)` from two Clopper-Pearson
    intervals of the discordant proportions at `1 - (1 - level) / 2` each (Bonferroni: jointly >= `level`).
    It never collapses: two rules that agree on all 8 samples give [-0.42, 0.42]."""
    d = np.asarray(d, dtype=np.float64)
    if len(d) == 0 or not np.all(np.isin(d, (-1.0, 0.0, 1.0))):
        raise ValueError("binary_diff_interval needs differences in {-1, 0, 1}")
    each = 1 - (1 - level) / 2
    up_lo, up_hi = clopper_pearson(int(np.sum(d == 1)), len(d), each)
    down_lo, down_hi = clopper_pearson(int(np.sum(d == -1)), len(d), each)
    return max(-1.0, up_lo - down_hi), min(1.0, up_hi - down_lo)


def holm(pvalues) -> list[float]:
    """Holm's step-down adjustment (family-wise error) of `pvalues`, in their original order."""
    p = np.asarray(pvalues, dtype=np.float64)
    m, out, running = len(p), np.empty(len(p)), 0.0
    for rank, i in enumerate(np.argsort(p, kind="stable")):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


@dataclass(frozen=True)
class PairedDiff:
    """`mean(a - b)` over paired samples, its interval (`method`) and the sign-flip p-value."""

    mean: float
    lo: float
    hi: float
    p: float
    n: int
    method: str

    @property
    def bounded(self) -> bool:
        """Both ends finite (a report prints `no_interval_reason(n)` otherwise)."""
        return math.isfinite(self.lo) and math.isfinite(self.hi)


def paired_diff(a, b, level: float = LEVEL) -> PairedDiff:
    """Compare two rules on the same samples (`a[i]` and `b[i]` are the same sample).

    The interval matches the test: for 0/1 scores the discordant-pairs interval (`binary_diff_interval`), else the
    inverted sign-flip test (`sign_flip_interval`). A bootstrap would not: at a handful of samples it reads
    [-1.00, -1.00] where the test cannot reject. Below `samples_to_separate()` samples (6 at 95%), where the test
    can reject no difference at all, neither gives an interval (unbounded: `no_interval_reason`), so that an accuracy
    difference and a likelihood difference beside it follow one rule.

    Returns:
        A `PairedDiff` of `a - b`.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"paired_diff needs two 1-D arrays of the same non-zero length, got {a.shape} and {b.shape}")
    d = a - b
    binary = bool(np.all(np.isin(a, (0.0, 1.0))) and np.all(np.isin(b, (0.0, 1.0))))
    if smallest_p(len(d)) >= 1 - level:  # one rule for every paired interval: none where the test rejects nothing
        lo, hi = -math.inf, math.inf
    else:
        lo, hi = binary_diff_interval(d, level) if binary else sign_flip_interval(d, level)
    return PairedDiff(float(d.mean()), lo, hi, sign_flip_pvalue(d), len(d),
                      "discordant clopper-pearson" if binary else "sign-flip inversion")


@dataclass(frozen=True)
class Ranked:
    """One rule in a ranking: its mean, the paired difference to the top rule (None for the top itself), the
    Holm-adjusted p of that difference, and its tier (1 = not separated from the top)."""

    rule: str
    mean: float
    vs_best: PairedDiff | None
    p_holm: float | None
    tier: int


def rank(values: dict[str, np.ndarray], alpha: float = ALPHA, level: float = LEVEL) -> list[Ranked]:
    """Rank rules measured on the same samples and group the ones this sample size cannot tell apart.

    Args:
        values: rule -> per-sample values, every array aligned on the same samples (higher is better).
        alpha: family-wise error of each step (Holm over the comparisons with that step's best rule).
    Returns:
        Rules from best to worst (ties: by name). Tier 1 is the best rule and every rule whose Holm-adjusted p
        against it is >= alpha; the next tier repeats that on the remaining rules, and so on.
    """
    values = {r: np.asarray(v, dtype=np.float64) for r, v in values.items()}
    lengths = {len(v) for v in values.values()}
    if len(lengths) > 1:
        raise ValueError(f"rank needs every rule on the same samples, got lengths {sorted(lengths)}")
    order = sorted(values, key=lambda r: (-float(np.mean(values[r])), r))
    if not order:
        return []
    best = order[0]
    diffs = {r: paired_diff(values[r], values[best], level) for r in order[1:]}
    p_holm = dict(zip(diffs, holm([d.p for d in diffs.values()])))
    tiers, remaining, tier = {}, list(order), 1
    while remaining:
        head, rest = remaining[0], remaining[1:]
        step = holm([sign_flip_pvalue(values[r] - values[head]) for r in rest]) if rest else []
        same = [r for r, p in zip(rest, step) if p >= alpha]
        for r in [head] + same:
            tiers[r] = tier
        remaining = [r for r in rest if r not in same]
        tier += 1
    return [Ranked(r, float(np.mean(values[r])), diffs.get(r), p_holm.get(r), tiers[r]) for r in order]


def leaders(ranked: list[Ranked]) -> list[str]:
    """The rules of a `rank` result that share the highest mean (one name when a single rule is ahead)."""
    if not ranked:
        return []
    top = ranked[0].mean
    return [r.rule for r in ranked if abs(r.mean - top) <= 1e-12 * max(1.0, abs(top))]


def separation_sentence(n: int, rules: int, alpha: float = ALPHA) -> str | None:
    """One sentence when `n` paired samples cannot separate any two of `rules` rules (the sign-flip test's smallest
    Holm-adjusted p, over the `rules - 1` comparisons with the top, is at least `alpha`), saying how many would;
    None when a pair can be separated (or there is nothing to compare)."""
    if rules < 2:
        return None
    m = rules - 1
    p = smallest_p(n, m)
    if p < alpha:
        return None
    need = samples_to_separate(m, alpha)
    holm_part = f"; Holm over the {m} comparisons with the top: {p:.3g}" if m > 1 else ""
    return (f"{n} paired sample{'s' if n != 1 else ''} cannot separate any two of these {rules} rules, whatever "
            f"their scores: the paired test's smallest possible p is 2/2^{n} = {2.0 ** (1 - n):.3g}{holm_part}, "
            f"not below {alpha:g}; separating a pair needs at least {need} paired samples, every one won by the same "
            "rule.")


def samples_for_power(d, comparisons: int = 1, alpha: float = ALPHA, power: float = 0.8) -> int | None:
    """Paired samples at which a difference like `d`'s (per-sample differences of two rules) would be separated
    with probability `power`: the normal approximation `((z(1 - alpha / (2 m)) + z(power)) sd / |mean|)^2` with
    Bonferroni over `m = comparisons` (Holm's first step), never below `samples_to_separate`. A projection from the
    observed differences (it assumes new samples look like these), not a measurement.

    Returns:
        The sample count, or None when the mean difference is 0 (no sample size separates what does not differ).
    """
    from statistics import NormalDist

    d = np.asarray(d, dtype=np.float64)
    m = float(d.mean()) if len(d) else 0.0
    floor = samples_to_separate(comparisons, alpha)
    if abs(m) < 1e-12:
        return None
    sd = float(d.std(ddof=1)) if len(d) > 1 else 0.0
    z = NormalDist().inv_cdf(1 - alpha / (2 * comparisons)) + NormalDist().inv_cdf(power)
    return max(floor, math.ceil((z * sd / abs(m)) ** 2))


def undecided(values: dict[str, np.ndarray], alpha: float = ALPHA) -> set[str]:
    """The rules of `values` (as `rank` takes them) separated neither from the top nor from the last rule: tier 1
    of `rank` and tier 1 of the ranking from the bottom. A report prints "undecided" for them, not a tier that
    would read as a standing."""
    if len(values) < 2:
        return set()
    top = {r.rule for r in rank(values, alpha) if r.tier == 1}
    bottom = {r.rule for r in rank({k: -np.asarray(v, dtype=np.float64) for k, v in values.items()}, alpha)
              if r.tier == 1}
    return top & bottom
