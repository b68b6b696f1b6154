"""The report's statistics on synthetic values whose answer is known (closed forms, hand counts, planted effects)."""

import itertools

import numpy as np
import pytest

from fxbudget.harness.stats import (binary_diff_interval, bootstrap_ci, clopper_pearson, holm, leaders, mean_interval,
                                    no_interval_reason, paired_diff, rank, samples_to_separate,
                                    separation_sentence, sign_flip_interval, sign_flip_pvalue, smallest_p)


@pytest.mark.parametrize("n", [1, 3, 6, 20])
def test_clopper_pearson_closed_forms(n):
    # 0 of n: the upper bound solves (1 - p)^n = 0.025; n of n: the lower bound solves p^n = 0.025.
    assert clopper_pearson(0, n) == (0.0, pytest.approx(1 - 0.025 ** (1 / n), abs=1e-9))
    assert clopper_pearson(n, n) == (pytest.approx(0.025 ** (1 / n), abs=1e-9), 1.0)


def test_clopper_pearson_table_values_and_symmetry():
    lo, hi = clopper_pearson(5, 10)  # published: 0.1871, 0.8129 (Beta(5, 6) and Beta(6, 5) quantiles)
    assert lo == pytest.approx(0.187086, abs=1e-6) and hi == pytest.approx(0.812914, abs=1e-6)
    lo, hi = clopper_pearson(1, 6)  # 1 - 0.975^(1/6) is the lower bound for k = 1 (P(X >= 1) = 1 - (1-p)^6)
    assert lo == pytest.approx(1 - 0.975 ** (1 / 6), abs=1e-9)
    a, b = clopper_pearson(3, 7), clopper_pearson(4, 7)
    assert a[0] == pytest.approx(1 - b[1], abs=1e-9) and a[1] == pytest.approx(1 - b[0], abs=1e-9)
    with pytest.raises(ValueError):
        clopper_pearson(7, 6)


def test_mean_interval_picks_exact_for_binary_scores():
    iv = mean_interval([0, 0, 0, 0, 0, 0])
    assert iv.method == "clopper-pearson" and iv.mean == 0 and iv.lo == 0 and iv.hi == pytest.approx(0.4593, abs=1e-4)
    iv = mean_interval([0.25, 0.5, 1.0, 0.75, 0.5])  # fractions (multi-answer tasks): bootstrap
    assert iv.method == "bootstrap" and iv.lo < iv.mean < iv.hi and 0.25 <= iv.lo and iv.hi <= 1.0
    assert mean_interval([0.5] * 4).lo == mean_interval([0.5] * 4).hi == 0.5  # what a bootstrap cannot do better
    assert mean_interval([0.3, 0.9, 0.4]) == mean_interval([0.3, 0.9, 0.4])  # seeded: reproducible


def test_bootstrap_ci_covers_a_known_mean():
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 1.0, size=400)
    lo, hi = bootstrap_ci(x)
    assert lo < 2.0 < hi and hi - lo == pytest.approx(2 * 1.96 / 20, rel=0.15)  # ~ +-1.96 sigma / sqrt(n)


@pytest.mark.parametrize("d, expected", [
    ([3, 1, 1], 2 / 8),  # +-3+-1+-1 = 5,3,3,1,-1,-3,-3,-5: |sum| >= 5 twice
    ([2, 1, -1], 6 / 8),  # +-2+-1+-1 = 4,2,2,0,0,-2,-2,-4: |sum| >= 2 six times
    ([2, 1, -1, 0, 0], 6 / 8),  # zeros flip to themselves
    ([0, 0], 1.0),
    ([1] * 6, 2 / 64),  # the smallest two-sided p with 6 non-zero differences
    ([0.5, -0.25, 0.125, 1.0], 6 / 16),  # observed 1.375; |sum| >= 1.375: 1.875, 1.625, 1.375 and their negatives
])
def test_sign_flip_exact_equals_hand_count(d, expected):
    assert sign_flip_pvalue(d) == pytest.approx(expected, abs=1e-12)


def test_sign_flip_exact_equals_brute_force_and_monte_carlo_agrees():
    d = np.random.default_rng(3).normal(0.3, 1.0, size=12)
    brute = np.mean([abs(np.dot(s, d)) >= abs(d.sum()) - 1e-12 for s in itertools.product((-1, 1), repeat=12)])
    assert sign_flip_pvalue(d) == pytest.approx(brute, abs=1e-12)
    assert sign_flip_pvalue(d, exact_max=0, n_perm=40_000) == pytest.approx(brute, abs=0.01)


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01 = 0.03, 2 x 0.03 = 0.06, max(0.06, 1 x 0.04) = 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_paired_diff_finds_a_planted_difference():
    a = np.ones(40)
    b = np.r_[np.ones(25), np.zeros(15)]  # b misses 15 samples that a gets
    d = paired_diff(b, a)
    assert d.mean == pytest.approx(-15 / 40) and d.hi < 0 and d.p == pytest.approx(2 / 2 ** 15)


def test_rank_separates_planted_differences_and_groups_equal_rules():
    rng = np.random.default_rng(0)
    base = rng.normal(-1.0, 0.5, size=30)  # a continuous metric (answer log-likelihood), higher is better
    wiggle = np.repeat(rng.uniform(0.01, 0.1, size=15), 2) * np.tile([1, -1], 15)  # mean exactly 0
    values = {"best": base, "same": base + wiggle, "worse": base - 0.4 + rng.normal(0, 0.1, size=30),
              "worst": base - 2.0}
    order = rank(values)
    ranked = {r.rule: r for r in order}
    top, twin = order[0], order[1]  # "best" and "same" have equal means up to rounding: either may lead
    assert {top.rule, twin.rule} == {"best", "same"} and top.vs_best is None
    assert twin.vs_best.p == pytest.approx(1.0) and twin.tier == top.tier == 1  # equal rules: not separated
    assert ranked["worse"].vs_best.hi < 0 and ranked["worse"].p_holm < 0.01 and ranked["worse"].tier == 2
    assert ranked["worst"].tier == 3 and [r.rule for r in order][-2:] == ["worse", "worst"]


def test_rank_cannot_separate_six_binary_samples():
    """Six 0/1 samples: even 6 wins out of 6 give p = 1/32 before the correction; with 3 rivals Holm makes it 3/32."""
    values = {"a": np.ones(6), "b": np.zeros(6), "c": np.zeros(6), "d": np.zeros(6)}
    ranked = {r.rule: r for r in rank(values)}
    assert ranked["b"].vs_best.p == pytest.approx(2 / 64) and ranked["b"].p_holm == pytest.approx(6 / 64)
    assert {r.tier for r in ranked.values()} == {1}


def test_rank_refuses_unpaired_values():
    with pytest.raises(ValueError, match="same samples"):
        rank({"a": np.ones(3), "b": np.ones(4)})


def test_binary_diff_interval_by_hand():
    lo, hi = binary_diff_interval([-1] * 8)  # 8 losses of 8: p(-1) >= 0.0125^(1/8), p(+1) <= 1 - 0.0125^(1/8)
    assert lo == -1.0 and hi == pytest.approx((1 - 0.0125 ** (1 / 8)) - 0.0125 ** (1 / 8), abs=1e-9) and hi < 0
    assert binary_diff_interval([-1] * 4)[1] > 0  # 4 of 4 cannot exclude 0 (the test's p is 2/16)
    lo, hi = binary_diff_interval([0] * 8)  # agreeing on every sample is not proof of equality
    assert lo == pytest.approx(-hi) and hi == pytest.approx(1 - 0.0125 ** (1 / 8), abs=1e-9)


def test_sign_flip_interval_inverts_the_test():
    assert sign_flip_interval([0.3, -0.1, 0.5, 0.2, 0.4]) == (float("-inf"), float("inf"))  # min p = 2/32 > 0.05
    d = np.random.default_rng(5).normal(0.5, 1.0, size=14)
    lo, hi = sign_flip_interval(d)
    assert lo < d.mean() < hi
    for edge, out in ((lo, -1.0), (hi, 1.0)):  # just inside each end the shift is kept, just outside rejected
        assert sign_flip_pvalue(d - (edge - out * 1e-6)) >= 0.05 > sign_flip_pvalue(d - (edge + out * 1e-3))
    t = 2.16 * d.std(ddof=1) / np.sqrt(14)  # Student's t interval for comparison: the same scale
    assert 0.6 < (hi - lo) / (2 * t) < 1.6
    lo, hi = sign_flip_interval(np.random.default_rng(6).normal(-1.0, 0.2, size=40))  # Monte Carlo above 16
    assert lo < -0.9 and hi > -1.1 and hi < 0


def test_paired_diff_interval_agrees_with_the_test():
    d = paired_diff(np.zeros(4), np.ones(4))  # 4 of 4 worse: p = 2/16, interval must contain 0
    assert d.p == pytest.approx(0.125) and d.lo < 0 < d.hi and d.method == "discordant clopper-pearson"
    d = paired_diff(np.zeros(8), np.ones(8))
    assert d.p == pytest.approx(2 / 256) and d.hi < 0
    d = paired_diff(np.array([-2.0, -1.5, -2.2, -1.9]), np.zeros(4))
    assert d.method == "sign-flip inversion" and (d.lo, d.hi) == (float("-inf"), float("inf"))


@pytest.mark.parametrize("n", range(1, 10))
def test_smallest_p_is_the_p_of_n_wins_in_n(n):
    # The closed form against the test itself: every sample won by the same rule is the most extreme pattern.
    assert smallest_p(n) == pytest.approx(sign_flip_pvalue(np.ones(n)), abs=1e-12)
    assert smallest_p(n, 3) == pytest.approx(min(1.0, holm([sign_flip_pvalue(np.ones(n))] * 3)[0]), abs=1e-12)


@pytest.mark.parametrize("comparisons, alpha", [(1, 0.05), (2, 0.05), (3, 0.05), (5, 0.05), (1, 0.01), (7, 0.1)])
def test_samples_to_separate_is_the_first_size_the_ranking_can_split(comparisons, alpha):
    need = samples_to_separate(comparisons, alpha)
    for n, separable in ((need - 1, False), (need, True)):
        # The top rule wins every sample against `comparisons` rivals that lose every one.
        values = {"top": np.ones(n), **{f"r{i}": np.zeros(n) for i in range(comparisons)}}
        tiers = {r.tier for r in rank(values, alpha=alpha)}
        assert (tiers != {1}) is separable, (n, tiers)


def test_separation_sentence_only_where_nothing_can_be_separated():
    assert separation_sentence(2, 4) == (
        "2 paired samples cannot separate any two of these 4 rules, whatever their scores: the paired test's "
        "smallest possible p is 2/2^2 = 0.5; Holm over the 3 comparisons with the top: 1, not below 0.05; "
        "separating a pair needs at least 7 paired samples, every one won by the same rule.")
    assert separation_sentence(5, 2).startswith("5 paired samples cannot") and "at least 6 paired" in \
        separation_sentence(5, 2)
    assert separation_sentence(6, 2) is None and separation_sentence(7, 4) is None
    assert separation_sentence(1, 1) is None  # nothing to compare


def test_unbounded_intervals_are_flagged_with_a_reason():
    iv = mean_interval([-0.5, -0.7], paired=True)
    assert not iv.bounded and no_interval_reason(iv.n) == "n=2: too few samples for an interval"
    assert mean_interval([-0.5, -0.7, -0.6, -0.4, -0.65, -0.55], paired=True).bounded
    assert mean_interval([0, 1]).bounded  # Clopper-Pearson is bounded at any size
    assert not paired_diff(np.array([1.0, 2.0]), np.zeros(2)).bounded


def test_leaders_are_the_rules_sharing_the_top_mean():
    assert leaders(rank({"a": np.ones(4), "b": np.ones(4), "c": np.zeros(4)})) == ["a", "b"]
    assert leaders(rank({"a": np.ones(4), "b": np.r_[1.0, 1, 1, 0]})) == ["a"]
    assert leaders([]) == []
