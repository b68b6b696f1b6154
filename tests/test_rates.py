"""The start estimate calibrated on this machine (issue 42): a finished `compare` records its measured rate, the
next run's estimate reads it (`fxbudget.cli.rates`)."""

import json
import re

import pytest

from fxbudget.cli import rates
from fxbudget.cli.rates import Calibration


def test_calibration_is_the_median_factor_and_the_latest_fixed_seconds(tmp_path):
    f = tmp_path / "rates.jsonl"
    assert rates.calibration("k", f) is None
    for formula, rows_s, fixed in ((10, 20, 30), (10, 40, 5), (10, 30, 7)):
        rates.record("k", formula, rows_s, fixed, rows=3, file=f)
    rates.record("other", 10, 1000, 1000, rows=3, file=f)
    f.write_text(f.read_text() + "not json\n")  # a cut line is skipped
    c = rates.calibration("k", f)
    assert c == Calibration(factor=3.0, fixed=7.0, runs=3)
    assert c.new(["snapkv"]) == ["snapkv"] and c.seconds(20, ["snapkv"]) == c.seconds(20)  # no trace measured
    assert c.seconds(20) == pytest.approx(7 + 3 * 20)
    for _ in range(rates.KEEP):  # only the last KEEP entries count
        rates.record("k", 10, 10, 1, rows=3, file=f)
    assert rates.calibration("k", f) == Calibration(factor=1.0, fixed=1.0, runs=rates.KEEP)


def test_fingerprints_are_counted_only_for_rules_no_earlier_run_traced(tmp_path):
    f = tmp_path / "rates.jsonl"
    rates.record("k", 10, 20, 5, rows=4, file=f, trace_s=30.0, rules=rates.rule_ids(
        ["full", "snapkv", "h2o"], {"h2o": {"recent_ratio": 0.25}}))
    rates.record("k", 10, 20, 4, rows=4, file=f, trace_s=None, rules=["snapkv"])  # all cached: no new trace time
    c = rates.calibration("k", f)
    assert c.traced == {"snapkv", 'h2o{"recent_ratio": 0.25}'} and c.trace == 30.0 and c.fixed == 4
    assert c.new(rates.rule_ids(["full", "snapkv", "h2o", "tova"], {})) == ["h2o", "tova"]
    assert c.seconds(10, ["snapkv", "tova"]) == pytest.approx(4 + 2 * 10 + 30)


def test_estimate_line_names_new_fingerprints_only_with_a_measured_trace():
    from fxbudget.cli import sizes
    from fxbudget.harness.grid import Grid, Unit
    from fxbudget.harness.tasks import Sample

    grid = Grid(tasks=["passkey"], lengths=[300], rules=["full", "snapkv"], budgets=[32], samples=1)
    sample = Sample("passkey", "c", "q", ["1"], max_new_tokens=5)
    plan = [(Unit("passkey", 300, 0), [("query-agnostic", "full", None), ("query-agnostic", "snapkv", 32)])]
    args = (grid, plan, {("passkey", 300): [sample]}, [(("passkey", 300), sample, 100, 10, 3)], None, "cuda:0", None)
    timed = sizes.estimate_line(*args, Calibration(2.0, 10.0, 1, 30.0, frozenset()), ["snapkv"])
    assert "plus 10 s of model load and report, 30 s tracing 1 new kernel fingerprint)" in timed
    untimed = sizes.estimate_line(*args, Calibration(2.0, 10.0, 1, 0.0, frozenset()), ["snapkv"])
    assert "plus 10 s of model load and report; 1 new kernel fingerprint not included: no earlier run timed one)" \
        in untimed
    cached = sizes.estimate_line(*args, Calibration(2.0, 10.0, 1, 30.0, frozenset({"snapkv"})), ["snapkv"])
    assert cached.endswith("plus 10 s of model load and report)") and "estimated " in cached  # on a GPU too


def test_an_unwritable_rates_file_is_a_warning(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")
    rates.record("k", 1, 1, 1, rows=1, file=blocked / "rates.jsonl")
    assert "could not record this run's rate" in capsys.readouterr().err


def test_second_run_is_estimated_from_the_first(tiny_dir, tmp_path, capsys, shared_fingerprints):
    from fxbudget.cli import main

    small = ["--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--samples", "1", "--max-new-tokens",
             "2", "--quiet", "--rules", "full,snapkv", "--budgets", "32"]
    assert main(["compare", *small, "--out", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().err
    assert "on the reference machine, not this one" in first and "the next run on this machine is calibrated" in first
    (entry,) = [json.loads(line) for line in rates.path().read_text().splitlines()]
    assert entry["key"].endswith("|cpu|float32|" + entry["key"].split("|")[3] + "|eager")
    assert entry["rows"] == 2 and entry["formula_s"] > 0 and entry["rows_s"] > 0 and entry["fixed_s"] > 0
    assert main(["compare", *small, "--out", str(tmp_path / "b")]) == 0
    second = capsys.readouterr().err
    assert entry["rules"] == ["snapkv"]
    want = Calibration(entry["rows_s"] / entry["formula_s"], entry["fixed_s"], 1).seconds(entry["formula_s"])
    m = re.search(r"; estimated (\d+) s to the end \(calibrated on this machine's last 1 run of this model, device, "
                  r"dtype, threads and backend: rows at [\d.e+-]+x the quick start's time per token, plus \d+ s of "
                  r"model load and report\)", second)
    assert m, second
    assert int(m.group(1)) == max(1, round(want))
