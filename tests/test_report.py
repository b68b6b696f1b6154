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


def test_reference_row_is_explained_under_the_likelihood_table():
    rows = [row("full", s, logprob=-0.008) for s in range(2)] + \
           [row(rule, s, logprob=-1.0) for rule in ("snapkv", "h2o") for s in range(2)]
    table = R.likelihood_table(rows)
    assert "| full (unmodified model) | abs -0.008 (2) |" in table
    assert "The `full` row is not a difference: it is the unmodified model's own mean log-prob per answer token " \
           "(`abs -0.008` = a gold token has probability 0.99 on average" in table
    assert "| snapkv | -0.992 [-inf, inf] (2) |" in table
    assert "The `full` row" not in R.likelihood_table(rows, note=False)
    # Without a reference there is nothing to explain.
    assert "The `full` row" not in R.likelihood_table([r for r in rows if r["rule"] != "full"])


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
    assert all(x["best"] == "snapkv" for x in lines if x["metric"] == "accuracy")


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
