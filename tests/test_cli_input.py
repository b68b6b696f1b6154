"""The command line before any model work (issues 20 and 21): bad inputs say what to do in one line and exit 2
before a model loads, leaving no results folder; `--task-file` runs only the files; a finished run's rerun loads
nothing; `--help` and `rules` import no torch; the closing line's seconds add up."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from fxbudget.cli import main
from fxbudget.harness.report import load_rows
from fxbudget.harness.tasks import TASK_FILE_FIELDS

from conftest import fails_in_one_line

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--rules", "full,snapkv", "--budgets", "32", "--samples", "1", "--max-new-tokens", "2", "--quiet"]






@pytest.mark.parametrize("extra, match", [
    (["--lengths", "10"], r"passkey at 10 tokens: n_tokens=10 is too small .*use at least \d+ tokens"),
    (["--param", "snapkv.windw=64"], r"--param snapkv.windw: snapkv has no hyperparameter 'windw'; its "
                                     r"hyperparameters: window, kernel, pooling"),
    (["--param", "h2o.recent_ratio=0.3"], r"h2o is not among the rules run"),
    (["--protocol", "queryaware"], r"--protocol queryaware: unknown protocol 'queryaware' \(did you mean "
                                   r"'query-aware'\?\); known protocols: query-agnostic, query-aware, streaming, multi-request, multi-turn$"),
    (["--device", "tpu"], r"--device tpu: unknown device; use one of cpu, cuda, cuda:N"),
    (["--dtype", "float64"], r"--dtype float64: unknown dtype( \(did you mean '\w+'\?\))?; use one of float32, "
                             r"bfloat16, float16"),
    (["--dtype", "bfloat"], r"--dtype bfloat: unknown dtype \(did you mean 'bfloat16'\?\)"),
    (["--rules", "full,snapkvv"], r"--rules snapkvv: unknown rule 'snapkvv' \(did you mean 'snapkv'\?\); known "
                                  r"rules: .*tova.*adakv:<rule>"),
    (["--tasks", "paskey"], r"--tasks paskey: unknown task 'paskey' \(did you mean 'passkey'\?\); known tasks: "
                            r"passkey, niah_single"),
    (["--param", "SnapKV.windw=64"], r"--param snapkv.windw: snapkv has no hyperparameter 'windw'"),
    (["--lengths", "9000"], r"--lengths 9000: tiny\w* holds 8192 positions \(max_position_embeddings in its "
                            r"config\).*use --lengths below 8192"),
    (["--device", "cuda:99"], r"--device cuda:99: (no CUDA GPU is visible|only \d+ CUDA GPU)"),
    (["--revision", "v1"], r"--revision is for hub ids"),
])
def test_bad_input_one_line_exit_2_nothing_loaded_or_written(tiny_dir, tmp_path, capsys, no_model_load, extra,
                                                             match):
    out = tmp_path / "out"
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", *SMALL,
                    "--out", str(out), *extra], match)
    assert not out.exists()


def test_absent_gpu_is_refused(tiny_dir, tmp_path, capsys, no_model_load, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--device", "cuda", "--out", str(tmp_path / "o")],
           r"--device cuda: no CUDA GPU is visible .*use --device cpu")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("model, match", [
    ("/nonexistent", r"--model /nonexistent does not exist: give a model directory, a .gguf file or a hub id"),
    ("./no/such/dir.gguf", r"does not exist"),
    ("not a valid id!", r"not a local path and not a valid hub id"),
])
def test_bad_model_paths(tmp_path, capsys, no_model_load, model, match):
    fails_in_one_line(capsys, ["compare", "--model", model, "--out", str(tmp_path / "o")], match)
    assert not (tmp_path / "o").exists()


def test_directory_that_is_not_a_model(tmp_path, capsys, no_model_load):
    fails_in_one_line(capsys, ["compare", "--model", str(tmp_path), "--out", str(tmp_path / "o")], r"holds no config.json")


def test_rule_file_errors_name_file_and_line(tiny_dir, tmp_path, capsys, no_model_load):
    bad = tmp_path / "bad_rule.py"
    bad.write_text("from fxbudget.rules import register\n@register('mine'\ndef score(s):\n    return s.pos\n")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--rule-file", str(bad), "--out", str(tmp_path / "o")],
           rf"{re.escape(str(bad))}:2: SyntaxError: ")
    raising = tmp_path / "raising_rule.py"
    raising.write_text("import math\n\nraise RuntimeError('broken on purpose')\n")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--rule-file", str(raising), "--out", str(tmp_path / "o")],
           rf"{re.escape(str(raising))}:3: RuntimeError: broken on purpose")
    fails_in_one_line(capsys, ["rules", "--rule-file", str(bad)], r"bad_rule.py:2: SyntaxError")
    assert not (tmp_path / "o").exists()


def test_task_file_errors_before_the_model(tiny_dir, tmp_path, capsys, no_model_load):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"context": "c", "question": "q", "answer": "a"}) + "\n"
                    + json.dumps({"context": "c", "question": "q"}) + "\n")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--task-file", str(path), "--out", str(tmp_path / "o")],
           rf"{re.escape(str(path))}:2: missing field 'answer'")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--task-file", str(tmp_path / "none.jsonl"),
                    "--out", str(tmp_path / "o")], r"task file .*none.jsonl does not exist")
    assert not (tmp_path / "o").exists()


def test_argparse_errors_are_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--lengths", "ten"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "expected comma-separated integers" in err and "--help" in err


def _task_file(tmp_path, n=3):
    path = tmp_path / "mytask.jsonl"
    path.write_text("".join(json.dumps({"context": f"Note {i}. The code is {1000 + i}.", "question": "The code?",
                                        "answer": str(1000 + i), "max_new_tokens": 2}) + "\n" for i in range(n)))
    return path


def test_task_file_alone_runs_only_the_file_and_samples_caps_it(tiny_dir, tmp_path):
    path = _task_file(tmp_path)
    base = ["compare", "--model", tiny_dir, "--task-file", str(path), "--rules", "full", "--quiet", "--no-likelihood"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    rows = load_rows([tmp_path / "a"])
    assert sorted(r["sample"] for r in rows) == [0, 1, 2] and {r["task"] for r in rows} == {"mytask"}
    assert main([*base, "--samples", "2", "--out", str(tmp_path / "b")]) == 0
    assert sorted(r["sample"] for r in load_rows([tmp_path / "b"])) == [0, 1]
    assert main([*base, "--samples", "1", "--tasks", "passkey", "--lengths", "300", "--out", str(tmp_path / "c")]) == 0
    assert sorted((r["task"], r["sample"]) for r in load_rows([tmp_path / "c"])) == [("mytask", 0), ("passkey", 0)]


def test_help_lists_every_task_file_field(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"{name}:" in text for name in TASK_FILE_FIELDS) and "max_new_tokens" in text


def test_rerun_of_a_finished_run_loads_nothing_and_keeps_the_report(tiny_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", *SMALL, "--rules", "full",
            "--out", str(out)]
    assert main(args) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model load" in line and "report" in line
    report, rows = out / "report.md", (out / "results.jsonl").read_bytes()
    before = (report.read_bytes(), report.stat().st_mtime_ns)

    def refuse(*a, **k):
        raise AssertionError("loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "nothing to run" in captured.err and "| full (unmodified model) |" in captured.out  # the tables, read from the rows
    assert (report.read_bytes(), report.stat().st_mtime_ns) == before and (out / "results.jsonl").read_bytes() == rows


def test_closing_line_adds_up():
    from fxbudget.cli.preflight import Stages

    stages = Stages()
    stages.parts = [("a", 0.04), ("b", 1.26), ("c", 0.05), ("d", 10.449)]  # rounding each alone gives 0+1.3+0.1+10.4
    line = stages.line()
    total = float(re.match(r"done in ([\d.]+) s = ", line).group(1))
    terms = [float(x) for x in re.findall(r"([\d.]+) s [a-z]", line.split(" = ", 1)[1])]
    assert total == 11.8 and abs(sum(terms) - total) < 1e-9, line


def test_dtype_recorded_in_rows(tiny_dir, tmp_path):
    out = tmp_path / "bf16"
    assert main(["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", *SMALL,
                 "--device", "cpu", "--dtype", "BF16", "--out", str(out)]) == 0  # bf16 is bfloat16
    rows = load_rows([out])
    assert {(r["dtype"], r["device"]) for r in rows} == {("bfloat16", "cpu")}
    assert json.loads((out / "run.json").read_text())["dtype"] == "bfloat16"


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_help_and_rules_import_no_torch():
    code = ("import sys\nfrom fxbudget.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['compare', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert main(['rules']) == 0\nassert main(['tasks']) == 0\n"
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "assert not heavy, heavy\nprint('OK')\n")
    proc = _python(code)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr
    assert "| `snapkv` |" in proc.stdout and "| `passkey` |" in proc.stdout


def test_static_rules_table_is_the_registry_table():
    from fxbudget.cli.rules_table import rules_table, static_rules_table

    assert static_rules_table() == rules_table()


def test_import_fxbudget_is_lazy_and_the_api_is_there():
    proc = _python("import sys, fxbudget\nassert 'torch' not in sys.modules\n"
                   "assert callable(fxbudget.compile) and 'snapkv' in fxbudget.rules.available()\n"
                   "import torch._dynamo\nassert 'fxbudget' in torch._dynamo.list_backends(exclude_tags=())\n"
                   "print('OK')")
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr


def _hub_cache(tiny_dir, home: Path, repo="tinyorg/tiny-qwen", rev="0123456789abcdef0123456789abcdef01234567"):
    """`tiny_dir` saved as the HF cache holds a downloaded model: hub/models--ORG--NAME/snapshots/REV, refs/main."""
    import shutil

    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(tiny_dir, root / "snapshots" / rev)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    return repo, rev


def test_hub_id_from_the_cache_offline(tiny_dir, tmp_path):
    repo, rev = _hub_cache(tiny_dir, tmp_path / "hf")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fxbudget.cli", "compare", "--model", repo, "--tasks", "passkey",
                           "--lengths", "300", "--rules", "full", "--samples", "1", "--max-new-tokens", "2",
                           "--no-likelihood", "--quiet", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 0, proc.stderr
    (row,) = load_rows([out])
    assert row["model"] == repo and row["dtype"] == "float32"
    # The same by revision, through the API; and an id the cache does not hold: one line, exit 2, nothing written.
    code = (f"from fxbudget.models import load_model\nm, t, name = load_model({repo!r}, revision={rev!r}, "
            "progress=False, dtype='bfloat16')\nprint(name, next(m.parameters()).dtype)")
    proc = _python(code, **env)
    assert proc.returncode == 0 and proc.stdout.split() == [f"{repo}@{rev}", "torch.bfloat16"], proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fxbudget.cli", "compare", "--model", "tinyorg/absent",
                           "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "tinyorg/absent is not in the Hugging Face cache" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
    assert not (tmp_path / "o").exists()
