"""Long outputs: the report's output length and end-to-end time beside accuracy, each rule's answer length against
the unmodified model (paired), and the long-answer task `list_keys` (its sample, answer, budget and scoring)."""

import csv
import json
import re

import pytest

from fxbudget.harness import report as R
from fxbudget.harness.tables import length_pairs, length_tables
from fxbudget.harness.tasks import NEEDLE_TASKS, TASKS, Sample, answer_text, make_samples, score
from fxbudget.harness.tasks.list_keys import in_order_score, n_keys


def row(rule, sample=0, *, tokens=10, prefill=1.0, decode=0.5, score=1.0, budget=8, protocol="query-agnostic"):
    """One result row with the fields the report reads."""
    r = {"model": "m", "dtype": "float32", "device": "cpu", "torch": "t", "transformers": "tf", "fxbudget": "f",
         "threads": 1, "kernel_fingerprint": None if rule == "full" else "ab" * 32, "protocol": protocol,
         "chunk_size": None, "backend": "none", "task": "list_keys", "length": 1000, "n_tokens": 997,
         "context_tokens": 1021, "rule": rule, "budget": None if rule == "full" else budget, "budget_fraction": None,
         "score": score, "prediction": "apple, pear", "answers": ["apple", "pear"], "depth": None,
         "answer_logprob_mean": -0.5, "prefill_s": prefill, "decode_s": decode, "likelihood_s": 0.1,
         "output_tokens": tokens, "kv_allocated_bytes": 2048, "kv_held_bytes": 1024, "compile_s": 0.0,
         "shared_prefill": False, "branch_s": None, "window": None if rule == "full" else 32, "sample": sample,
         "seed": 0}
    r["key"] = f"{sample}|{rule}|{r['budget']}|{protocol}"
    return r


def length_section(text: str) -> str:
    return text.split("output length vs the unmodified model per budget", 1)[1].split("\n### ", 1)[0]


def test_length_table_shows_output_tokens_and_end_to_end_seconds_beside_accuracy():
    rows = [row("full", s, tokens=100, prefill=2.0, decode=3.0) for s in range(2)] + \
           [row("snapkv", 0, tokens=120, prefill=1.0, decode=4.0, score=0.5),
            row("snapkv", 1, tokens=140, prefill=1.0, decode=6.0, score=0.0)]
    lines = R.length_table(rows).splitlines()
    assert lines[0] == "| rule | budget | accuracy | output tokens | end-to-end s |"
    full = next(line for line in lines if line.startswith("| full"))
    snap = next(line for line in lines if line.startswith("| snapkv"))
    assert full.endswith("| 100.0 | 5.00 |")
    assert snap.startswith("| snapkv | 8 | 0.25 [") and snap.endswith("| 130.0 | 6.00 |")  # (5 + 7) / 2
    text = R.markdown(rows, [])
    assert "output length and end-to-end time (prefill + decode to the last token)" in text
    cost = text.split("### cost", 1)[1]
    assert cost.splitlines()[2].startswith("Times are wall-clock seconds of fxbudget's eager kernel")
    assert "| end-to-end s |" in cost.splitlines()[4]
    assert "| snapkv | 8 | 1.00 | 5.00 | 6.00 |" in cost


def test_summary_has_end_to_end_seconds():
    rows = [row("full", s, prefill=2.0, decode=0.25 * s) for s in range(4)]
    (line,) = R.summarize(rows)
    assert line["end_to_end_s"] == pytest.approx(2.0 + 0.25 * 1.5) and line["output_tokens"] == 10


def test_a_rule_longer_on_every_sample_is_reported_as_lengthening():
    rows = [row("full", s, tokens=50 + s) for s in range(8)] + \
           [row("snapkv", s, tokens=70 + 2 * s) for s in range(8)] + \
           [row("h2o", s, tokens=50 + s) for s in range(8)]
    pairs = length_pairs(rows)[8]
    d, p = pairs["snapkv"]
    assert d.n == 8 and d.mean == pytest.approx(23.5) and d.lo > 0 and p < 0.05
    assert pairs["h2o"][0].mean == 0 and pairs["h2o"][1] == 1.0
    section = length_section(R.markdown(rows, []))
    verdict = [line for line in section.splitlines() if line.startswith("- ")]
    assert verdict == ["- lengthens answers against the unmodified model (Holm p < 0.05): **snapkv**"]
    assert "| snapkv | 8 | 53.5 | 77.0 | 23.5 [" in section


def test_equal_lengths_are_not_lengthening():
    rows = [row(rule, s, tokens=40 + 3 * s) for rule in ("full", "snapkv", "h2o") for s in range(8)]
    text = length_section(R.markdown(rows, []))
    assert "lengthens answers against the unmodified model (Holm" not in text
    assert "- no rule lengthens answers against the unmodified model at this sample size" in text


def test_shorter_answers_are_not_called_longer():
    rows = [row("full", s, tokens=90) for s in range(7)] + [row("snapkv", s, tokens=60 - s) for s in range(7)]
    lines = [line for line in length_tables(rows).splitlines() if line.startswith("- ")]
    assert lines == ["- shortens answers against the unmodified model (Holm p < 0.05): **snapkv**",
                     "- no rule lengthens answers against the unmodified model at this sample size (none has longer "
                     "answers with Holm p < 0.05)"]


def test_too_few_samples_say_they_cannot_tell():
    rows = [row("full", s, tokens=10) for s in range(3)] + [row("snapkv", s, tokens=90) for s in range(3)] + \
           [row("h2o", s, tokens=95) for s in range(3)]
    text = length_tables(rows)
    assert "lengthens answers against the unmodified model (Holm" not in text
    assert ("- 3 paired samples cannot tell whether a rule lengthens answers, whatever their lengths: the paired "
            "test's smallest possible p is 2/2^3 = 0.25; Holm over the 2 comparisons with full: 0.5, not below 0.05; "
            "that needs at least 7 paired samples") in text
    assert "(n=3: too few samples for an interval)" in text and "inf" not in text


def test_each_protocol_compares_with_its_own_unmodified_rows():
    # Streaming holds the budget while decoding: its rule is longer there, not under query-agnostic.
    rows = [row("full", s, tokens=30, protocol=p) for s in range(6) for p in ("query-agnostic", "streaming")] + \
           [row("snapkv", s, tokens=30, protocol="query-agnostic") for s in range(6)] + \
           [row("snapkv", s, tokens=45 + s, protocol="streaming") for s in range(6)]
    text = R.markdown(rows, [])
    agnostic, streaming = text.split("## protocol: query-agnostic", 1)[1].split("## protocol: streaming")
    assert "- no rule lengthens answers" in length_section(agnostic)
    assert "- lengthens answers against the unmodified model (Holm p < 0.05): **snapkv**" in length_section(streaming)


def test_no_reference_rows_no_length_comparison():
    rows = [row(rule, s) for rule in ("snapkv", "h2o") for s in range(2)]
    assert length_tables(rows) is None
    assert "output length vs the unmodified model" not in R.markdown(rows, [])


def test_report_files_carry_end_to_end_seconds(tmp_path):
    rows = [row(rule, s) for rule in ("full", "snapkv") for s in range(2)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    R.report([tmp_path])
    with (tmp_path / "summary.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert [float(x["end_to_end_s"]) for x in lines] == [1.5, 1.5]
    assert "output tokens vs the unmodified model" in (tmp_path / "report.md").read_text()


# --- the long-answer task -------------------------------------------------------------------------------------

def count(tok, text):
    return len(tok(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("n_tokens", (1000, 2500))
def test_list_keys_sample_lists_every_entry_in_context_order(tok, n_tokens):
    s = TASKS["list_keys"](tok, n_tokens, seed=3)
    assert s.task == "list_keys" and s.depth is None and abs(s.n_tokens - n_tokens) <= 0.02 * n_tokens
    assert len(s.answers) == n_keys(n_tokens) == s.meta["keys"] and len(set(s.answers)) == len(s.answers)
    # The context's entries, read back in order, are the answers; each key named once.
    entries = re.findall(r"Key ([a-z]+) holds (\d+)\.", s.context)
    assert [k for k, _ in entries] == s.answers
    assert all(len(re.findall(rf"\b{k}\b", s.context)) == 1 for k in s.answers)
    assert "in the order in which they appear" in s.question
    assert s.answer_prefix == f"The {len(s.answers)} keys, in order, are:"
    # A long answer, and room to say it: the gold answer's tokens plus a quarter and 16.
    gold = count(tok, answer_text(tok, s))
    assert gold == s.meta["answer_tokens"] and s.max_new_tokens == -(-5 * gold // 4) + 16
    if n_tokens >= 2000:
        assert len(s.answers) == 120 and gold >= 200
    depths = [e["depth"] for e in s.meta["needles"]]
    assert depths == sorted(depths) and depths[0] < 0.1 and depths[-1] > 0.9  # spread over the whole context


def test_list_keys_is_deterministic_and_not_a_needle_task(tok):
    a, b = TASKS["list_keys"](tok, 800, seed=5), TASKS["list_keys"](tok, 800, seed=5)
    assert a == b and TASKS["list_keys"](tok, 800, seed=6).answers != a.answers
    assert "list_keys" not in NEEDLE_TASKS
    assert [s.depth for s in make_samples("list_keys", tok, 800, 2)] == [None, None]


def test_list_keys_bad_key_count(tok):
    with pytest.raises(ValueError, match=r"keys must be an int in \[1, "):
        TASKS["list_keys"](tok, 1000, keys=0)


def test_in_order_scoring_on_hand_made_predictions():
    keys = ["apple", "pear", "plum", "kettle", "raven"]
    assert in_order_score("apple, pear, plum, kettle, raven", keys) == 1.0
    assert in_order_score("Apple, PEAR, plum, Kettle and raven.", keys) == 1.0  # case and filler words ignored
    assert in_order_score("apple, plum, pear, kettle, raven", keys) == 0.8  # one out of place
    assert in_order_score("raven, kettle, plum, pear, apple", keys) == 0.2  # reversed: one in order
    assert in_order_score("apple, apple, apple, pear", keys) == 0.4  # a repeat counts once
    assert in_order_score("apple, banana, pear", keys) == 0.4  # a key not in the store is ignored
    assert in_order_score("", keys) == 0.0
    s = Sample("list_keys", "ctx", "q", keys, meta={"scoring": "keys_in_order"})
    assert score(s, "apple, plum, pear, kettle, raven") == 0.8
    # string_match_all would give 1.0 to the same words out of order: the order is what is scored.
    assert score(Sample("t", "ctx", "q", keys), "raven, kettle, plum, pear, apple") == 1.0
    assert score(s, "raven, kettle, plum, pear, apple") == 0.2
    with pytest.raises(ValueError):
        in_order_score("apple", [])


def test_answers_cut_at_their_limit_are_counted_and_said():
    rows = [row("full", s, tokens=100) for s in range(6)] + [row("snapkv", s, tokens=100 - (s == 0)) for s in range(6)]
    for r in rows:
        r["max_new_tokens"] = 100
    table = R.length_table(rows)
    assert table.splitlines()[0].endswith("| end-to-end s | at max_new_tokens |")
    assert "| full (unmodified model) | - | 1.00 [0.54, 1.00] (6) | 100.0 | 1.50 | 6/6 |" in table
    assert "| 99.8 | 1.50 | 5/6 |" in table
    assert "- 11 of 12 answers compared here stopped at their max_new_tokens" in length_tables(rows)
    # Rows that do not record their limit: no column, no line (the report cannot tell).
    for r in rows:
        del r["max_new_tokens"]
    assert "max_new_tokens" not in R.length_table(rows) and "max_new_tokens" not in length_tables(rows)
