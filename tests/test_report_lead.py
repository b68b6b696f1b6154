"""The report leads with the answer (issue 42): the opening paragraph (who leads at each budget, separated or not,
from how many samples, what would settle it), one task's tables printed once, no tier for a rule separated neither
from the top nor from the last, the statistics in a closing glossary, the cost table saying what its times are."""

import numpy as np

from fxbudget.harness import report as R
from fxbudget.harness.lead import lead_paragraph
from fxbudget.harness.stats import samples_for_power, undecided
from test_report import row


def _opening(text: str) -> str:
    lines = text.splitlines()
    assert lines[0] == "# fxbudget comparison" and lines[1] == ""
    return lines[2]


def test_two_samples_lead_without_separation_and_say_what_would_settle_it():
    rows = [row("full", i) for i in range(2)] + [row("snapkv", i) for i in range(2)] + \
           [row("streamingllm", i, score=0.0) for i in range(2)]
    first = _opening(R.markdown(rows, []))
    # Issue 50: why 1.00 against 0.00 is not separated at n = 2 is said in the sentence.
    assert first == ("**Answer** (by accuracy): at B=8, **snapkv** leads (accuracy 1.00), but not separated from any "
                     "other rule: 2 paired samples cannot separate even 0.00 from 1.00 (the paired test's smallest "
                     "possible p is 2/2^2 = 0.5; a pair needs at least 6 paired samples, every one won by the same "
                     "rule). To settle it: about 6 paired samples at B=8 (snapkv against "
                     "streamingllm) would separate the leader from the lowest rule not yet separated from it with 80% "
                     "power (projected from these samples' differences: a guide, not a promise).")
    assert "Clopper" not in first and "Holm" not in first  # statistical terms are in the glossary


def test_a_separated_leader_is_said_to_be_settled():
    rows = [row("snapkv", i) for i in range(8)] + [row("knorm", i, score=0.0) for i in range(8)]
    assert lead_paragraph(rows) == ("**Answer** (by accuracy): at B=8, **snapkv** leads (accuracy 1.00), ahead of "
                                    "every other rule (separated; 8 paired samples). Each leader is separated from "
                                    "every other rule at its budget.")


def test_equal_rules_get_no_projection():
    rows = [row("snapkv", i) for i in range(3)] + [row("knorm", i) for i in range(3)]
    text = lead_paragraph(rows)
    assert "at B=8, all 2 rules tie (accuracy 1.00) on 3 paired samples." in text and "about" not in text
    assert "no number of such samples separates them" in text


def test_projection_is_more_than_the_samples_at_hand():
    # 8 samples, a leader ahead on 6 and behind on 2 of 3 rules: not separated, and the normal approximation alone
    # would say fewer than 8.
    a = [1.0] * 8
    b = [0.0] * 6 + [1.0, 1.0]
    rows = [row("a", i, score=a[i]) for i in range(8)] + [row("b", i, score=b[i]) for i in range(8)] + \
           [row("c", i, score=b[i]) for i in range(8)]
    text = lead_paragraph(rows)
    assert "not separated from any other rule (8 paired samples)" in text
    n = int(text.split("about ", 1)[1].split(" ")[0])
    assert n >= 9


def test_samples_for_power():
    assert samples_for_power([0.0, 0.0]) is None
    assert samples_for_power([1.0, 1.0], comparisons=2) == 7  # no spread: the fewest that can separate
    d = np.array([1.0, -1.0, 1.0, 1.0])  # mean 0.5, sd 1: ((1.96 + 0.84) * 2)^2 = 31.4
    assert samples_for_power(d) == 32


def test_one_task_prints_each_table_once():
    rows = [row("full", i) for i in range(2)] + [row("snapkv", i) for i in range(2)] + \
           [row("h2o", i, score=0.0) for i in range(2)]
    text = R.markdown(rows, [])
    assert "all tasks" not in text
    assert text.count("accuracy:\n\n| rule | B=8 |") == 1
    assert text.count("### passkey (context 1021 tokens") == 1
    two = rows + [row(r, i, task="kv_retrieval") for r in ("full", "snapkv", "h2o") for i in range(2)]
    assert "### all tasks" in R.markdown(two, [])


def test_no_tier_for_a_rule_separated_neither_from_top_nor_last():
    # a at 1.0, c at 0.0 on 8 samples (separated); b in the middle, separated from neither.
    b_scores = [1, 0] * 4
    values = {"a": np.ones(8), "b": np.array(b_scores, dtype=float), "c": np.zeros(8)}
    assert undecided(values) == {"b"}
    rows = [row("a", i) for i in range(8)] + [row("b", i, score=float(s)) for i, s in enumerate(b_scores)] + \
           [row("c", i, score=0.0) for i in range(8)]
    table = R.paired_tables(rows)
    line = {x.split(" | ")[0]: x for x in table.splitlines() if x.startswith("| ")}
    assert line["| b"].split(" | ")[4] == "undecided"
    assert line["| a"].split(" | ")[2] == "top" and line["| a"].split(" | ")[4] == "1"
    assert line["| c"].split(" | ")[4] == "2"
    two = [row("a", i) for i in range(2)] + [row("c", i, score=0.0) for i in range(2)]
    # Issue 50: no interval for the accuracy difference either below 6 samples (the likelihood's rule)
    assert "| c | 0.00 [0.00, 0.84] | -1.00 (n=2: too few samples for an interval) | 0.500 | undecided |" in \
        R.paired_tables(two)


def test_glossary_closes_the_report_and_the_cost_table_says_what_it_times():
    rows = [row(r, i, backend="inductor", threads=4) for r in ("full", "snapkv") for i in range(2)]
    text = R.markdown(rows, [])
    assert text.rstrip().splitlines()[-1].startswith("- See the documentation")
    glossary = text.split("## glossary", 1)[1]
    assert "Clopper-Pearson" in glossary and "sign-flip" in glossary and "**undecided**" in glossary
    assert "Clopper-Pearson" not in text.split("## glossary", 1)[0]
    cost = text.split("### cost (mean per sample)", 1)[1]
    note = cost.strip().splitlines()[0]
    assert note.startswith("Times are wall-clock seconds of the kernel compiled with `inductor`, on 4 torch threads "
                           "of cpu")
    eager = R.markdown([row(r, i) for r in ("full", "snapkv") for i in range(2)], []).split("### cost", 1)[1]
    assert "fxbudget's eager kernel (`--backend none`, no compilation), on 1 torch thread of cpu" in eager
    assert "`benchmarks/results/overhead.md`" in note and "`benchmarks/results/fairness_spread.md`" in note


def test_a_tie_at_zero_asks_for_an_easier_task_not_a_harder_one():
    # Issue 55: every budgeted rule at 0.00 was told "a harder task or a smaller budget would" separate them.
    rows = [row(r, i, score=0.0) for r in ("snapkv", "knorm", "h2o") for i in range(3)]
    text = lead_paragraph(rows)
    assert "all 3 rules tie (accuracy 0.00)" in text
    assert text.endswith("no number of such samples separates them: where every rule scored 0.00, an easier task, "
                         "a larger budget or `--protocol query-aware` (the question seen before compressing) would.")
    aware = lead_paragraph([dict(r, protocol="query-aware") for r in rows])
    assert "an easier task or a larger budget would." in aware and "--protocol" not in aware
    top = lead_paragraph([row(r, i) for r in ("snapkv", "knorm") for i in range(3)])
    assert top.endswith("where every rule scored 1.00, a harder task or a smaller budget would.")
