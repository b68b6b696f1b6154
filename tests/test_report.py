"""The Markdown report and its files on synthetic rows: the answers table, the reference row's explanation, the
context length the rows record, the warning for merged runs of unequal samples, every announced file written, the
header's device and dtype, and no import circle between the report and the plots."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxbudget.harness import report as R
from fxbudget.harness.answers import quote

ROOT = Path(__file__).resolve().parent.parent


def row(rule, sample=0, *, budget=8, score=1.0, prediction="51573.", logprob=-0.5, task="passkey", **kw):
    """One result row as the runner writes it (the fields the report reads)."""
    r = {"model": "m", "dtype": "float32", "device": "cpu", "torch": "t", "transformers": "tf", "fxbudget": "f",
         "threads": 1, "kernel_fingerprint": None if rule == "full" else "ab" * 32, "protocol": "query-agnostic",
         "chunk_size": None, "backend": "none", "task": task, "length": 1000, "n_tokens": 997, "context_tokens": 1021,
         "rule": rule, "budget": None if rule == "full" else budget, "budget_fraction": None, "score": score,
         "prediction": prediction, "answers": ["51573"], "depth": 0.25 + 0.5 * (sample % 2),
         "answer_logprob_mean": logprob, "prefill_s": 1.0, "decode_s": 1.0, "likelihood_s": 0.1,
         "output_tokens": 3, "kv_allocated_bytes": 2048, "kv_held_bytes": 1024, "compile_s": 0.0,
         "shared_prefill": False, "branch_s": None, "window": None if rule == "full" else 32, "sample": sample,
         "seed": 0, **kw}
    r["key"] = f"{r['task']}|{sample}|{rule}|{r['budget']}|{r['protocol']}"
    return r


def write_run(tmp_path: Path, rows, name="run") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_answers_table_shows_expected_and_every_rules_output():
    rows = [row("full", 0, prediction="51573."), row("snapkv", 0, score=0.0, prediction="1234567890."),
            row("streamingllm", 0, score=0.0, prediction="")]
    text = R.markdown(rows, [])
    section = text.split("### answers per sample", 1)[1]
    assert section.lstrip().startswith('<details markdown="1"><summary>expected vs each rule')
    header = next(line for line in section.splitlines() if line.startswith("| sample"))
    assert header == "| sample | expected | full (unmodified) | snapkv | streamingllm |"
    line = next(line for line in section.splitlines() if line.startswith("| passkey 1000 #0"))
    # A wrong answer and no answer both score 0, and now read differently.
    assert line == "| passkey 1000 #0, depth 0.25 | `51573` | `51573.` ✓ | `1234567890.` ✗ | *(empty)* ✗ |"
    assert "</details>" in section


def test_answers_quote_escapes_and_cuts():
    assert quote("a|b") == "`a\\|b`"
    assert quote("x\ny") == "`x⏎y`"
    assert quote("use `x`") == "`` use `x` ``"
    assert quote("7" * 50) == "`" + "7" * 40 + "…`"
    assert quote("  ") == "*(empty)*" and quote(None) == "-"


def test_answers_table_one_per_budget_and_fraction_scores():
    rows = [row("full", 0), row("snapkv", 0, budget=8, score=0.5, answers=["1", "2"]),
            row("snapkv", 0, budget=16), row("h2o", 0, budget=8), row("h2o", 0, budget=16)]
    section = R.markdown(rows, []).split("### answers per sample", 1)[1].split("### cost", 1)[0]
    assert "B=8:" in section and "B=16:" in section
    assert "`51573.` 0.50" in section  # neither all nor none of the expected answers


def test_likelihood_table_keeps_absolute_and_relative_values_in_separate_columns():
    rows = [row("full", s, logprob=-0.008) for s in range(2)] + \
           [row(rule, s, logprob=-1.0) for rule in ("snapkv", "h2o") for s in range(2)]
    table = R.likelihood_table(rows)
    lines = table.splitlines()
    assert lines[0] == "| rule | B=8: log-prob/token | B=8: Δ vs full |"
    assert "| full (unmodified model) | -0.008 (2) | — (reference) |" in lines
    # -1.0 - (-0.008): relative, in its own column; two samples bound nothing, and the cell says why in words.
    assert "| snapkv | -1.000 (2) | -0.992 (n=2: too few samples for an interval) |" in lines
    assert "abs " not in table and "inf" not in table
    assert "`log-prob/token` is absolute: the mean log-prob per gold-answer token (the unmodified model's -0.008 = " \
           "a gold token has probability 0.99 on average" in table
    assert "`log-prob/token` is absolute" not in R.likelihood_table(rows, note=False)
    # Without a reference there is nothing relative: the absolute column alone, no note.
    alone = R.likelihood_table([r for r in rows if r["rule"] != "full"])
    assert alone.splitlines()[0] == "| rule | B=8: log-prob/token |" and "Δ" not in alone


@pytest.mark.parametrize("with_reference", [True, False])
def test_compare_prints_a_likelihood_heading_naming_the_tables_columns(tmp_path, capsys, with_reference):
    from types import SimpleNamespace

    from fxbudget.cli.compare import _tables

    rows = [row(rule, s, logprob=-0.5) for rule in ("full", "snapkv") for s in range(2)
            if with_reference or rule != "full"]
    _tables(SimpleNamespace(out=write_run(tmp_path, rows), sort="accuracy"),
            SimpleNamespace(protocols=["query-agnostic"]))
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("answer log-likelihood"))
    heading, header = lines[at], next(x for x in lines[at + 1:] if x.startswith("| rule"))
    columns = [c.strip().split(": ", 1)[1] for c in header.strip("|").split("|")[1:]]
    assert columns == (["log-prob/token", "Δ vs full"] if with_reference else ["log-prob/token"])
    for column in columns:  # every column the table has, named and explained in its heading
        assert f"`{column}`: the rule" in heading
    assert ("rule minus the unmodified model" in heading) == with_reference
    assert heading.endswith(":") and "nats" in heading


def test_likelihood_intervals_appear_from_six_samples():
    rows = [row("full", s, logprob=-0.1) for s in range(6)] + \
           [row("snapkv", s, logprob=-0.5 - 0.1 * s) for s in range(6)]
    line = next(x for x in R.likelihood_table(rows).splitlines() if x.startswith("| snapkv"))
    # Six differences of one sign: the sign-flip test's interval is bounded, and inside the values' range.
    lo, hi = (float(x) for x in line.split("[")[1].split("]")[0].split(", "))
    assert -0.9 <= lo < -0.65 < hi <= -0.4 and line.endswith("(6) |")


def test_two_samples_say_they_cannot_separate_anything():
    # 2/2 against 0/2: the largest possible difference, still not separable with two samples; the report says so.
    rows = [row("full", s) for s in range(2)] + [row("snapkv", s, score=1.0) for s in range(2)] + \
        [row("streamingllm", s, score=0.0, logprob=-3.0) for s in range(2)]
    text = R.paired_tables(rows)
    assert "- by accuracy: highest mean **snapkv**; not separated from it at this sample size: streamingllm" in text
    assert "- 2 paired samples cannot separate any two of these 2 rules, whatever their scores: the paired test's " \
           "smallest possible p is 2/2^2 = 0.5, not below 0.05; separating a pair needs at least 6 paired samples" \
           in text
    assert text.count("cannot separate any two") == 1  # one sentence, not one per metric
    assert "inf" not in text
    # The same sentence under the accuracy table the CLI prints; the per-protocol section leaves it to the pairs.
    assert "cannot separate any two of these 2 rules" in R.accuracy_table(rows, by_setting=True)
    assert "cannot separate" not in R.accuracy_table(rows, note=False)


def test_three_rules_need_seven_samples_and_separable_sizes_say_nothing():
    rows = [row(rule, s, score=float(rule == "snapkv")) for rule in ("snapkv", "h2o", "tova") for s in range(6)]
    text = R.paired_tables(rows)
    # Six samples: 2/2^6 = 0.031, but Holm over two comparisons makes it 0.0625.
    assert "6 paired samples cannot separate any two of these 3 rules" in text and "Holm over the 2 comparisons " \
           "with the top: 0.0625" in text and "needs at least 7 paired samples" in text
    seven = [row(rule, s, score=float(rule == "snapkv")) for rule in ("snapkv", "h2o", "tova") for s in range(7)]
    text = R.paired_tables(seven)
    assert "cannot separate" not in text and "cannot separate" not in R.accuracy_table(seven)
    assert "- by accuracy: best **snapkv**, separated from every other rule (Holm p < 0.05)" in text


def test_best_is_never_named_among_tied_rules():
    rows = [row(rule, s, score=1.0 if rule != "h2o" else float(s % 2)) for rule in ("snapkv", "tova", "h2o")
            for s in range(4)]
    text = R.paired_tables(rows)
    assert "best **" not in text
    assert "- by accuracy: no single best: snapkv, tova share the highest mean (1.00)" in text
    assert "| snapkv | 1.00 [0.40, 1.00] | top (tied) |" in text
    assert "every rule has the same mean (1.00): no best" in R.paired_tables(
        [row(rule, s) for rule in ("snapkv", "tova") for s in range(3)])


def test_csv_files_hold_no_infinite_bound_and_say_why(tmp_path):
    d = write_run(tmp_path, [row("full", s, logprob=-0.1) for s in range(2)] +
                  [row(rule, s, logprob=-1.0 - s) for rule in ("snapkv", "h2o") for s in range(2)])
    R.report([d])
    for name in ("summary.csv", "paired.csv"):
        assert "inf" not in (d / name).read_text(), name
    summary = {x["rule"]: x for x in csv.DictReader((d / "summary.csv").open())}
    assert summary["snapkv"]["logprob_delta_lo"] == "" and \
        summary["snapkv"]["logprob_delta_interval"] == "n=2: too few samples for an interval"
    paired = [x for x in csv.DictReader((d / "paired.csv").open()) if x["metric"] == "likelihood" and
              x["rule"] != x["top"]]
    assert paired and all(x["diff_lo"] == "" and x["diff_interval"].startswith("n=2") for x in paired)
    assert "inf" not in (d / "report.md").read_text()


def test_task_heading_gives_the_context_length_the_rows_record():
    rows = [row("full", 0), row("snapkv", 0), row("full", 1, context_tokens=1023), row("snapkv", 1,
                                                                                       context_tokens=1023)]
    text = R.markdown(rows, [])
    assert "### passkey (context 1021-1023 tokens before the question, chat template included)" in text
    assert "997" not in text.split("## protocol", 1)[1].split("### answers", 1)[0]
    old = [{k: v for k, v in r.items() if k != "context_tokens"} for r in rows]  # rows written before the field
    assert "### passkey (context 997 tokens)" in R.markdown(old, [])


def test_merged_runs_of_unequal_samples_are_warned_with_counts():
    equal = [row(rule, s) for rule in ("full", "snapkv", "streamingllm") for s in range(3)]
    assert "warning" not in R.markdown(equal, [])
    unequal = [row(rule, s) for rule in ("full", "snapkv") for s in range(3)] + [row("streamingllm", 0)]
    text = R.markdown(unequal, [])
    assert "**warning: the rules did not all run the same samples**" in text
    assert "samples per rule: query-agnostic: full 3, snapkv 3, streamingllm 1." in text
    by_budget = equal + [row("snapkv", 0, budget=16)]
    assert "snapkv 3 (B=8), 1 (B=16)" in R.markdown(by_budget, [])


def test_unequal_samples_warned_by_fxbudget_report_merge(tmp_path):
    a = write_run(tmp_path, [row(rule, s) for rule in ("full", "snapkv") for s in range(3)], "a")
    b = write_run(tmp_path, [row("streamingllm", 0)], "b")
    text = R.report([a, b], tmp_path / "merged").read_text()
    assert "full 3, snapkv 3, streamingllm 1" in text


def test_every_announced_file_is_written_with_one_budgeted_rule(tmp_path):
    # full + snapkv: nothing to compare pairwise, yet `compare` announces paired.csv: it is written, header only.
    d = write_run(tmp_path, [row("full", s) for s in range(2)] + [row("snapkv", s) for s in range(2)])
    path = R.report([d])
    for name in ("report.md", "summary.csv", "paired.csv", "accuracy_vs_budget.png", "likelihood_vs_budget.png"):
        assert (d / name).is_file(), name
    with (d / "paired.csv").open() as f:
        reader = csv.reader(f)
        assert tuple(next(reader)) == R.PAIRED_FIELDS
        assert list(reader) == []
    assert "paired comparisons: none (they need two budgeted rules" in path.read_text()


def test_paired_csv_rows_when_two_rules_compare(tmp_path):
    d = write_run(tmp_path, [row(rule, s, score=float(rule == "snapkv")) for rule in ("full", "snapkv", "h2o")
                             for s in range(3)])
    R.report([d])
    lines = list(csv.DictReader((d / "paired.csv").open()))
    assert {(x["task"], x["metric"], x["rule"]) for x in lines} >= {("all", "accuracy", "snapkv"),
                                                                      ("all", "accuracy", "h2o")}
    assert all(x["top"] == "snapkv" and x["top_tied"] == "False" for x in lines if x["metric"] == "accuracy")


@pytest.mark.parametrize("field,values,expected", [
    ("device", ["cpu"], "- model: m; device: cpu; dtype: float32; torch t,"),
    ("device", ["cpu", "cuda:0"], "- model: m; device: **2 different (cpu, cuda:0)**; dtype: float32;"),
    ("dtype", ["bfloat16", "float32"], "- model: m; device: cpu; dtype: **2 different (bfloat16, float32)**;"),
])
def test_header_shows_device_and_dtype_of_every_row(field, values, expected):
    rows = [row(rule, s, **{field: values[s % len(values)]}) for rule in ("full", "snapkv") for s in range(2)]
    assert expected in R.markdown(rows, [])


def test_report_and_plots_do_not_import_each_other():
    # One way only: the report calls the plots; the plots read the shared grouping helpers, never the report.
    source = (ROOT / "fxbudget" / "harness" / "plots.py").read_text()
    assert "from .report import" not in source and "harness.report" not in source
    code = "import sys, fxbudget.harness.plots; print('fxbudget.harness.report' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["report", "plots", "stats", "tables", "answers", "grouping"])
def test_report_modules_stay_under_400_lines(name):
    assert len((ROOT / "fxbudget" / "harness" / f"{name}.py").read_text().splitlines()) < 400


def test_search_verdict_prints_no_infinite_interval_and_no_best_among_ties():
    from fxbudget.harness.search.verdict import verdict

    # Two held-out samples: the likelihood difference has no interval; the verdict says why.
    rows = [row("found", s, logprob=-0.1) for s in range(2)] + [row("snapkv", s, logprob=-0.9) for s in range(2)]
    beats, text = verdict(rows, "found", "likelihood")
    assert beats is False and "inf" not in text and "(n=2: too few samples for an interval)" in text
    # The searched rule ties with a built-in one at the top: it beats nothing, and no built-in rule is "the best".
    tied = [row(rule, s, score=1.0) for rule in ("found", "snapkv") for s in range(3)] + \
        [row("knorm", s, score=0.0) for s in range(3)]
    beats, text = verdict(tied, "found", "accuracy")
    assert beats is False and "shares the best mean (1.00) with snapkv" in text
    below = [row("snapkv", s, score=1.0) for s in range(3)] + [row("tova", s, score=1.0) for s in range(3)] + \
        [row("found", s, score=0.0) for s in range(3)]
    beats, text = verdict(below, "found", "accuracy")
    assert beats is False and "one of the built-in rules sharing the best mean (snapkv, tova)" in text
