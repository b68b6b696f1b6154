"""Kernel fingerprints cached on disk (`fxbudget.fairness.fingerprint_store`): served again for the same model, rule, code and
versions; traced again when any of them changes, when an entry is damaged, and never from a half-written file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fxbudget
from conftest import COMMON, tiny_model
from fxbudget.fairness import fingerprint_store as fc
from fxbudget.cli import main
from fxbudget.harness import runner
from fxbudget.harness.report import load_rows
from fxbudget.rules import Rule, get, load_file, register


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    """Every test on its own empty FXBUDGET_CACHE (the entries go to `<it>/fingerprints`)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FXBUDGET_CACHE", str(root))
    return root


class Counting:
    """A `compute` for `cached_kernel_fingerprint` that counts its calls (the real trace, or a fixed value)."""

    def __init__(self, value: str | None = None):
        self.calls, self.value = 0, value

    def __call__(self, model, **kwargs):
        self.calls += 1
        return self.value if self.value is not None else fxbudget.kernel_fingerprint(model, **kwargs)


def _entries(root: Path) -> list[Path]:
    return sorted((root / "fingerprints").glob("*"))


def test_second_fingerprint_is_read_from_the_cache(cache_root):
    model = tiny_model("qwen2")
    compute = Counting()
    first = fc.cached_kernel_fingerprint(model, "snapkv", budget=64, compute=compute)
    assert first == (fxbudget.kernel_fingerprint(model, rule="snapkv", budget=64), False)  # the real value, traced
    [entry] = _entries(cache_root)
    assert json.loads(entry.read_text())["fingerprint"] == first[0]
    assert fc.cached_kernel_fingerprint(model, "snapkv", budget=64, compute=compute) == (first[0], True)
    # Weights are not part of it: the same architecture with other weights reads the same entry.
    assert fc.cached_kernel_fingerprint(tiny_model("qwen2", seed=1), "snapkv", budget=64, compute=compute) == \
        (first[0], True)
    assert compute.calls == 1


def test_source_digest_sees_the_kernel_not_the_report(tmp_path):
    copy = tmp_path / "fxbudget"
    shutil.copytree(fc.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    base = fc.source_digest(copy)
    assert base == fc.source_digest(fc.PACKAGE)
    report = copy / "harness" / "report.py"
    report.write_text(report.read_text() + "\n# a report change\n")
    assert fc.source_digest(copy) == base  # the harness is not traced: its edits keep the entries
    kernel = copy / "kernel" / "measure.py"
    kernel.write_text(kernel.read_text() + "\n# a kernel change\n")
    changed = fc.source_digest(copy)
    assert changed != base
    (copy / "passes" / "new_pass.py").write_text("X = 1\n")  # a new file counts too
    assert fc.source_digest(copy) not in (base, changed)


# Run in a fresh process on a copy of the package whose kernel's measure phase differs (`out * 1.0`, the change
# test_graph shows the fingerprint sees): the same key but for the code, so a new entry and a new value.
_CHANGED_KERNEL = """
_fxbudget_test_measure = measure


def measure(*args, **kwargs):
    out, *rest = _fxbudget_test_measure(*args, **kwargs)
    return (out * 1.0, *rest)
"""
_SCRIPT = """
import json, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
import fxbudget
from fxbudget.fairness import fingerprint_store as fc
from fxbudget.rules import get as get_rule
torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **json.loads(sys.argv[1]))).eval()
value, cached = fc.cached_kernel_fingerprint(model, "snapkv", budget=64)
print(json.dumps({"file": fxbudget.__file__, "value": value, "cached": cached,
                  "source": fc.fingerprint_key(model, get_rule("snapkv"), 64, None)["fxbudget_source"],
                  "modules": sorted(m for m in sys.modules if m.startswith("fxbudget."))}))
"""


def test_a_changed_kernel_file_is_traced_again_with_a_new_value(tmp_path, cache_root):
    model = tiny_model("qwen2")
    original, cached = fc.cached_kernel_fingerprint(model, "snapkv", budget=64)
    assert not cached
    site = tmp_path / "site"
    shutil.copytree(fc.PACKAGE, site / "fxbudget", ignore=shutil.ignore_patterns("__pycache__"))
    kernel = site / "fxbudget" / "kernel" / "measure.py"
    assert "def measure(" in kernel.read_text()
    kernel.write_text(kernel.read_text() + _CHANGED_KERNEL)
    env = {**os.environ, "PYTHONPATH": str(site), "FXBUDGET_CACHE": str(cache_root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(COMMON)], cwd=site, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).resolve().parent == (site / "fxbudget").resolve()  # the changed copy ran
    assert out["source"] != fc.source_digest()
    assert not out["cached"] and out["value"] != original  # traced again: the changed kernel's own value
    assert len(_entries(cache_root)) == 2
    # The kernel's import graph reaches none of the subpackages the source digest leaves out.
    assert not [m for m in out["modules"] if m.split(".")[1] in fc.NOT_TRACED]
    # The unchanged code still reads its own entry.
    assert fc.cached_kernel_fingerprint(model, "snapkv", budget=64) == (original, True)


@pytest.mark.parametrize("damage", ["truncated", "empty", "not json", "another key", "not a fingerprint"])
def test_a_damaged_entry_is_traced_again(cache_root, damage):
    model = tiny_model("qwen2")
    compute = Counting("ab" * 32)
    assert fc.cached_kernel_fingerprint(model, "tova", budget=64, compute=compute) == ("ab" * 32, False)
    [entry] = _entries(cache_root)
    text = entry.read_text()
    data = json.loads(text)
    if damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "empty":
        entry.write_text("")
    elif damage == "not json":
        entry.write_bytes(b"\x00\xff" * 10)
    elif damage == "another key":
        entry.write_text(json.dumps({**data, "key": {**data["key"], "budget": 65}}))
    else:
        entry.write_text(json.dumps({**data, "fingerprint": "0" * 63}))
    assert fc.cached_kernel_fingerprint(model, "tova", budget=64, compute=compute) == ("ab" * 32, False)
    assert compute.calls == 2
    assert json.loads(entry.read_text())["fingerprint"] == "ab" * 32  # rewritten whole
    assert fc.cached_kernel_fingerprint(model, "tova", budget=64, compute=compute) == ("ab" * 32, True)


def test_a_write_cut_short_leaves_no_entry(cache_root, monkeypatch):
    model = tiny_model("qwen2")

    def killed(fd):
        raise KeyboardInterrupt  # as if the process were stopped between writing and renaming

    monkeypatch.setattr(fc.os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        fc.cached_kernel_fingerprint(model, "tova", budget=64, compute=Counting("cd" * 32))
    assert _entries(cache_root) == []  # neither the entry nor its temporary file
    monkeypatch.undo()
    monkeypatch.setenv("FXBUDGET_CACHE", str(cache_root))
    assert fc.cached_kernel_fingerprint(model, "tova", budget=64, compute=Counting("cd" * 32)) == ("cd" * 32, False)


def test_an_unwritable_cache_still_gives_the_fingerprint(cache_root, caplog):
    cache_root.mkdir()
    (cache_root / "fingerprints").write_text("a file where the folder should be")
    compute = Counting("ef" * 32)
    assert fc.cached_kernel_fingerprint(tiny_model("qwen2"), "tova", budget=64, compute=compute) == ("ef" * 32, False)
    assert "could not cache the kernel fingerprint" in caplog.text


def _key(model, rule="snapkv", budget=64, head_pool=None, **params):
    return fc.entry_path(fc.fingerprint_key(model, get(rule, **params), budget, head_pool))


def test_the_key_holds_what_the_fingerprint_depends_on():
    model = tiny_model("qwen2")
    base = _key(model)
    assert _key(tiny_model("qwen2", seed=3)) == base  # other weights, same architecture
    others = {
        "rule": _key(model, "tova"),
        "rule hyperparameter": _key(model, window=8),
        "wrapper": _key(model, "adakv:snapkv"),
        "wrapped rule": _key(model, "adakv:tova"),
        "budget": _key(model, budget=65),
        "layout": _key(model, head_pool=True),
        "architecture": _key(tiny_model("qwen2", layers=3)),
        "model class": _key(tiny_model("llama")),
        "dtype": _key(tiny_model("qwen2").to(torch.bfloat16)),
        "device": _key(tiny_model("qwen2").to("meta")),
        "mode": _key(tiny_model("qwen2").train()),
    }
    assert all(others.values()), [k for k, v in others.items() if not v]
    assert len({base, *others.values()}) == 1 + len(others), others


_RULE_FILE = """
from dataclasses import dataclass
from fxbudget.rules import Rule, register


@register("cached_probe_rule")
@dataclass
class Probe(Rule):
    def score(self, s):
        return {body}
"""


def test_a_rule_file_is_keyed_by_its_source(tmp_path):
    model = tiny_model("qwen2")
    path = tmp_path / "my_rule.py"
    path.write_text(_RULE_FILE.format(body="s.key_norm"))
    load_file(path)
    first = _key(model, "cached_probe_rule")
    path.write_text(_RULE_FILE.format(body="-s.key_norm"))
    assert _key(model, "cached_probe_rule") == first  # the rule that runs is still the one loaded
    load_file(path)
    assert _key(model, "cached_probe_rule") != first


def test_source_edited_during_a_run_is_not_cached(cache_root, monkeypatch):
    # As if a file had been edited after fxbudget was imported: the code that runs is not the code on disk.
    monkeypatch.setattr(fc, "_IMPORTED_SOURCE", "0" * 64)
    compute = Counting("34" * 32)
    for _ in range(2):
        assert fc.cached_kernel_fingerprint(tiny_model("qwen2"), "tova", budget=64, compute=compute) == \
            ("34" * 32, False)
    assert compute.calls == 2 and _entries(cache_root) == []


def test_code_without_a_source_file_is_traced_every_time(cache_root):
    namespace = {"register": register}
    exec("@register('typed_in_rule')\ndef typed(s):\n    return s.key_norm\n", namespace)  # as typed into a REPL
    compute = Counting("12" * 32)
    for _ in range(2):
        assert fc.cached_kernel_fingerprint(tiny_model("qwen2"), "typed_in_rule", budget=64, compute=compute) == \
            ("12" * 32, False)
    assert compute.calls == 2 and _entries(cache_root) == []


def test_compare_rows_say_whether_the_fingerprint_was_cached(tiny_dir, tmp_path, monkeypatch):
    calls = []
    real = runner.kernel_fingerprint
    monkeypatch.setattr(runner, "kernel_fingerprint", lambda *a, **k: calls.append(k["rule"].name) or real(*a, **k))
    grid = ["--tasks", "passkey", "--lengths", "300", "--rules", "full,snapkv,tova", "--budgets", "48",
            "--samples", "1", "--max-new-tokens", "4", "--quiet"]
    runs = []
    for name in ("first", "second"):
        assert main(["compare", "--model", tiny_dir, *grid, "--out", str(tmp_path / name)]) == 0
        runs.append({r["rule"]: r for r in load_rows([tmp_path / name])})
    assert sorted(calls) == ["snapkv", "tova"]  # traced by the first run only
    for rule in ("snapkv", "tova"):
        assert runs[0][rule]["fingerprint_cached"] is False and runs[1][rule]["fingerprint_cached"] is True
        assert runs[1][rule]["kernel_fingerprint"] == runs[0][rule]["kernel_fingerprint"]
    assert runs[0]["full"]["fingerprint_cached"] is None and runs[1]["full"]["fingerprint_cached"] is None


def test_inspect_reads_the_fingerprint_compare_cached(tiny_dir, tmp_path, monkeypatch, capsys):
    from fxbudget.fairness import graph_summary

    calls = []
    real = graph_summary.kernel_fingerprint
    monkeypatch.setattr(graph_summary, "kernel_fingerprint", lambda *a, **k: calls.append(k) or real(*a, **k))
    argv = ["inspect", "--model", tiny_dir, "--rule", "snapkv", "--budget", "16", "--tokens", "8"]
    printed = []
    for _ in range(2):
        assert main(argv) == 0
        [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("# kernel fingerprint")]
        printed.append(line)
    assert len(calls) == 1  # traced by the first run only
    value = printed[0].split(": ", 1)[1].split(" ")[0]
    assert printed[0].endswith(f"{value} (traced)")
    assert printed[1] == f"# kernel fingerprint (rule ops masked): {value} (read from the cache in " \
        f"{fc.cache_dir()})"
    # The entry is the one a compare row at the same budget reads, and holds the value traced from scratch.
    from fxbudget.models import load_model

    model, _, _ = load_model(tiny_dir, progress=False)
    assert fc.cached_kernel_fingerprint(model, "snapkv", budget=16, compute=Counting("00" * 32)) == (value, True)
    assert value == real(model, rule="snapkv", budget=16)


@dataclass
class _Weighted(Rule):
    weights: torch.Tensor = None

    def score(self, s):
        return s.key_norm


def test_a_tensor_hyperparameter_is_keyed_by_its_values():
    a, b = torch.zeros(5000), torch.zeros(5000)
    b[2500] = 1.0
    assert repr(a) == repr(b)  # the repr elides the middle: it would not tell them apart
    model = tiny_model("qwen2")
    assert fc.entry_path(fc.fingerprint_key(model, _Weighted(a), 64, None)) != \
        fc.entry_path(fc.fingerprint_key(model, _Weighted(b), 64, None))
    assert fc.entry_path(fc.fingerprint_key(model, _Weighted(a), 64, None)) == \
        fc.entry_path(fc.fingerprint_key(model, _Weighted(a.clone()), 64, None))


_KEY_SCRIPT = """
import json, sys
import torch._dynamo.config as dynamo_config
from transformers import Qwen2Config, Qwen2ForCausalLM
from fxbudget.fairness import fingerprint_store as fc
from fxbudget.rules import get
model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **json.loads(sys.argv[1]))).eval()
sets = [k for k, v in sorted(dynamo_config.get_config_copy().items()) if isinstance(v, (set, frozenset))]
print(json.dumps({"path": fc.entry_path(fc.fingerprint_key(model, get("snapkv"), 64, None)).name,
                  "orders": [repr(dynamo_config.get_config_copy()[k]) for k in sets]}))
"""


def test_the_key_is_the_same_in_every_process():
    # Python orders a set by its hash seed, which differs between processes: Dynamo's settings hold sets.
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", _KEY_SCRIPT, json.dumps(COMMON)], env=env, capture_output=True,
                              text=True, timeout=600, cwd=fc.PACKAGE.parent)
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert outs[0]["orders"] != outs[1]["orders"]  # the two seeds do order Dynamo's sets differently
    assert outs[0]["path"] == outs[1]["path"] == _key(tiny_model("qwen2")).name
