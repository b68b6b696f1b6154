"""The report's "where the gain comes from" section on hand-made rows: the share of a rule's gain over random that
`protectonly:` recovers, its interval (or why none), and the section's place in the report."""

import numpy as np
import pytest

from fxbudget.harness import report as R
from fxbudget.harness.decomposition import decomposed_rules, protection_share, splits
from test_report import row

N = 12


def _rows(rule_scores, protectonly_scores, random_scores, noprotect_scores, rule="h2o"):
    out = [row("full", i) for i in range(N)]
    for name, scores in ((rule, rule_scores), ("protectonly:" + rule, protectonly_scores), ("random", random_scores),
                         ("noprotect:" + rule, noprotect_scores)):
        out += [row(name, i, score=float(s), logprob=-1.0 + 0.1 * float(s)) for i, s in enumerate(scores)]
    return out


def test_share_by_hand():
    rule = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1.0])
    prot = np.array([1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1.0])
    rand = np.zeros(N)
    s = protection_share(rule, prot, rand)
    # (7/12) / (11/12)
    assert s.value == pytest.approx(7 / 11)
    assert s.lo is not None and s.lo < 7 / 11 < s.hi and 0 <= s.lo and s.hi <= 1


def test_share_is_one_when_protection_is_everything_and_zero_when_nothing():
    rule = np.linspace(0.5, 1.0, N)
    rand = np.zeros(N)
    full = protection_share(rule, rule, rand)
    none = protection_share(rule, rand, rand)
    assert (full.value, full.lo, full.hi) == (1.0, 1.0, 1.0)
    assert (none.value, none.lo, none.hi) == (0.0, 0.0, 0.0)


def test_share_has_no_interval_without_a_gain_over_random():
    rand = np.zeros(N)
    assert protection_share(rand, rand + 1, rand).value is None  # no gain at all: no share
    mixed = np.array([1, -1] * (N // 2), dtype=float)
    mixed[0] = 2  # a mean gain, not separated from 0
    s = protection_share(mixed, mixed / 2, rand)
    assert s.value == pytest.approx(0.5) and s.lo is None and "not separated from 0" in s.reason


def test_splits_pair_the_four_rules_and_the_section_reads_them():
    rule = [1] * 11 + [0]
    prot = [1] * 7 + [0] * 5
    rand = [0] * N
    nop = [1] * 3 + [0] * 9
    rows = _rows(rule, prot, rand, nop)
    assert decomposed_rules(rows) == ["h2o"]
    acc = next(s for s in splits(rows) if s.metric == "accuracy")
    assert acc.n == N and acc.means == pytest.approx({"rule": 11 / 12, "noprotect": 3 / 12, "protectonly": 7 / 12,
                                                       "random": 0.0})
    assert acc.share.value == pytest.approx(7 / 11)
    lik = next(s for s in splits(rows) if s.metric == "likelihood")
    assert lik.share.value == pytest.approx(7 / 11)  # likelihood is linear in the score here
    text = R.markdown(rows, [])
    section = text.split("## where the gain comes from: score or protection", 1)[1]
    line = next(x for x in section.splitlines() if x.startswith("| h2o | 8 | accuracy"))
    assert line.startswith("| h2o | 8 | accuracy | 12 | 0.92 | 0.25 | 0.58 | 0.00 | 0.92 [")
    assert f"| {7 / 11:.2f} [" in line


def test_no_section_without_a_complete_decomposition():
    rows = _rows([1] * N, [1] * N, [0] * N, [0] * N)
    assert "where the gain comes from" not in R.markdown([r for r in rows if r["rule"] != "random"], [])
    assert decomposed_rules([r for r in rows if r["rule"] != "noprotect:h2o"]) == []
