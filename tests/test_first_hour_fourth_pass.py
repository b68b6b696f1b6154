"""Issue 55, items 5 and 6: the smaller traps of the first hour, each checked against what it describes: the
README's install block installs the CPU torch before the package, docs/install.md lists every command the CLI has,
the Makefile's comment on the torch floor is pyproject's, and `make demo` says before it reinstalls a venv."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_install_block_takes_the_cpu_torch_before_the_package():
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", install, re.S).group(1).splitlines()
    torch_line = next(i for i, x in enumerate(block) if x.startswith("pip install torch ") and "whl/cpu" in x)
    package_line = next(i for i, x in enumerate(block) if x.startswith("pip install -e"))
    assert torch_line < package_line, block


def test_install_lists_every_command():
    from fxbudget.cli.parser import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    listed = re.search(r"fxbudget --help +# the commands: (.*)", (ROOT / "docs" / "install.md").read_text()).group(1)
    assert sorted(listed.replace(" ", "").split(",")) == sorted(sub.choices)


def test_the_makefile_says_the_torch_floor_pyproject_declares():
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    said = re.findall(r"torch>=(\d+(?:\.\d+)*)", (ROOT / "Makefile").read_text())
    assert said and set(said) == {floor}, said


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_demo_says_it_installs_pinned_versions_before_it_does(tmp_path):
    plan = subprocess.run(["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    notice = plan.index("packages already there are changed to those versions")
    assert notice < plan.index("-m venv") < plan.index("pip install")
    assert "constraints.txt" in plan[:notice]


def test_the_uncalibrated_estimate_names_the_machine_its_rates_come_from():
    import json

    from fxbudget.cli import sizes

    wall = json.loads((ROOT / "docs" / "quickstart" / "wall.json").read_text())
    words = sizes.REFERENCE_MACHINE.split()
    assert f"{wall['cores']}-core" in words and "Xeon" in wall["cpu"] and "Xeon" in words, (wall, words)
    assert ("AVX-512" in sizes.REFERENCE_MACHINE) == ("AVX512" in wall["cpu"])
    assert wall["torch_threads"] == 1


def test_the_printed_quick_command_is_the_measured_one():
    # Issue 55: the README's time was measured with OMP_NUM_THREADS=1, which the printed command left out.
    import json

    wall = json.loads((ROOT / "docs" / "quickstart" / "wall.json").read_text())
    for page in ("README.md", "docs/quick-start.md"):
        text = (ROOT / page).read_text()
        block = text.split("<!-- quick command -->", 1)[1].split("<!-- /quick command -->", 1)[0]
        printed = " ".join(block.replace("\\\n", " ").strip().strip("`").split())
        assert printed == wall["command"], (page, printed)
        machine = text.split("<!-- quick machine -->", 1)[1].split("<!-- /quick machine -->", 1)[0]
        assert f"{wall['cores']}-core {wall['cpu']}" in machine, (page, machine)


def test_a_long_generate_says_what_it_does(monkeypatch, capsys):
    # Issue 55: the README's Python example was silent for 87 s after its model load (prefill, then decoding).
    import torch

    import fxbudget
    from conftest import tiny_model
    from fxbudget.compiler import progress

    monkeypatch.setattr(progress, "PREFILL_TOKENS", 40)
    ids = torch.randint(3, 96, (1, 60))
    ticks = iter(range(0, 10_000, 4))  # each clock read 4 s after the last: a decode line every third step
    monkeypatch.setattr(progress.time, "perf_counter", lambda: float(next(ticks)))
    model = fxbudget.compile(tiny_model(), rule="snapkv", budget=64, backend=None)
    model.generate(ids, max_new_tokens=7, do_sample=False, min_new_tokens=7)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"[fxbudget] prefill: {ids.shape[1]} tokens through snapkv at budget 64 ..."
    assert lines[1] == "[fxbudget] prefill done in 4.0 s"
    assert lines[2].startswith("[fxbudget] decoding: 3 steps in ") and lines[3].startswith("[fxbudget] decoding: 6 ")
    assert len(lines) == 4
    model.forward.restore()
    quiet = fxbudget.compile(tiny_model(), rule="snapkv", budget=64, backend=None, progress=False)
    quiet.generate(ids, max_new_tokens=3, do_sample=False)
    assert capsys.readouterr().err == ""


def test_the_gpu_pages_agree_on_what_ran():
    # Issue 55: docs/gpu.md said an H200 ran the prepared run and, further down, that no GPU had run fxbudget; that
    # the flex form was no longer the default while settings.AUTO_FORM made it CUDA's; its hub example used the
    # Inductor backend, whose prefill never finished compiling there.
    from fxbudget.kernel.settings import AUTO_FORM

    gpu, internals = ((ROOT / "docs" / p).read_text() for p in ("gpu.md", "gpu-internals.md"))
    for text in (gpu, internals):
        assert "No GPU has run" not in text and "no longer the default" not in text
    assert AUTO_FORM["cuda"] == "flex" and "takes its flex form by default" in gpu
    hub = gpu.split("## A model from the Hugging Face hub", 1)[1].split("```", 2)[1]
    assert "fxbudget compare --model" in hub and "--backend inductor" not in hub
    assert "its prefill not yet" in gpu  # where the compiled kernel is named, what was not timed is said
    assert len(gpu.splitlines()) <= 160  # the short page; the internals have their own


def test_a_call_that_feeds_held_tokens_again_is_named():
    # Issue 55, item 1: assisted generation over a prefilled cache re-feeds the whole prompt; the refusal said only
    # that position_ids must continue the rows' positions.
    import torch

    import fxbudget
    from conftest import tiny_model

    model = fxbudget.compile(tiny_model(), rule="snapkv", budget=64, backend=None, progress=False)
    ids = torch.randint(3, 96, (1, 30))
    cache = model.forward.new_cache(1)
    model(ids[:, :20], cache=cache)
    with pytest.raises(ValueError, match=r"^position_ids restart at positions the cache already holds: .* pass only "
                                         r"the new tokens"):
        model(ids, cache=cache, position_ids=torch.arange(30)[None])
    with pytest.raises(ValueError, match=r"^position_ids must continue each row's positions"):  # a gap, not a re-feed
        model(ids[:, 20:], cache=cache, position_ids=torch.arange(21, 31)[None])
    model.forward.restore()
