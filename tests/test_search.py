"""`fxbudget search` end to end on a tiny random model: the study, the written rule file (registered, the trial's
score reproduced, the shared kernel), the held-out comparison and its verdict, resume, and the rule-file loader."""

import re
import sys

import pytest
import torch

import fxbudget
from fxbudget import rules
from fxbudget.cli import main
from fxbudget.harness import search as S
from fxbudget.harness.report import load_rows
from fxbudget.models import load_model

from conftest import registry_restored

# One tiny model throughout: the baselines' fingerprints (snapkv, knorm) are traced once, not once per run.
pytestmark = pytest.mark.usefixtures("shared_fingerprints")

ARGS = ["--tasks", "passkey", "--lengths", "300", "--samples", "2", "--budget", "64", "--rules", "snapkv,knorm",
        "--holdout-samples", "2", "--max-new-tokens", "4", "--quiet"]


@pytest.fixture(scope="module", autouse=True)
def _registry_as_before():
    """Rules registered by the rule files loaded here leave with this module: other test files list every
    registered rule (e.g. test_cross_device's grid), and xdist runs them in the same process."""
    with registry_restored():
        yield


def run_search(tiny_dir, out, trials, *extra):
    assert main(["search", "--model", tiny_dir, *ARGS, "--trials", str(trials), "--out", str(out), *extra]) == 0


def trials_of(out):
    import optuna

    study = optuna.load_study(study_name=S.STUDY, storage=f"sqlite:///{out / 'study.db'}")
    return study, S.complete_trials(study)


@pytest.fixture(scope="module")
def searched(_registry_as_before, tiny_dir, tmp_path_factory):  # registry restored after it
    out = tmp_path_factory.mktemp("search")
    run_search(tiny_dir, out, 8, "--summary", str(out / "copy" / "rule_search.md"), "--note", "SMOKE RUN")
    return out


def test_study_rule_file_and_holdout(searched):
    out = searched
    study, trials = trials_of(out)
    assert len(trials) == 8
    seeded = [t.user_attrs.get("seeded_from") for t in trials[:6]]
    assert seeded == ["snapkv", "tova", "knorm", "h2o", "streamingllm", "window"]
    assert all(len(t.user_attrs["per_sample"]) == 2 for t in trials)
    best = study.best_trial
    assert (out / "searched_b64.py").is_file() and (out / f"holdout-t{best.number}" / "report.md").is_file()
    # The family's points equal to snapkv and knorm score exactly what those rules score on the calibration set.
    baselines = study.user_attrs["calibration_baselines"]
    assert baselines == {"snapkv": trials[0].value, "knorm": trials[2].value}
    rows = load_rows([out / f"holdout-t{best.number}"])
    assert {r["rule"] for r in rows} == {"full", "snapkv", "knorm", "searched_b64"}
    assert len(rows) == 4 * 2
    assert len({r["kernel_fingerprint"] for r in rows if r["rule"] != "full"}) == 1
    # Held-out samples are other samples than the calibration ones (generator seed 1000, not 0).
    assert {r["seed"] for r in rows} == {1000 * 1000, 1000 * 1000 + 1}
    searched_rows = [r for r in rows if r["rule"] == "searched_b64"]
    assert searched_rows[0]["rule_params"] == {k: best.params[k] for k in searched_rows[0]["rule_params"]}
    text = (out / "search.md").read_text()
    assert text == (out / "copy" / "rule_search.md").read_text()
    assert "**SMOKE RUN**" in text and "## Held-out verdict" in text and "by accuracy (2 paired samples)" in text
    assert f"reproduces {best.value:.4f} (equal)" in text and "one fingerprint for every rule" in text
    loads = r"[\d.]+/[\d.]+/[\d.]+"
    assert re.search(rf"load average \(1/5/15 min\) {loads} at the start, {loads} at the end", text)


def test_rule_file_is_registered_and_reproduces_the_trial(searched, tiny_dir):
    out = searched
    study, _ = trials_of(out)
    best = study.best_trial
    assert rules.load_file(out / "searched_b64.py") == ["searched_b64"]
    rule = rules.get("searched_b64")
    assert isinstance(rule, rules.Rule) and rule.params() == best.params
    assert f"trial #{best.number} of 8" in " ".join(type(rule).__doc__.split())  # how and when it was found
    model, tok, name = load_model(tiny_dir, progress=False)
    config = S.SearchConfig(model=name, tasks=["passkey"], lengths=[300], samples=2, seed=0, budget=64)
    calibration = S.calibration_set(model, tok, config, progress=False)
    value, per = S.objective(model, calibration, rule, 64, "query-agnostic")
    assert value == best.value and per == best.user_attrs["per_sample"]
    ids = torch.randint(0, 1000, (1, 12))
    assert fxbudget.kernel_fingerprint(model, ids, rule="searched_b64", budget=40) == \
        fxbudget.kernel_fingerprint(model, ids, rule="snapkv", budget=40)


def test_compare_and_rules_load_the_rule_file(searched, tiny_dir, tmp_path, capsys):
    path = str(searched / "searched_b64.py")
    assert main(["rules", "--rule-file", path]) == 0
    assert "| `searched_b64` | a `weighted` rule fitted by `fxbudget search`" in capsys.readouterr().out
    assert main(["compare", "--model", tiny_dir, "--rule-file", path, "--rules", "searched_b64,knorm", "--tasks",
                 "passkey", "--lengths", "300", "--budgets", "64", "--samples", "1", "--max-new-tokens", "2",
                 "--quiet", "--out", str(tmp_path)]) == 0
    rows = {r["rule"]: r for r in load_rows([tmp_path])}
    assert set(rows) == {"searched_b64", "knorm"}
    assert rows["searched_b64"]["kernel_fingerprint"] == rows["knorm"]["kernel_fingerprint"]


def test_resume_continues_the_study(searched, tiny_dir, tmp_path, capsys):
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(searched, out)
    _, before = trials_of(out)
    run_search(tiny_dir, out, 10)
    _, after = trials_of(out)
    assert len(after) == 10
    assert [(t.number, t.params, t.value) for t in after[:8]] == [(t.number, t.params, t.value) for t in before]
    run_search(tiny_dir, out, 10)  # complete: nothing more to run
    assert len(trials_of(out)[1]) == 10
    capsys.readouterr()
    assert main(["search", "--model", tiny_dir, *ARGS, "--seed", "3", "--trials", "10", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err


def test_without_optuna_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError
    assert main(["search", "--out", str(tmp_path)]) == 2
    assert "pip install 'flexbudget[search]'" in capsys.readouterr().err


def test_bad_settings_are_refused_before_loading_a_model(tmp_path, capsys):
    for bad, match in ((["--protocol", "query-agnostic,query-aware"], "one --protocol"),
                       (["--holdout-seed", "0"], "held-out seed"), (["--name", "snapkv"], "taken"),
                       (["--rules", "full,snapkv"], "baselines"), (["--tasks", "nope"], "unknown task"),
                       (["--dtype", "float64"], "unknown dtype"), ([], "--model /nonexistent does not exist")):
        assert main(["search", "--model", "/nonexistent", *bad, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_lengths_below_a_task_minimum_are_refused_before_the_model(tiny_dir, tmp_path, capsys, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: 1 / 0)
    assert main(["search", "--model", tiny_dir, "--lengths", "10", "--out", str(tmp_path / "o")]) == 2
    assert "passkey at 10 tokens" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_the_dtype_is_part_of_the_study(tmp_path):
    config = S.SearchConfig(model="m", tasks=["passkey"], lengths=[300], samples=1, seed=0, budget=64,
                            dtype="bfloat16")
    study = S.open_study(tmp_path, config)
    assert study.user_attrs["config"]["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="other settings.*dtype"):
        S.open_study(tmp_path, S.SearchConfig(model="m", tasks=["passkey"], lengths=[300], samples=1, seed=0,
                                              budget=64, dtype="float32"))
    # A study stored before the dtype was keyed ran float32: it resumes at float32.
    old = tmp_path / "old"
    key = {k: v for k, v in config.study_key().items() if k != "dtype"}
    S.open_study(old, S.SearchConfig(model="m", tasks=["passkey"], lengths=[300], samples=1, seed=0, budget=64,
                                     dtype="float32")).set_user_attr("config", key)
    S.open_study(old, S.SearchConfig(model="m", tasks=["passkey"], lengths=[300], samples=1, seed=0, budget=64,
                                     dtype="float32"))


def _rows(values: dict[str, list[float]], metric_field: str = "answer_logprob_mean") -> list[dict]:
    rows = []
    for rule, vs in values.items():
        for i, v in enumerate(vs):
            rows.append({"model": "m", "task": "t", "length": 1, "sample": i, "seed": i, "rule": rule, "budget": 8,
                         "budget_fraction": None, "score": 0.0, metric_field: v})
    return rows


def test_verdict_needs_tier_one_alone():
    good = [0.0] * 10
    worse = [-1.0 - 0.01 * i for i in range(10)]
    beats, text = S.verdict(_rows({"found": good, "snapkv": worse, "knorm": worse}), "found", "likelihood")
    assert beats is True and "beats every built-in rule" in text
    close = [-0.01] * 3 + [0.01] * 2 + [-0.001] * 5  # mean below 0: found has the best mean, not separated
    beats, text = S.verdict(_rows({"found": good, "snapkv": close}), "found", "likelihood")
    assert beats is False and "not separated" in text
    beats, text = S.verdict(_rows({"found": worse, "snapkv": good}), "found", "likelihood")
    assert beats is False and "does not beat" in text and "snapkv" in text
    beats, text = S.verdict(_rows({"found": good, "snapkv": good}), "found", "accuracy")
    assert beats is False and "no difference" in text


def test_load_file_refuses_taken_names_and_reloads_a_changed_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from fxbudget.rules import register\n@register('snapkv')\ndef f(s):\n    return s.pos.float()\n")
    with pytest.raises(ValueError, match="already taken: snapkv"):
        rules.load_file(bad)
    assert rules.get("snapkv").__class__.__module__ == "fxbudget.rules.snapkv"  # the built-in is untouched
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="registers no rule"):
        rules.load_file(empty)
    ok = tmp_path / "ok.py"
    ok.write_text("from fxbudget.rules import register\n"
                  "@register('file_rule_v')\ndef f(s):\n    return s.pos.float()\n")
    assert rules.load_file(ok) == ["file_rule_v"] and rules.load_file(ok) == ["file_rule_v"]
    first = rules.get("file_rule_v").__class__
    ok.write_text(ok.read_text() + "# changed\n")
    assert rules.load_file(ok) == ["file_rule_v"] and rules.get("file_rule_v").__class__ is not first
    other = tmp_path / "other.py"
    other.write_text(ok.read_text())
    with pytest.raises(ValueError, match="already taken: file_rule_v"):
        rules.load_file(other)
    assert rules.load_file(other, replace=True) == ["file_rule_v"]  # another rule file's rule: replaceable
    with pytest.raises(ValueError, match="already taken: snapkv"):
        rules.load_file(bad, replace=True)  # a built-in: never
