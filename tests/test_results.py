"""Result files survive a killed run: a cut last line is reported and redone, never fatal, never glued to a new row."""

import json
import logging
from types import SimpleNamespace

import pytest

from conftest import tiny_model
from fxbudget.harness import results
from fxbudget.harness.report import load_rows
from fxbudget.harness.runner import Grid, Runner


def _rows(*keys):
    return "".join(json.dumps({"key": k, "score": 1.0}) + "\n" for k in keys)


def _runner(out):
    return Runner(tiny_model("qwen2"), SimpleNamespace(eos_token_id=None), "tiny", Grid(), out, progress=False)


def test_cut_last_line_is_left_out_and_repaired(tmp_path, caplog):
    path = tmp_path / "results.jsonl"
    path.write_text(_rows("a", "b", "c") + '{"key": "d", "prediction": "th')  # killed while writing row d
    with caplog.at_level(logging.WARNING, logger="fxbudget"):
        assert _runner(tmp_path).done_keys() == {"a", "b", "c"}  # d is not done: it runs again
        assert [r["key"] for r in load_rows([tmp_path])] == ["a", "b", "c"]
    assert "line 4 is cut short" in caplog.text
    results.repair(path)
    assert path.read_text() == _rows("a", "b", "c")
    with path.open("a") as f:
        results.append_row(f, {"key": "d", "score": 0.0})
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == ["a", "b", "c", "d"]


def test_complete_row_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(_rows("a") + json.dumps({"key": "b"}))  # killed between the row and its newline
    assert [r["key"] for r in results.read_rows(path)] == ["a", "b"]
    results.repair(path)
    with path.open("a") as f:
        results.append_row(f, {"key": "c"})
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


def test_bad_inner_line_is_an_error(tmp_path):
    (tmp_path / "results.jsonl").write_text(_rows("a") + '{"key": "b", "sc\n' + _rows("c"))
    with pytest.raises(ValueError, match=r"results.jsonl:2: not a result row"):
        _runner(tmp_path).done_keys()
    with pytest.raises(ValueError, match=r"results.jsonl:2: not a result row"):
        load_rows([tmp_path])
