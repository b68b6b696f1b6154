"""`fxbudget compare` end to end on a tiny random model (CLI, rows, report, plots, resume, shards, protocols)."""

import csv
import json

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from fxbudget.cli import main
from fxbudget.harness.report import load_rows
from fxbudget.models import default_cache_dir, load_default

GRID = ["--tasks", "passkey,niah_multikey", "--lengths", "300", "--rules", "full,snapkv,streamingllm,h2o",
        "--budgets", "32,4096", "--samples", "2", "--max-new-tokens", "4", "--quiet"]
ROW_FIELDS = ("model", "rule", "rule_params", "budget", "protocol", "chunk_size", "window", "dtype", "device", "torch",
              "transformers", "kernel_fingerprint", "peak_mem_bytes", "kv_bytes", "prefill_s", "decode_s",
              "compile_s", "output_tokens", "prediction", "score", "depth", "n_tokens", "answers", "malloc")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Qwen2 with the embedded model's tokenizer, saved as a local model directory."""
    path = default_cache_dir()
    if not (path / "tokenizer_config.json").is_file():
        load_default(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=8192, tie_word_embeddings=True))
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def compare(tiny_dir, out, *extra):
    assert main(["compare", "--model", tiny_dir, *GRID, "--out", str(out), *extra]) == 0
    return {r["key"]: r for r in load_rows([out])}


@pytest.fixture(scope="module")
def single_run(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return out, compare(tiny_dir, out)


def test_rows_report_and_plots(single_run):
    out, rows = single_run
    assert len(rows) == 2 * 2 * (1 + 3 * 2)  # tasks x samples x (reference + rules x budgets)
    for r in rows.values():
        missing = [f for f in ROW_FIELDS if f not in r]
        assert not missing, missing
        assert r["protocol"] == "query-agnostic" and 0.0 <= r["score"] <= 1.0
        assert r["malloc"] == "glibc heap only, no trim"  # compare keeps freed heap pages (harness/malloc.py)
    budgeted = [r for r in rows.values() if r["rule"] != "full"]
    assert len({r["kernel_fingerprint"] for r in budgeted}) == 1  # one shared kernel
    assert all(r["shared_prefill"] for r in budgeted)
    small = [r for r in budgeted if r["budget"] == 32]
    assert all(r["kv_bytes"] < min(x["kv_bytes"] for x in rows.values() if x["rule"] == "full") for r in small)
    for name in ("report.md", "summary.csv", "accuracy_vs_budget.png", "heatmap_snapkv.png", "run.json"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "| full (unmodified model) |" in report and "one shared kernel" in report
    summary = list(csv.DictReader((out / "summary.csv").open()))
    assert {s["rule"] for s in summary} == {"full", "snapkv", "streamingllm", "h2o"}


def test_budget_covering_context_equals_full(single_run):
    """With a budget >= the context nothing is evicted: every rule answers exactly what the unmodified model does."""
    _, rows = single_run
    full = {(r["task"], r["sample"]): r["prediction"] for r in rows.values() if r["rule"] == "full"}
    covering = [r for r in rows.values() if r["budget"] == 4096]
    assert len(covering) == 12
    for r in covering:
        assert r["prediction"] == full[(r["task"], r["sample"])], (r["rule"], r["task"], r["sample"])


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
    rows = compare(tiny_dir, tmp_path, "--protocol", protocol, "--chunk-size", "128", "--backend", backend)
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


def test_bad_arguments_fail_clearly(tiny_dir, tmp_path):
    with pytest.raises(SystemExit, match="unknown rule 'nope'"):
        main(["compare", "--model", tiny_dir, "--rules", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown task"):
        main(["compare", "--model", tiny_dir, "--tasks", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no results"):
        main(["report", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["compare", "--shard", "2/2"])


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
    assert rows["snapkv"]["kv_bytes"] < rows["full"]["kv_bytes"] / 2
    assert "| full (unmodified model) |" in (tmp_path / "report.md").read_text()


def test_inspect_prints_the_rewritten_graph(tiny_dir, capsys):
    assert main(["inspect", "--model", tiny_dir, "--rule", "h2o", "--budget", "16", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "def forward" in out and "topk" in out  # the kernel's eviction is in the graph
    assert "scaled_dot_product_attention" not in out  # every SDPA call was rewritten
    assert "# kernel fingerprint (rule ops masked): " in out


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
