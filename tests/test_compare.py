"""`fxbudget compare` end to end on a tiny random model (CLI, rows, report, plots, resume, shards, protocols,
relative budgets, the answer likelihood)."""

import csv
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from fxbudget.cli import main
from fxbudget import kernel_fingerprint, rules
from fxbudget.harness import runner
from fxbudget.harness.report import load_rows, rule_order
from fxbudget.harness.tasks import answer_ids, chat_ids, make_samples
from fxbudget.models import load_model

GRID = ["--tasks", "passkey,niah_multikey", "--lengths", "300", "--rules", "full,snapkv,streamingllm,h2o,pyramidkv",
        "--budgets", "48,4096", "--samples", "2", "--max-new-tokens", "4", "--quiet"]
ROW_FIELDS = ("model", "rule", "rule_params", "budget", "protocol", "chunk_size", "window", "dtype", "device", "torch",
              "transformers", "kernel_fingerprint", "signals", "peak_mem_bytes", "shared_prefill_peak_mem_bytes",
              "kv_allocated_bytes", "kv_held_bytes", "prefill_s", "decode_s",
              "compile_s", "output_tokens", "prediction", "score", "depth", "n_tokens", "answers", "malloc",
              "answer_tokens", "answer_logprob", "answer_logprob_mean", "likelihood_s", "budget_fraction",
              "context_tokens", "max_new_tokens")
# Every run of this file is on the same tiny model: each rule's fingerprint is traced once, not once per run.
pytestmark = pytest.mark.usefixtures("shared_fingerprints")


def compare(tiny_dir, out, *extra):
    assert main(["compare", "--model", tiny_dir, *GRID, "--out", str(out), *extra]) == 0
    return {r["key"]: r for r in load_rows([out])}


@pytest.fixture(scope="module")
def single_run(tiny_dir, tmp_path_factory, shared_fingerprints):
    out = tmp_path_factory.mktemp("run")
    return out, compare(tiny_dir, out)


def test_rows_report_and_plots(single_run):
    out, rows = single_run
    assert len(rows) == 2 * 2 * (1 + 4 * 2)  # tasks x samples x (reference + rules x budgets)
    for r in rows.values():
        missing = [f for f in ROW_FIELDS if f not in r]
        assert not missing, missing
        assert r["protocol"] == "query-agnostic" and 0.0 <= r["score"] <= 1.0
        assert r["malloc"] == "glibc heap only, no trim"  # compare keeps freed heap pages (harness/malloc.py)
    budgeted = [r for r in rows.values() if r["rule"] != "full"]
    assert len({r["kernel_fingerprint"] for r in budgeted}) == 1  # one shared kernel
    # One signal set for the run: what its rules read (snapkv, pyramidkv: window_attn; h2o: acc_attn)
    assert {r["signals"] for r in budgeted} == {"window_attn,acc_attn"}
    assert all(r["shared_prefill"] for r in budgeted)
    small = [r for r in budgeted if r["budget"] == 48]
    full_held = min(x["kv_held_bytes"] for x in rows.values() if x["rule"] == "full")
    assert all(r["kv_held_bytes"] < full_held for r in small)
    assert all(r["kv_held_bytes"] <= r["kv_allocated_bytes"] for r in rows.values())
    assert all(r["kv_held_bytes"] < r["kv_allocated_bytes"] / 4 for r in budgeted if r["budget"] == 4096)  # empty
    for name in ("report.md", "summary.csv", "paired.csv", "accuracy_vs_budget.png", "likelihood_vs_budget.png",
                 "needle_snapkv.png", "run.json"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "| full (unmodified model) |" in report and "one shared kernel" in report
    assert "- signal set (what the kernel measured, one per run): window_attn,acc_attn" in report
    assert "#### B=48: 4 paired samples" in report and "| rule | accuracy [95% CI] | Δ vs top |" in report
    summary = list(csv.DictReader((out / "summary.csv").open()))
    assert {s["rule"] for s in summary} == {"full", "snapkv", "streamingllm", "h2o", "pyramidkv"}
    for s in summary:
        assert float(s["accuracy_lo"]) <= float(s["accuracy"]) <= float(s["accuracy_hi"])
        assert s["accuracy_interval"] == "clopper-pearson"  # single-answer tasks: every score is 0 or 1
    paired = list(csv.DictReader((out / "paired.csv").open()))
    assert {(p["metric"], p["budget"], p["task"]) for p in paired} >= {("likelihood", "48", "all"),
                                                                        ("accuracy", "4096", "passkey")}


def test_budget_covering_context_equals_full(single_run):
    """With a budget >= the context nothing is evicted: every rule answers exactly what the unmodified model does."""
    _, rows = single_run
    full = {(r["task"], r["sample"]): r["prediction"] for r in rows.values() if r["rule"] == "full"}
    covering = [r for r in rows.values() if r["budget"] == 4096]
    assert len(covering) == 16
    for r in covering:
        assert r["prediction"] == full[(r["task"], r["sample"])], (r["rule"], r["task"], r["sample"])


def test_likelihood_covering_budget_and_reference(single_run, tiny_dir):
    """The reference row's answer log-likelihood equals a direct forward of the unmodified model over prompt +
    answer; with a budget covering the context every rule gets it too (up to 1e-4); a small budget loses some."""
    _, rows = single_run
    model = Qwen2ForCausalLM.from_pretrained(tiny_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    full = {(r["task"], r["sample"]): r for r in rows.values() if r["rule"] == "full"}
    for (task, i), ref in full.items():
        sample = make_samples(task, tok, 300, 2)[i]
        ctx, question = chat_ids(tok, sample)
        answer = answer_ids(tok, sample)
        with torch.no_grad():
            logits = model(torch.cat([ctx, question, answer], dim=1)).logits[0, -answer.shape[1] - 1:-1]
        direct = torch.log_softmax(logits.float(), -1).gather(-1, answer[0, :, None]).double()
        assert ref["answer_tokens"] == answer.shape[1]
        assert ref["answer_logprob"] == pytest.approx(float(direct.sum()), abs=1e-4)
        assert ref["answer_logprob_mean"] == pytest.approx(float(direct.mean()), abs=1e-4)
    for r in rows.values():
        ref = full[(r["task"], r["sample"])]["answer_logprob"]
        if r["budget"] == 4096:
            assert r["answer_logprob"] == pytest.approx(ref, abs=1e-4), (r["rule"], r["task"], r["sample"])
    small = [r["answer_logprob"] - full[(r["task"], r["sample"])]["answer_logprob"] for r in rows.values()
             if r["budget"] == 48]
    assert max(abs(d) for d in small) > 1e-3  # the metric sees the eviction


def test_relative_budgets_and_protocols_in_one_run(tiny_dir, tmp_path, monkeypatch):
    """`--budgets 10%,100%` over three protocols: budgets follow each sample's context; one shared prefill per
    distinct prefilled sequence (query-agnostic and streaming share the context's); the reference runs once."""
    prefills = []
    real = runner.shared_prefill
    monkeypatch.setattr(runner, "shared_prefill", lambda model, ids, **kw: prefills.append(ids.shape[1]) or real(model, ids, **kw))
    out = tmp_path / "rel"
    assert main(["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--rules",
                 "full,snapkv,h2o", "--budgets", "10%,100%", "--samples", "2", "--max-new-tokens", "4", "--quiet",
                 "--protocol", "query-agnostic,streaming,query-aware", "--out", str(out)]) == 0
    rows = load_rows([out])
    assert len(rows) == 2 * 3 * (1 + 2 * 2)  # samples x protocols x (reference + rules x budgets)
    assert len(prefills) == 2 * 2  # per sample: the context once, context + question once
    for r in rows:
        if r["rule"] == "full":
            assert r["budget"] is None and r["budget_fraction"] is None
        else:
            assert r["budget_fraction"] in (0.1, 1.0) and r["shared_prefill"]
            assert r["budget"] == int(r["budget_fraction"] * r["context_tokens"])  # floored fraction of the context
    refs = {}
    for r in rows:
        if r["rule"] == "full":
            refs.setdefault(r["sample"], []).append(r)
    for same in refs.values():  # computed once, written once per protocol
        assert sorted(r["protocol"] for r in same) == ["query-agnostic", "query-aware", "streaming"]
        assert len({(r["prefill_s"], r["answer_logprob"], r["prediction"]) for r in same}) == 1
    ref = {r["sample"]: r for r in rows if r["rule"] == "full"}
    for r in rows:  # 100% of the context covers query-agnostic (the others evict as the question comes in)
        if r["budget_fraction"] == 1.0 and r["protocol"] == "query-agnostic":
            assert r["answer_logprob"] == pytest.approx(ref[r["sample"]]["answer_logprob"], abs=1e-4)
            assert r["prediction"] == ref[r["sample"]]["prediction"]
    report = (out / "report.md").read_text()
    assert "## settings side by side" in report and "| query-aware, B=10% |" in report
    assert "#### B=100%: 2 paired samples" in report
    summary = list(csv.DictReader((out / "summary.csv").open()))
    assert {s["budget"] for s in summary if s["rule"] != "full"} == {"10%", "100%"}
    assert main(["report", str(out), "--sort", "likelihood"]) == 0
    order = rule_order([r for r in rows if r["protocol"] == "streaming"], "likelihood")[1:]
    means = [sum(r["answer_logprob_mean"] for r in rows if r["rule"] == x and r["protocol"] == "streaming")
             for x in order]
    assert means == sorted(means, reverse=True)


def test_resume_skips_completed_rows(single_run, tiny_dir, tmp_path):
    src, rows = single_run
    lines = (src / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:-3]) + "\n")  # an interrupted run
    again = compare(tiny_dir, tmp_path)
    assert set(again) == set(rows)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(lines)  # only the 3 missing rows ran
    for key in rows:  # the rerun rows reproduce the original ones
        assert again[key]["prediction"] == rows[key]["prediction"]
    compare(tiny_dir, tmp_path)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(lines)  # nothing left to run


# Runs `fxbudget compare` in a child process that SIGKILLs itself halfway through writing its third row.
KILL_MID_WRITE = """
import json, os, signal, sys
from fxbudget.harness import results
from fxbudget.cli import main

written = []

def append_row(f, row):
    line = json.dumps(row, default=str) + "\\n"
    if len(written) == 2:
        f.write(line[: len(line) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(row)
    f.write(line)
    f.flush()

results.append_row = append_row
sys.exit(main(sys.argv[1:]))
"""


def _lines(path):
    return path.read_text().splitlines() if path.is_file() else []


def test_killed_runs_resume_with_every_row_once(single_run, tiny_dir, tmp_path):
    """SIGKILL mid-write, then SIGKILL mid-run, then a rerun: every row exactly once, the single run's answers."""
    _, rows = single_run
    rows = {k: r for k, r in rows.items() if r["task"] == "passkey"}  # half of the grid: the same samples and keys
    root = Path(__file__).resolve().parent.parent
    args = ["compare", "--model", tiny_dir, *GRID, "--tasks", "passkey", "--out", str(tmp_path / "out")]
    path = tmp_path / "out" / "results.jsonl"
    killed = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, *args], cwd=root, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    text = path.read_text()
    assert len(text.splitlines()) == 3 and not text.endswith("\n")  # two rows and half of the third

    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "fxbudget.cli", *args], cwd=root, stderr=err)
        try:
            while len(_lines(path)) < 5 and proc.poll() is None:  # the repaired file + at least 3 new rows
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before it could be killed"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
    assert "line 3 is cut short" in (tmp_path / "stderr.txt").read_text()

    again = compare(tiny_dir, tmp_path / "out", "--tasks", "passkey")
    keys = [json.loads(line)["key"] for line in _lines(path)]  # every line is a whole row
    assert sorted(keys) == sorted(rows) and len(set(keys)) == len(keys)
    assert {k: r["prediction"] for k, r in again.items()} == {k: r["prediction"] for k, r in rows.items()}


def test_shards_merge_to_the_single_run(single_run, tiny_dir, tmp_path):
    _, rows = single_run
    a, b = compare(tiny_dir, tmp_path / "a", "--shard", "0/2"), compare(tiny_dir, tmp_path / "b", "--shard", "1/2")
    assert a and b and not set(a) & set(b)
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 0
    merged = {r["key"]: r for r in load_rows([tmp_path / "a", tmp_path / "b"])}
    assert set(merged) == set(rows)
    assert {k: r["prediction"] for k, r in merged.items()} == {k: r["prediction"] for k, r in rows.items()}
    assert (tmp_path / "m" / "report.md").is_file()


@pytest.mark.parametrize("protocol, backend", [("query-aware", "none"), ("streaming", "none"),
                                               ("query-agnostic", "aot_eager")])
def test_other_protocols_chunked_prefill_and_compiled(tiny_dir, tmp_path, protocol, backend):
    # Compiled: every row compiles its own graphs, so two rules (snapkv, and pyramidkv's per-layer budgets) suffice.
    rules = ["--rules", "full,snapkv,pyramidkv"] if backend != "none" else []
    rows = compare(tiny_dir, tmp_path, "--protocol", protocol, "--chunk-size", "128", "--backend", backend, *rules)
    budgeted = [r for r in rows.values() if r["rule"] != "full"]
    assert all(r["protocol"] == protocol and r["chunk_size"] == 128 and not r["shared_prefill"]
               and r["backend"] == backend for r in budgeted)
    if backend != "none":
        assert sum(r["compile_s"] for r in budgeted) > 0
    full = {(r["task"], r["sample"]): r["prediction"] for r in rows.values() if r["rule"] == "full"}
    for r in budgeted:
        if r["budget"] == 4096:
            assert r["prediction"] == full[(r["task"], r["sample"])]


def test_compiled_forwards_serve_every_sample(tiny_dir, tmp_path):
    """A compiled backend: the eager shared prefill, then one compiled forward per (rule, budget) for every sample."""
    grid = ["--tasks", "passkey", "--lengths", "300", "--rules", "snapkv,h2o", "--budgets", "32,64", "--samples", "3",
            "--max-new-tokens", "4", "--quiet"]

    def run(backend):
        assert main(["compare", "--model", tiny_dir, *grid, "--backend", backend, "--out", str(tmp_path / backend)]) == 0
        return load_rows([tmp_path / backend])

    eager, compiled = run("none"), run("aot_eager")
    assert [r["prediction"] for r in compiled] == [r["prediction"] for r in eager]
    per_config, compiled_first = {}, {}
    for r in compiled:
        per_config.setdefault((r["rule"], r["budget"]), []).append(r)
    for (rule, budget), rows in per_config.items():
        assert len(rows) == 3 and all(r["shared_prefill"] for r in rows)
        assert [r["compile_s"] for r in rows[1:]] == [0.0, 0.0]  # compiled with the first sample at most
        assert rows[-1]["compiled_graphs"] == 2  # the question append and the decode step, all samples
        compiled_first.setdefault(budget, []).append(rows[0]["compile_s"] > 0)
    # Those two calls are frozen, hence the same for every rule: compiled by one rule per budget only.
    assert all(flags.count(True) == 1 for flags in compiled_first.values()), compiled_first


def test_bad_arguments_fail_clearly(tiny_dir, tmp_path, capsys):
    def fails(argv, match):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and len(err.strip().splitlines()) == 1, err

    fails(["compare", "--model", tiny_dir, "--rules", "nope", "--out", str(tmp_path)], "unknown rule 'nope'")
    fails(["compare", "--model", tiny_dir, "--tasks", "nope", "--out", str(tmp_path)], "unknown task")
    fails(["report", str(tmp_path)], "no results")
    with pytest.raises(SystemExit):
        main(["compare", "--shard", "2/2"])
    capsys.readouterr()
    fails(["compare", "--model", tiny_dir, "--budgets", "128,12.5%", "--out", str(tmp_path)], "mix tokens and percent")
    for bad in ("0%", "150%", "x%", "12.5"):
        with pytest.raises(SystemExit):
            main(["compare", "--model", tiny_dir, "--budgets", bad, "--out", str(tmp_path)])
    capsys.readouterr()
    fails(["compare", "--model", tiny_dir, "--protocol", "query-aware,nope", "--out", str(tmp_path)],
          "unknown protocol 'nope'")


def test_help_names_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert not re.search(r"\(default: [^)]*\) \(default:", text)  # e.g. "(default: one call) (default: None)"
    assert "(default: passkey, unless --task-file" in text and "(default: 0/1)" in text
    assert "(default: one call)" in text


def test_rules_command_lists_every_rule(capsys):
    from fxbudget.rules import available

    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    assert all(f"`{name}`" in out for name in available())


@pytest.mark.model
def test_real_model_smoke(tmp_path):
    """A short real run on the embedded model: the reference finds the pass key, rows and report are complete."""
    assert main(["compare", "--tasks", "passkey", "--lengths", "600", "--rules", "full,snapkv", "--budgets", "128",
                 "--samples", "1", "--out", str(tmp_path), "--quiet"]) == 0
    rows = {r["rule"]: r for r in load_rows([tmp_path])}
    assert set(rows) == {"full", "snapkv"}
    assert rows["full"]["score"] == 1.0, rows["full"]["prediction"]
    assert rows["full"]["model"] == "Qwen2.5-Coder-0.5B-Instruct" and abs(rows["full"]["n_tokens"] - 600) <= 12
    assert rows["snapkv"]["kernel_fingerprint"] and rows["snapkv"]["shared_prefill"]
    assert rows["snapkv"]["kv_held_bytes"] < rows["full"]["kv_held_bytes"] / 2
    assert "| full (unmodified model) |" in (tmp_path / "report.md").read_text()


def test_inspect_summarizes_and_prints_one_layer(tiny_dir, capsys):
    args = ["inspect", "--model", tiny_dir, "--rule", "pyramidkv", "--budget", "16", "--tokens", "8",
            "--param", "pyramidkv.window=4"]  # the default window (32) exceeds this budget: the param must be used
    assert main(args) == 0
    out = capsys.readouterr().out
    assert rules.pyramid_budgets(16, 2, 20, 4) == [28, 4]  # each layer: its budget, 1 SDPA call rewritten
    assert "#     0  full               28               1" in out
    assert "#     1  full                4               1" in out
    assert "# SDPA calls found: 2, rewritten: 2, left unchanged (not fed by a BudgetCache): 0" in out
    assert out.count("def forward") == 1 and "topk" in out  # one layer's kernel, its eviction included
    assert "scaled_dot_product_attention" not in out and "embedding" not in out  # only the kernel region
    model, _, _ = load_model(tiny_dir, progress=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    fingerprint = kernel_fingerprint(model, ids, rule="pyramidkv", budget=16, window=4)
    assert f"# kernel fingerprint (rule ops masked): {fingerprint}" in out
    assert main([*args, "--full"]) == 0
    full = capsys.readouterr().out
    assert "embedding" in full and "scaled_dot_product_attention" not in full and len(full) > 2 * len(out)


def test_user_task_file(tiny_dir, tmp_path):
    lines = [{"context": "Notes. The vault code is 4242. More notes follow here.", "question": "What is the vault code?",
              "answer": "4242", "answer_prefix": "The code is"},
             {"context": "A list: red, green, blue.", "question": "Name two colours.", "answer": ["red", "blue"]}]
    path = tmp_path / "mytask.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["compare", "--model", tiny_dir, "--tasks", "", "--task-file", str(path), "--rules", "full,tova",
                 "--budgets", "8", "--max-new-tokens", "3", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    rows = load_rows([tmp_path / "out"])
    assert len(rows) == 4 and {r["task"] for r in rows} == {"mytask"}
    assert {tuple(r["answers"]) for r in rows} == {("4242",), ("red", "blue")}


def test_peak_memory_block_reads_cuda_only(monkeypatch):
    from fxbudget.harness import runner

    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123)
    cuda = torch.device("cuda", 0)
    assert runner.Peak(cuda).read() == 123 and calls == [cuda]  # reset when the block starts
    assert runner.Peak(torch.device("cpu")).read() is None and calls == [cuda]


def test_peaks_recorded_per_row_and_for_the_shared_prefill(tiny_dir, tmp_path, monkeypatch):
    # CUDA cannot run here: a stand-in numbers each measured block, as distinct peaks on CUDA would be.
    from fxbudget.harness import runner
    from fxbudget.models import load_model

    blocks = []

    class NumberedPeak:
        def __init__(self, device):
            blocks.append(self)
            self.n = len(blocks)

        def read(self):
            return self.n

    monkeypatch.setattr(runner, "Peak", NumberedPeak)
    model, tok, name = load_model(tiny_dir, progress=False)
    grid = runner.Grid(tasks=["passkey"], lengths=[300], rules=["full", "h2o", "knorm"], budgets=[32], samples=1)
    rows = {r["rule"]: r for r in runner.Runner(model, tok, name, grid, tmp_path, progress=False,
                                                 max_new_tokens=2).run()}
    assert rows["full"]["peak_mem_bytes"] is not None and rows["full"]["shared_prefill_peak_mem_bytes"] is None
    shared = {rows[r]["shared_prefill_peak_mem_bytes"] for r in ("h2o", "knorm")}
    assert len(shared) == 1 and None not in shared  # one shared forward, its own peak
    peaks = [rows[r]["peak_mem_bytes"] for r in ("full", "h2o", "knorm")] + list(shared)
    assert len(set(peaks)) == 4  # each row and the shared forward measured apart


def test_demo_grid_parses_and_validates():
    from fxbudget.cli import build_parser
    from fxbudget.demo import DEMO_ARGS

    args = build_parser().parse_args(DEMO_ARGS)
    assert args.protocol == ["query-agnostic", "query-aware"] and args.budgets == ["12.5%", "25%"]
    grid = runner.Grid(tasks=args.tasks, lengths=args.lengths, rules=args.rules, budgets=args.budgets,
                       samples=args.samples, protocols=args.protocol)
    grid.validate()
    assert len(runner.units(grid)) * len(runner.configs(grid)) == 8 * 2 * (1 + 5 * 2)


def test_the_tokenizer_is_loaded_once(tiny_dir, tmp_path, monkeypatch):
    """The checks load the tokenizer to build the samples; the model load reuses it (parsing a 150K vocabulary
    again costs seconds), and the rows are tokenized as the samples were."""
    loads = []
    real = AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a[0]) or real(cls, *a, **k)))
    assert main(["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--rules", "full",
                 "--samples", "1", "--max-new-tokens", "2", "--quiet", "--out", str(tmp_path)]) == 0
    assert loads == [tiny_dir]
    [row] = load_rows([tmp_path])
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    [sample] = make_samples("passkey", tok, 300, 1, seed=0)
    assert row["prompt_tokens"] == sum(x.shape[1] for x in chat_ids(tok, sample))
