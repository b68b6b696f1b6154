"""Issue 31, the newcomer's first hour (CLI side): the protocol note, size checks and the estimate, Ctrl-C and
resume, a rule's dry run on a probe, names matched forgivingly, `--version`, `tasks`, lm-eval's `--help`, plurals;
and the bad inputs (one line, exit 2, before any model loads, nothing written)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

import fxbudget
from conftest import fails_in_one_line, tiny_model
from fxbudget.cli import main, names, sizes
from fxbudget.cli.preflight import UsageError
from fxbudget.harness import protocol_note
from fxbudget.harness.grid import Grid, Unit
from fxbudget.harness.report import load_rows
from fxbudget.harness.tasks import TASK_FILE_FIELDS, TASKS, Sample
from fxbudget.kernel.probe import signal_names, signals_read
from fxbudget.rules import available, get

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--tasks", "passkey", "--lengths", "300", "--samples", "1", "--max-new-tokens", "2", "--quiet"]






# --- bad inputs: one line, exit 2, before any model loads, nothing written ------------------------------------------

def _rule_file(tmp_path, body: str, name="mine.py") -> Path:
    path = tmp_path / name
    path.write_text("import torch\nfrom fxbudget.rules import Rule, register\n\n\n@register('mine')\n"
                    "class Mine(Rule):\n    def score(self, s):\n" + body)
    return path


@pytest.mark.parametrize("body, match", [
    ("        return s.accumulated_attention * 2\n",
     r"--rules mine: rule 'mine' reads s\.accumulated_attention \(.*mine\.py:8\), which the kernel does not measure "
     r"\(did you mean s\.acc_attn\?\); the signals are: attn, window_attn, last_attn, acc_attn, .*wov_norm"),
    ("        return s.attn.sum(-1)\n", r"rule 'mine': the score has shape \(1, 2\), expected exactly the candidates' "
                                      r"shape \(1, 2, 10\)"),
    ("        return s.attn > 0\n", r"rule 'mine': the score must be a floating tensor"),
    ("        return s.attn.mul_(2)\n", r"rule 'mine' writes a signal tensor in place"),
    ("        return s.attn @ s.key_norm\n", r"rule 'mine': its score fails on a probe .*RuntimeError: .*mine\.py:8\)"),
])
def test_a_broken_rule_is_refused_by_its_dry_run(tiny_dir, tmp_path, capsys, no_model_load, body, match):
    path = _rule_file(tmp_path, body)
    out = tmp_path / "out"
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, *SMALL, "--rule-file", str(path), "--rules", "full,mine",
                    "--out", str(out)], match)
    assert not out.exists()


def test_every_registered_rule_passes_its_dry_run():
    # The oracle: the built-in rules run in the kernel (their own tests); the probe must not refuse any of them.
    for name in [*available(), "adakv:snapkv", "adakv:knorm"]:
        read = signals_read(get(name))
        assert read <= set(signal_names()), (name, read)


def test_bad_inputs_refused_before_the_model(tiny_dir, tmp_path, capsys, no_model_load):
    out = tmp_path / "out"
    base = ["compare", "--model", tiny_dir, "--rules", "full", "--out", str(out)]
    # A task file with an unknown field (a misspelt optional field would otherwise be silently ignored).
    task = tmp_path / "mine.jsonl"
    task.write_text(json.dumps({"context": "c", "question": "q", "answer": "a", "max_new_token": 4}) + "\n")
    fails_in_one_line(capsys, [*base, "--task-file", str(task)],
           rf"{re.escape(str(task))}:1: unknown field 'max_new_token' \(did you mean 'max_new_tokens'\?\); the fields "
           r"are context, question, answer, answer_prefix, max_new_tokens, and meta")
    # A rule file that registers no rule.
    empty = tmp_path / "empty.py"
    empty.write_text("import torch\nx = 1\n")
    fails_in_one_line(capsys, [*base, "--rule-file", str(empty)], r"rule file .*empty\.py registers no rule")
    # --lengths below a task's minimum.
    fails_in_one_line(capsys, [*base, "--tasks", "passkey", "--lengths", "50"], r"passkey at 50 tokens: .*at least \d+ tokens")
    assert not out.exists()
    # --samples 0: argparse's one line.
    with pytest.raises(SystemExit) as e:
        main([*base, "--samples", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--samples: must be at least 1, got 0" in err, err
    assert not out.exists()


def test_a_task_file_with_meta_runs(tiny_dir, tmp_path, capsys, no_model_load):
    task = tmp_path / "mine.jsonl"
    task.write_text(json.dumps({"context": "c", "question": "q", "answer": "a", "meta": {"source": "hand"}}) + "\n")
    from fxbudget.cli import preflight

    preflight.task_files([str(task)])  # accepted (no UsageError)


# --- names ----------------------------------------------------------------------------------------------------------

def test_names_are_matched_case_insensitively():
    assert names.rule_names(["SnapKV", "TOVA", "adakv:SnapKV", "FULL"]) == ["snapkv", "tova", "adakv:snapkv", "full"]
    assert names.task_names(["PassKey", "NIAH_Single"]) == ["passkey", "niah_single"]
    assert names.protocol_names(["Query-Aware", "query_agnostic"]) == ["query-aware", "query-agnostic"]
    assert [names.dtype_name(d) for d in ("bf16", "BF16", "fp16", "half", "fp32", "torch.bfloat16", "float32")] == \
        ["bfloat16", "bfloat16", "float16", "float16", "float32", "bfloat16", "float32"]
    assert names.params(["SnapKV.window=64", "nonsense"]) == ["snapkv.window=64", "nonsense"]
    with pytest.raises(UsageError, match=r"unknown rule 'h20' \(did you mean 'h2o'\?\)"):
        names.rule_name("h20")
    with pytest.raises(UsageError, match=r"unknown protocol 'streamin' \(did you mean 'streaming'\?\)"):
        names.protocol_names(["streamin"])
    assert names.plural(1, "row") == "1 row" and names.plural(2, "sample") == "2 samples"


# --- --version, tasks, lm-eval --help -------------------------------------------------------------------------------

def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"fxbudget {fxbudget.__version__}"


def test_tasks_lists_every_task_and_every_task_file_field(capsys):
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    for name, fn in TASKS.items():
        row = next(line for line in out.splitlines() if line.startswith(f"| `{name}` |"))
        assert fn.__doc__.split(":")[0].split("(")[0].strip()[:12] in row, row  # what it measures: its docstring
    assert all(f"- `{field}`:" in out for field in TASK_FILE_FIELDS) and "- `meta`:" in out


def test_lmeval_help_lists_fxbudget_model_args_first():
    from fxbudget.lmeval.__main__ import MODEL_ARGS
    from fxbudget.lmeval.options import OWN_ARGS

    assert set(MODEL_ARGS) == set(OWN_ARGS)
    proc = subprocess.run([sys.executable, "-m", "fxbudget.lmeval", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.index("fxbudget's model")
    assert all(re.search(rf"^  {k} ", proc.stdout, re.M) for k in OWN_ARGS), proc.stdout
    assert first < proc.stdout.index("lm-eval's own options") < proc.stdout.index("usage:")


# --- protocol note --------------------------------------------------------------------------------------------------

def test_protocol_note_is_derived_from_what_rules_read():
    rules = protocol_note.question_rules(["full", "snapkv", "tova", "h2o", "knorm", "streamingllm", "kvzip",
                                          "adakv:snapkv", "expected_attention"])
    assert rules == ["snapkv", "tova", "adakv:snapkv"]
    note = protocol_note.run_note(["full", "snapkv", "tova", "h2o"], ["query-agnostic"])
    assert note.startswith("protocol query-agnostic: snapkv, tova choose ") and "--protocol query-aware" in note
    assert protocol_note.run_note(["full", "snapkv"], ["query-agnostic", "query-aware"]) is None
    assert protocol_note.run_note(["full", "h2o", "knorm"], ["query-agnostic"]) is None
    assert protocol_note.row_note("snapkv", "query-agnostic")
    assert protocol_note.row_note("snapkv", "query-aware") is None
    assert protocol_note.row_note("knorm", "query-agnostic") is None
    assert protocol_note.row_note("not_registered_here", "query-agnostic") is None  # a report of a rule file's rule
    assert "`query-agnostic` (the default)" in protocol_note.header_note(["query-agnostic", "query-aware"])


# --- sizes ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cache_bytes_match_the_caches_themselves(arch):
    from fxbudget.harness.measure import kv_bytes
    from fxbudget.cache.keyword import output_cache

    model = tiny_model(arch)
    budget, headroom = 40, 64
    ours = fxbudget.BudgetCache(model.config, budget, headroom=headroom).kv_bytes()
    assert sizes.kv_bytes(model.config, "float32", budget + headroom, budgeted=True) == ours
    n = 30  # the unmodified model's own cache after n tokens
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 96, (1, n)), use_cache=True)
    theirs = kv_bytes(output_cache(out))["kv_allocated_bytes"]
    assert sizes.kv_bytes(model.config, "float32", n, budgeted=False) == theirs


def test_rate_constants_are_the_committed_quick_start():
    rows = [json.loads(line) for line in (ROOT / "docs/quickstart/results.jsonl").read_text().splitlines()]
    full = [r for r in rows if r["rule"] == "full"]
    prefill = sum(r["prompt_tokens"] for r in full) / sum(r["prefill_s"] for r in full)
    decode = sum(r["output_tokens"] for r in rows) / sum(r["decode_s"] for r in rows)
    assert prefill / 2 <= sizes.CPU_PREFILL_TOKENS_S <= prefill * 2
    assert decode / 2 <= sizes.CPU_DECODE_STEPS_S <= decode * 2
    assert {r["device"] for r in rows} == {"cpu"} and {r["threads"] for r in rows} == {1}


def test_embedded_shape_is_the_embedded_models_config():
    from fxbudget.models import default_cache_dir, load_default

    if not (default_cache_dir() / "config.json").is_file():
        load_default(progress=False)
    config = AutoConfig.from_pretrained(default_cache_dir())
    shape = {k: getattr(config, k, None) for k in sizes.EMBEDDED_SHAPE}
    shape["head_dim"] = shape["head_dim"] or config.hidden_size // config.num_attention_heads
    assert shape == sizes.EMBEDDED_SHAPE
    assert sizes.context_limit(config) == config.max_position_embeddings


def test_grid_tokens_and_estimate_line():
    grid = Grid(tasks=["passkey"], lengths=[300], rules=["full", "snapkv"], budgets=[32, 64], samples=1)
    sample = Sample("passkey", "c", "q", ["1"], max_new_tokens=5)
    samples = {("passkey", 300): [sample]}
    sized = [(("passkey", 300), sample, 100, 10, 3)]  # context 100, question 10, answer 3 tokens
    todo = [("query-agnostic", "full", None), ("query-agnostic", "snapkv", 32), ("query-agnostic", "snapkv", 64)]
    plan = [(Unit("passkey", 300, 0), todo)]
    # One shared context prefill, each budgeted row appends its question; the reference prefills context + question;
    # every row scores its answer in one call and decodes at most max_new_tokens steps.
    assert sizes.grid_tokens(grid, plan, samples, sized, None) == (100 + 2 * 10 + 110 + 3 * 3, 3 * 5)
    grid.backend = "inductor"  # compiled: the answer is scored token by token
    assert sizes.grid_tokens(grid, plan, samples, sized, None) == (100 + 2 * 10 + 110, 3 * (5 + 3))
    grid.backend = None
    line = sizes.estimate_line(grid, [(plan[0][0], todo[:1])], samples, sized, None, "cpu", None)
    assert line.startswith("1 row on 1 sample: 113 prompt and answer tokens through the model, at most 5 decoding "
                           "steps; estimated") and "on the reference machine, not this one" in line
    assert "no time estimate on cuda:0" in sizes.estimate_line(grid, plan, samples, sized, None, "cuda:0", None)


def test_budget_at_or_above_the_context_warns_with_its_cost():
    config = tiny_model("llama").config
    sample = Sample("passkey", "c", "q", ["1"], max_new_tokens=5)
    sized = [(("passkey", 300), sample, 100, 10, 3)]
    grid = Grid(tasks=["passkey"], lengths=[300], rules=["full", "snapkv"], budgets=[32, 100, "100%"], samples=1)
    lines = sizes.budget_warnings(grid, sized, config, "float32", 64, None)
    assert len(lines) == 2, lines  # 100 and 100% (= 100 entries), not 32
    ours = sizes.kv_bytes(config, "float32", 164, budgeted=True) / 1024
    theirs = sizes.kv_bytes(config, "float32", 115, budgeted=False) / 1024
    assert lines[0] == (f"warning: --budgets 100 is at or above the context (100 tokens, passkey at 300 tokens): "
                        f"nothing is evicted, so every rule is the unmodified model there; its cache allocates "
                        f"{ours:.1f} KiB (100 + 64 head-room entries per layer and KV head) against the unmodified "
                        f"model's {theirs:.1f} KiB; use a budget below the context")
    assert lines[1].startswith("warning: --budgets 100% (= 100 entries) is at or above")


# --- a run: the lines before it, Ctrl-C, resume ---------------------------------------------------------------------

def test_ctrl_c_says_what_is_saved_and_the_rerun_resumes(tiny_dir, tmp_path, capsys, monkeypatch,
                                                         shared_fingerprints):
    from fxbudget.harness import results

    out = tmp_path / "run"
    argv = ["compare", "--model", tiny_dir, *SMALL, "--rules", "full,SnapKV", "--budgets", "32,400",
            "--out", str(out)]
    real, written = results.append_row, []

    def append_then_interrupt(f, row):
        real(f, row)
        written.append(row)
        if len(written) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(results, "append_row", append_then_interrupt)
    assert main(argv) == 130
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert re.fullmatch(rf"\[fxbudget\] interrupted: 1 of 3 rows saved in {re.escape(str(out / 'results.jsonl'))}; "
                        rf"resume with: fxbudget compare --model {re.escape(tiny_dir)} .* --out {re.escape(str(out))}",
                        lines[-1]), lines[-1]
    # Before the rows: the budget at or above the context, the estimate, the protocol note.
    assert any(re.match(r"\[fxbudget\] warning: --budgets 400 is at or above the context \(\d+ tokens, passkey at "
                        r"300 tokens\)", line) for line in lines), err
    assert any(re.match(r"\[fxbudget\] 3 rows on 1 sample: \d+ prompt and answer tokens .*; estimated \d+ s on the "
                        r"reference machine, not this one", line) for line in lines), err
    assert any(line.startswith("[fxbudget] protocol query-agnostic: snapkv chooses with the attention of the latest "
                               "queries") for line in lines), err
    assert len(load_rows([out])) == 1
    monkeypatch.setattr(results, "append_row", real)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[fxbudget] resuming: 1 of 3 rows done" in err and "2 rows to run on 1 sample " in err, err
    assert sorted((r["rule"], r["budget"]) for r in load_rows([out])) == [("full", None), ("snapkv", 32),
                                                                          ("snapkv", 400)]


def test_sigint_in_a_real_process_is_one_line_and_status_130(tiny_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fxbudget.cli", "compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths",
           "300", "--samples", "40", "--rules", "full", "--max-new-tokens", "32", "--quiet", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    path = out / "results.jsonl"
    deadline = time.monotonic() + 600
    while not (path.is_file() and path.read_text().count("\n") >= 1) and proc.poll() is None:
        assert time.monotonic() < deadline, "no row written"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    saved = len(load_rows([out]))
    assert 1 <= saved < 40
    assert re.fullmatch(rf"\[fxbudget\] interrupted: {saved} of 40 rows saved in .*; resume with: fxbudget compare "
                        rf"--model .* --out {re.escape(str(out))}", err.strip().splitlines()[-1]), err


def test_ctrl_c_while_the_report_is_written_says_how_to_write_it(tiny_dir, tmp_path, capsys, monkeypatch):
    from fxbudget.harness import report

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "report", interrupted)
    out = tmp_path / "run"
    assert main(["compare", "--model", tiny_dir, *SMALL, "--rules", "full", "--out", str(out)]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"[fxbudget] interrupted while writing the report: its one row is saved in {out / 'results.jsonl'}; "
                    f"write it with: fxbudget report {out}"), last


def test_ctrl_c_before_any_row_says_nothing_was_written(tiny_dir, tmp_path, capsys, monkeypatch):
    from fxbudget.cli import preflight

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preflight, "tokenizer", interrupted)
    out = tmp_path / "run"
    assert main(["compare", "--model", tiny_dir, *SMALL, "--rules", "full", "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "fxbudget compare: interrupted before any row ran; nothing written" and not out.exists()
