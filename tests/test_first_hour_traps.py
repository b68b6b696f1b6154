"""Issue 42, item 4: the first hour's last traps. `make test` is not in the install block and says how long it takes;
the embedded model's first-use conversion is a stage of its own and "loaded" is printed once; rule names in tables do
not break mid-word; a region filled inline never starts a line (the quick start's sentence stayed split in two);
the lm-eval message for a RULER prompt is in tests/test_lmeval.py (it needs the [lmeval] extra)."""

import re
import sys
from pathlib import Path

import yaml

from fxbudget.cli import main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_make_test_beside_the_install_says_how_long_it_takes():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", install, re.S).group(1)
    assert "pip install" in block
    line = next(x for x in block.splitlines() if x.startswith("make test"))
    assert re.search(r"optional.*~\d+ min", line), line
    paragraph = next(p for p in re.split(r"\n\s*\n", (ROOT / "docs" / "install.md").read_text())
                     if "`make test`" in p)
    assert re.search(r"about \d+ minutes", paragraph), paragraph


def test_first_use_conversion_is_not_reported_as_a_load(tmp_path, monkeypatch, capsys, no_model_load):
    import transformers

    from fxbudget.models import load as models
    from fxbudget.models.source import resolve_model

    converted = []
    monkeypatch.setattr(models, "default_cache_dir", lambda *a: tmp_path)
    monkeypatch.setattr(models, "_is_cached", lambda path: bool(converted))
    monkeypatch.setattr(models, "_convert", lambda path, progress, entry: converted.append(path))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: "the tokenizer")
    assert models.load_tokenizer(resolve_model(None)) == "the tokenizer"
    err = capsys.readouterr().err
    assert converted == [tmp_path]
    assert re.search(rf"\[fxbudget\] converted {models.DEFAULT_MODEL_NAME} once, in [\d.]+ s", err), err
    assert "loaded" not in err
    assert models.prepare_default() is False  # cached now: nothing to do, nothing printed
    assert capsys.readouterr().err == ""


def test_compare_names_the_conversion_stage_and_loads_once(tiny_dir, tmp_path, monkeypatch, capsys):
    from fxbudget.cli import preflight

    monkeypatch.setattr(preflight, "prepare_model", lambda source: True)  # as on a first use of the embedded model
    argv = ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--samples", "1",
            "--max-new-tokens", "2", "--quiet", "--rules", "full", "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    closing = next(line for line in err.splitlines() if line.startswith("[fxbudget] done in "))
    assert re.search(r"s checks \([^)]*\) \+ [\d.]+ s the embedded model's first-use conversion \+ [\d.]+ s tokenizer "
                     r"and samples \+ [\d.]+ s model load", closing), closing
    assert len(re.findall(r"^\[fxbudget\] loaded ", err, re.M)) == 1, err


def test_rule_names_in_tables_do_not_break_mid_word():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    css_files = config["extra_css"]
    css = "".join((ROOT / "docs" / f).read_text() for f in css_files)
    rule = re.search(r"table[^{]*td:first-child code\s*\{([^}]*)\}", css)
    assert rule and "white-space: nowrap" in rule.group(1), css
    # The tables' first column starts with a code span in every row (what the rule above applies to): the rules
    # table (registered names) and the table of kvpress presses left out (class names).
    rows = [line for line in (ROOT / "docs" / "rules.md").read_text().splitlines() if line.startswith("| `")]
    assert len(rows) >= 15 and all(re.match(r"\| `[A-Za-z0-9_:]+`", line) for line in rows)
    assert sum(bool(re.match(r"\| `[a-z0-9_:]+` \|", line)) for line in rows) >= 25  # every registered rule


def test_no_inline_region_starts_a_line_and_the_filler_joins_one_that_does(tmp_path, monkeypatch):
    import demo_readme

    inline = ("time", "rows", "cpu", "machine")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            m = re.match(r"<!-- (\w+) (\w+) -->", line)
            assert not (m and m.group(2) in inline), f"{path.name}: {line[:60]} starts an HTML block"
    page = tmp_path / "page.md"
    page.write_text("It took <!-- quick time -->1m<!-- /quick time --> of wall time. It used\n"
                    "<!-- quick cpu -->9m<!-- /quick cpu --> of CPU.\n")
    demo_readme.use_grid("quick")
    try:
        demo_readme.fill_readme([page])
    except SystemExit:  # the other regions are not in this page
        pass
    text = page.read_text()
    assert "It used <!-- quick cpu -->" in text and "\n<!-- quick cpu -->" not in text, text
