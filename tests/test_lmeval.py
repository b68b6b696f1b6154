"""lm-eval's `fxbudget` model against lm-eval's own `hf` model, on local tasks of each output type (issue 24).

Fails (never skips) without lm-eval: CI's test venv installs the [lmeval] extra. The tasks are YAML files over
JSONL written here (`dataset_path: json`), the model a tiny random Qwen2 with the embedded model's tokenizer (and
chat template). Oracles: with a budget covering every request, lm-eval's metrics and per-sample responses equal
`hf`'s (generations exactly; log-likelihoods within 1e-4 nats: fxbudget's kernel and chunked calls round
differently from SDPA); with a small budget they differ. The generation targets and multiple-choice labels are
`hf`'s own answers, so `hf` scores 1.0 and a budget that changes any answer scores less.
"""

from __future__ import annotations

import json
import math
import os
import random

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402  (no lm-eval: this file fails, it does not skip)
import pytest  # noqa: E402
import torch  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from fxbudget.lmeval import FxBudgetLM  # noqa: E402
from conftest import memoized_fingerprints  # noqa: E402

MAX_LENGTH = 48  # small, so rolling texts span several lm-eval windows and contexts get truncated like hf's
WORDS = ("the cat sat on a mat while dogs ran far away into green hills under a blue sky and birds sang songs of "
         "rain near old stone walls").split()
GEN, MC, ROLL = "fxb_gen", "fxb_mc", "fxb_roll"


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _yaml(path, task: str, data: str, body: str) -> None:
    (path / f"{task}.yaml").write_text(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                       f"    test: {data}\ntest_split: test\n{body}")


GEN_BODY = """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n\\n", "QQ"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
MC_BODY = """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLL_BODY = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def _write(path, name: str, rows: list[dict]) -> str:
    file = path / f"{name}.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(file)


def _hf(model_dir, tasks, tm, **kw):
    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32,device=cpu,"
                                   f"max_length={MAX_LENGTH}", tasks=tasks, task_manager=tm, log_samples=True,
                                   batch_size=1, **kw)


def _fx(model_dir, tasks, tm, args: str, batch_size: int = 3, **kw):
    return lm_eval.simple_evaluate(model="fxbudget", model_args=f"pretrained={model_dir},{args},"
                                   f"max_length={MAX_LENGTH}", tasks=tasks, task_manager=tm, log_samples=True,
                                   batch_size=batch_size, **kw)


def _resps(result, task):
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module", autouse=True)
def _shared_fingerprints():
    """Every evaluation here is on one tiny model: each (rule, params) fingerprint is traced once, not once per run."""
    import importlib

    with memoized_fingerprints(importlib.import_module("fxbudget.lmeval.model")):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, task manager, the hf results): a tiny random Qwen2 and three tasks whose answers are hf's own."""
    from fxbudget.models import default_cache_dir, load_default

    if not (default_cache_dir() / "tokenizer_config.json").is_file():
        load_default(progress=False)
    tok = AutoTokenizer.from_pretrained(default_cache_dir())
    torch.manual_seed(0)
    # initializer_range 0.2: peaked logits, so greedy tokens do not hinge on float rounding.
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024, tie_word_embeddings=True,
                                         initializer_range=0.2))
    root = tmp_path_factory.mktemp("lmeval")
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rng = random.Random(0)
    # Contexts of 15-40 words: some longer than MAX_LENGTH - max_gen_toks tokens, so both truncate from the left.
    gen = [{"question": _text(rng, 15 + 5 * i) + "\nQ: what next?", "answer": "?"} for i in range(6)]
    mc = [{"question": _text(rng, 14 + 3 * i) + " Answer:", "choices": [" " + _text(rng, 1 + j % 3) for j in range(4)],
           "label": 0} for i in range(6)]
    roll = [{"text": _text(rng, 30 + 15 * i)} for i in range(3)]
    tasks = root / "tasks"
    tasks.mkdir()
    _yaml(tasks, GEN, _write(tasks, "gen_probe", gen), GEN_BODY)
    _yaml(tasks, MC, _write(tasks, "mc_probe", mc), MC_BODY)
    _yaml(tasks, ROLL, _write(tasks, "roll", roll), ROLL_BODY)
    probe = _hf(model_dir, [GEN, MC], TaskManager(include_path=str(tasks)))
    for row, resp in zip(gen, _resps(probe, GEN)):
        row["answer"] = resp[0][0]
    for row, resp in zip(mc, _resps(probe, MC)):
        row["label"] = max(range(4), key=lambda j: float(resp[j][0][0]))
    _write(tasks, "gen_probe", gen)
    _write(tasks, "mc_probe", mc)
    assert len({r["answer"] for r in gen}) > 1 and len({r["label"] for r in mc}) > 1  # not a degenerate oracle
    tm = TaskManager(include_path=str(tasks))
    return str(model_dir), tm, _hf(model_dir, [GEN, MC, ROLL], tm)


def _loglikelihoods(result):
    return [float(c[0][0]) for r in _resps(result, MC) for c in r]


def _perplexities(result):
    return {k: v for k, v in result["results"][ROLL].items() if k.split(",")[0] in
            ("word_perplexity", "byte_perplexity", "bits_per_byte")}


def test_hf_oracle_scores_one(setup):
    _, _, hf = setup
    assert hf["results"][GEN]["exact_match,none"] == 1.0
    assert hf["results"][MC]["acc,none"] == 1.0


@pytest.mark.parametrize("args", ["rule=snapkv,budget=512,protocol=query-aware",
                                  "rule=h2o,budget=100%,protocol=query-aware,chunk_size=5",
                                  "rule=knorm,budget=512,protocol=streaming",
                                  "rule=snapkv,budget=1MiB,protocol=query-aware"])
def test_covering_budget_equals_hf(setup, args):
    model_dir, tm, hf = setup
    fx = _fx(model_dir, [GEN, MC, ROLL], tm, args)
    assert _resps(fx, GEN) == _resps(hf, GEN)  # the generated text, exactly
    assert fx["results"][GEN]["exact_match,none"] == 1.0
    assert fx["results"][MC]["acc,none"] == hf["results"][MC]["acc,none"]
    assert fx["results"][MC]["acc_norm,none"] == hf["results"][MC]["acc_norm,none"]
    assert max(abs(a - b) for a, b in zip(_loglikelihoods(fx), _loglikelihoods(hf))) < 1e-4
    greedy = [c[0][1] for r in _resps(fx, MC) for c in r]
    assert greedy == [c[0][1] for r in _resps(hf, MC) for c in r]
    for key, value in _perplexities(hf).items():
        assert math.isclose(_perplexities(fx)[key], value, rel_tol=1e-5), key
    info = fx["config"]["fxbudget"]
    assert info["allocation"] == "uniform" and info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["rule"] in args and info["protocol"] in args and len(info["kernel_fingerprint"]) == 64
    assert set(info["versions"]) >= {"fxbudget", "lm_eval", "torch", "transformers"}


def test_small_budget_changes_every_output_type(setup):
    model_dir, tm, hf = setup
    fx = _fx(model_dir, [GEN, MC, ROLL], tm, "rule=snapkv,budget=6,protocol=query-aware,window=2,kernel=3")
    assert fx["results"][GEN]["exact_match,none"] < 1.0  # some answer changed
    assert max(abs(a - b) for a, b in zip(_loglikelihoods(fx), _loglikelihoods(hf))) > 1e-2
    assert not math.isclose(_perplexities(fx)["word_perplexity,none"], _perplexities(hf)["word_perplexity,none"],
                            rel_tol=1e-3)
    info = fx["config"]["fxbudget"]
    assert info["budget"] == 6 and info["rule_params"]["window"] == 2 and info["observation_window"] == 2


def test_a_byte_budget_runs_as_the_tokens_it_buys(setup):
    """3900 B on this model (2 layers, 2 KV heads, head_dim 16, float32): 144 B of per-head totals, then 624 B per
    entry per layer and KV head (K, V and bookkeeping: `cache.byte_budget`), so 6 entries: budget=6's results."""
    model_dir, tm, _ = setup
    args = "rule=snapkv,protocol=query-aware,window=2,kernel=3"
    by_bytes, by_tokens = (_fx(model_dir, [GEN, MC], tm, f"{args},budget={b}") for b in ("3900B", 6))
    assert _resps(by_bytes, GEN) == _resps(by_tokens, GEN)
    assert _loglikelihoods(by_bytes) == _loglikelihoods(by_tokens)
    info = by_bytes["config"]["fxbudget"]
    assert (info["budget"], info["budget_bytes"], info["budget_tokens"]) == ("3900B", 3900, 6)
    assert info["budget_kind"].startswith("bytes") and info["budgets_used"] == [6]


def test_quantized_slots_buy_more_tokens_in_the_same_bytes(setup):
    model_dir, tm, _ = setup
    fx = _fx(model_dir, [GEN], tm, "rule=snapkv,protocol=query-aware,budget=3900B,slot_dtype=int8")
    info = fx["config"]["fxbudget"]
    # int8: a key or value row is 16 + 4 bytes instead of 64, an entry 68 B with its bookkeeping instead of 156, so
    # 3900 B (144 B of totals) hold 13 entries per layer and KV head where float32 slots hold 6
    assert info["slot_dtype"] == "int8" and info["budget_tokens"] == 13 and info["budgets_used"] == [13]


def test_batch_size_does_not_change_results(setup):
    """Left-padded batches: a row's result does not depend on what it is batched with."""
    model_dir, tm, _ = setup
    args = "rule=tova,budget=7,protocol=query-aware"
    one, four = (_fx(model_dir, [GEN, MC, ROLL], tm, args, batch_size=b) for b in (1, 4))
    assert _resps(one, GEN) == _resps(four, GEN)
    assert max(abs(a - b) for a, b in zip(_loglikelihoods(one), _loglikelihoods(four))) < 1e-4
    assert math.isclose(_perplexities(one)["word_perplexity,none"], _perplexities(four)["word_perplexity,none"],
                        rel_tol=1e-5)


def test_requests_sharing_a_context_share_its_prefill(setup, monkeypatch):
    """A multiple-choice doc asks 4 continuations of one context: one prefilled row per doc, not per choice."""
    from fxbudget.lmeval.engine import Budgeted

    model_dir, tm, _ = setup
    rows = []
    original = Budgeted.prefill
    monkeypatch.setattr(Budgeted, "prefill",
                        lambda self, forward, seqs, h: rows.extend(seqs) or original(self, forward, seqs, h))
    fx = _fx(model_dir, [MC], tm, "rule=snapkv,budget=6,protocol=query-aware", batch_size=4)
    docs = len(fx["samples"][MC])
    assert len(rows) == docs and len({tuple(r) for r in rows}) == docs


# --- query-agnostic: the chat template's last user turn is the question --------------------------------------------
def test_chat_template_marks_the_last_user_turn(setup):
    model_dir, _, _ = setup
    lm = FxBudgetLM(pretrained=model_dir, budget=8, protocol="query-agnostic")
    history = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"},
               {"role": "user", "content": "the real question"}]
    text = lm.apply_chat_template(history)
    at = lm._question_at[text]
    assert text[at:].startswith("the real question") and "first answer" in text[:at]
    ids = lm.tok_encode(text)
    k = lm._prefilled(text, ids, len(ids))
    assert lm.tok_decode(ids[k:], skip_special_tokens=False).startswith("the real question")
    with pytest.raises(ValueError, match="apply_chat_template"):
        lm._prefilled("no template here", ids, len(ids))


def test_query_agnostic_with_chat_template(setup):
    """Covering: equal to hf with the same chat template; small: the question's own queries no longer choose what is
    kept, so the results differ from query-aware's at the same budget."""
    model_dir, tm, _ = setup
    hf = _hf(model_dir, [GEN, MC], tm, apply_chat_template=True)
    cover = _fx(model_dir, [GEN, MC], tm, "rule=snapkv,budget=512,protocol=query-agnostic", apply_chat_template=True)
    assert _resps(cover, GEN) == _resps(hf, GEN)
    assert max(abs(a - b) for a, b in zip(_loglikelihoods(cover), _loglikelihoods(hf))) < 1e-4
    small = {p: _fx(model_dir, [MC], tm, f"rule=snapkv,budget=6,window=4,protocol={p}", apply_chat_template=True)
             for p in ("query-agnostic", "query-aware")}
    agnostic, aware = (_loglikelihoods(small[p]) for p in ("query-agnostic", "query-aware"))
    assert max(abs(a - b) for a, b in zip(agnostic, aware)) > 1e-2
    assert max(abs(a - b) for a, b in zip(agnostic, _loglikelihoods(hf))) > 1e-2


def test_query_agnostic_with_a_question_marker(setup):
    """question_marker: the question starts at its last occurrence ("\\nQ:" in the generation task's prompts)."""
    model_dir, tm, hf = setup
    args = "rule=snapkv,protocol=query-agnostic,question_marker=\\nQ:"
    cover = _fx(model_dir, [GEN], tm, f"{args},budget=512")
    assert _resps(cover, GEN) == _resps(hf, GEN)
    small = _fx(model_dir, [GEN], tm, f"{args},budget=50%,window=4,kernel=3")
    whole = _fx(model_dir, [GEN], tm, "rule=snapkv,protocol=query-aware,budget=50%,window=4,kernel=3")
    # 50% of the part before the marker, not of the whole context: the question's tokens were not prefilled.
    assert max(small["config"]["fxbudget"]["budgets_used"]) < max(whole["config"]["fxbudget"]["budgets_used"])
    assert _resps(small, GEN) != _resps(hf, GEN)


def test_query_agnostic_without_a_mark_is_refused(setup):
    model_dir, tm, _ = setup
    with pytest.raises(ValueError, match="query-agnostic.*apply_chat_template"):
        _fx(model_dir, [MC], tm, "rule=snapkv,budget=6,protocol=query-agnostic")


# --- registration and bad input ------------------------------------------------------------------------------------
def test_registered_with_lm_eval():
    import importlib.metadata

    from lm_eval.api.registry import get_model

    assert get_model("fxbudget") is FxBudgetLM
    (ep,) = [e for e in importlib.metadata.entry_points(group="lm_eval.models") if e.name == "fxbudget"]
    assert ep.load() is FxBudgetLM  # what lm-eval releases with entry-point discovery load


@pytest.mark.parametrize("args, match", [
    ("rule=nope,budget=8", "unknown rule 'nope'; known rules: "),
    ("rule=snapkv", "budget= is required"),
    ("rule=snapkv,budget=64,slot_dtype=fp16", "slot_dtype must be one of model, float8_e4m3fn, int8, int4"),
    ("budget=0", "positive int"),
    ("budget=150%", r"percentage in \(0, 100\]"),
    ("budget=lots", "percentage"),
    ("budget=8,protocol=sometimes", "protocol must be one of query-agnostic, query-aware, streaming"),
    ("budget=8,backend=tensorrt", "backend must be none"),
    ("budget=8,chunk_size=0", "chunk_size must be an int >= 1"),
    ("rule=h2o,budget=8,window=4", "rule 'h2o' has no window hyperparameter"),
    ("rule=snapkv,budget=8,kernel=4", "kernel must be a positive odd int"),
    ("budget=8,dtype=float8", "dtype must be one of"),
    ("budget=8,batch_size=auto", "batch_size=auto is not supported"),
    ("budget=8,parallelize=True", "unknown argument"),
    ("budget=8,question_marker=Q:", "question_marker is for protocol=query-agnostic"),
    ("rule=kvzip,budget=8", "evicts only in its own replay protocol"),  # issue 29, finding 8: refused before load
    ("rule=adakv:kvzip,budget=8", "evicts only in its own replay protocol"),
    ("rule=snapkvv,budget=8", "did you mean 'snapkv'"),
])
def test_bad_model_args_fail_before_any_model_is_loaded(args, match, monkeypatch):
    from fxbudget.lmeval import ModelArgsError, loading

    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ModelArgsError, match=match):
        FxBudgetLM.create_from_arg_string(f"pretrained=/nonexistent,{args}")


@pytest.mark.parametrize("rule, name", [("adakv:snapkv", "adakv:snapkv"), ("SnapKV", "snapkv"),
                                        ("AdaKV:H2O", "adakv:h2o")])
def test_model_args_accept_what_compare_accepts(rule, name, monkeypatch):
    """Issue 29, finding 8: the wrappers `fxbudget rules` lists, and names in any case, as `compare` takes them."""
    from fxbudget.lmeval.options import parse

    opts = parse({"rule": rule, "budget": 64, "alpha": 0.3} if rule.lower().startswith("adakv")
                 else {"rule": rule, "budget": 64})
    assert opts.rule.name == name
    if name.startswith("adakv"):
        assert opts.rule.alpha == 0.3 and opts.rule.head_adaptive


def _run(code: str, *args: str):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)


def test_command_line_reports_bad_model_args_in_one_line(setup, tmp_path):
    model_dir, _, _ = setup
    _yaml(tmp_path, MC, _write(tmp_path, "mc", [{"question": "q", "choices": [" a", " b"], "label": 0}]), MC_BODY)
    proc = _run("import sys; from fxbudget.lmeval.__main__ import main; sys.exit(main(sys.argv[1:]))",
                "--model", "fxbudget", "--model_args", f"pretrained={model_dir},rule=nope,budget=8",
                "--tasks", MC, "--include_path", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: fxbudget model_args: unknown rule 'nope'"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_without_lm_eval_fxbudget_imports_and_names_the_extra():
    code = """
import sys
sys.modules["lm_eval"] = None  # as if lm-eval were not installed
import fxbudget, fxbudget.cli, fxbudget.harness.runner, fxbudget.lmeval
from fxbudget.lmeval.__main__ import main
assert main(["--model", "fxbudget"]) == 2
try:
    from fxbudget.lmeval import FxBudgetLM
except ImportError as e:
    print("IMPORT-ERROR:", e)
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "IMPORT-ERROR:" in proc.stdout and "pip install 'flexbudget[lmeval]'" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "flexbudget[lmeval]" in proc.stderr


def test_model_args_win_over_the_command_lines_device_and_batch_size(setup):
    """lm-eval's CLI always passes device (cuda:0 by default) and batch_size; `device=` in --model_args must not
    fail with "multiple values for keyword argument" (as it does for lm-eval's own hf model)."""
    model_dir, _, _ = setup
    lm = FxBudgetLM.create_from_arg_obj({"pretrained": model_dir, "budget": 8, "device": "cpu", "batch_size": 3},
                                        {"device": "cuda:0", "batch_size": 1, "max_batch_size": None})
    assert str(lm.device) == "cpu" and lm.batch_size == 3


def test_kernel_fingerprint_is_read_from_the_fingerprint_cache(setup, tmp_path, monkeypatch):
    """The recorded fingerprint is compare's (the probe's) and, traced once, is read back from the on-disk cache by
    the next evaluation (`kernel_fingerprint_cached`)."""
    import fxbudget
    import fxbudget.lmeval.model as lm_model

    model_dir, _, _ = setup
    monkeypatch.setenv("FXBUDGET_CACHE", str(tmp_path / "cache"))
    calls = []
    traced = lm_model.kernel_fingerprint
    monkeypatch.setattr(lm_model, "kernel_fingerprint", lambda *a, **k: calls.append(k["rule"].name) or traced(*a, **k))
    lms = [FxBudgetLM(pretrained=model_dir, rule="tova", budget=8) for _ in range(2)]
    infos = [lm.conditions() for lm in lms]
    assert calls == ["tova"]  # the second evaluation traced nothing
    assert [i["kernel_fingerprint_cached"] for i in infos] == [False, True]
    assert infos[0]["kernel_fingerprint"] == infos[1]["kernel_fingerprint"] == \
        fxbudget.kernel_fingerprint(lms[0].model, rule="tova", budget=8, signals=None)  # traced from scratch,
    # uncached, measuring what the evaluated rule reads (the kernel it compiles: its signal set)
    assert infos[0]["signals"] == "last_attn"
    assert len(list((tmp_path / "cache" / "fingerprints").glob("*.json"))) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_device_without_cuda_is_one_clear_message(monkeypatch):
    from fxbudget.lmeval import ModelArgsError, loading

    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ModelArgsError, match="no CUDA device: pass --device cpu"):
        FxBudgetLM.create_from_arg_obj({"pretrained": "/nonexistent", "budget": 8}, {"device": "cuda:0"})


def test_compiled_backend_equals_the_eager_kernel(setup):
    """backend=aot_eager (the compiled path: bucketed calls, frozen graphs) gives the eager kernel's results."""
    from lm_eval.api.instance import Instance

    model_dir, _, _ = setup
    ctx = [f"the cat sat on a mat number {i} and then" for i in range(3)]
    requests = {
        "loglikelihood": [Instance("loglikelihood", {}, (c, k), 0) for c in ctx for k in (" ran", " sat far away")],
        "loglikelihood_rolling": [Instance("loglikelihood_rolling", {}, (" ".join(WORDS),), 0)],
        "generate_until": [Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 5}), 0) for c in ctx],
    }
    got = {}
    for backend in ("none", "aot_eager"):
        lm = FxBudgetLM(pretrained=model_dir, budget=6, rule="snapkv", window=2, kernel=3, backend=backend,
                        batch_size=2, max_length=MAX_LENGTH)
        got[backend] = {kind: getattr(lm, kind)(reqs) for kind, reqs in requests.items()}
    eager, compiled = got["none"], got["aot_eager"]
    assert compiled["generate_until"] == eager["generate_until"]
    assert [g for _, g in compiled["loglikelihood"]] == [g for _, g in eager["loglikelihood"]]
    assert max(abs(a[0] - b[0]) for a, b in zip(compiled["loglikelihood"], eager["loglikelihood"])) < 1e-4
    assert math.isclose(compiled["loglikelihood_rolling"][0], eager["loglikelihood_rolling"][0], rel_tol=1e-5)


MC1 = "fxb_mc1"


@pytest.mark.parametrize("protocol", ["query-aware", "streaming"])
def test_single_token_choices_move_with_the_budget(setup, tmp_path, protocol):
    """Issue 29, finding 6: a one-token continuation (multiple choice as " A"/" B") is scored by the logits of a call
    over the compressed cache, so its log-likelihood depends on the budget (it did not: the prefill's own last
    logits scored it, the same at budget 4 and 512)."""
    model_dir, _, _ = setup
    rng = random.Random(1)
    letters = ["A", "B", "C", "D"]  # lm-eval prepends its target delimiter " ": one token each (checked below)
    rows = [{"question": _text(rng, 20 + 2 * i) + " Answer:", "choices": letters, "label": i % 4} for i in range(4)]
    _yaml(tmp_path, MC1, _write(tmp_path, "mc1", rows), MC_BODY)
    tm = TaskManager(include_path=str(tmp_path))
    small, big = (_fx(model_dir, [MC1], tm, f"rule=snapkv,budget={b},protocol={protocol},window=2,kernel=3")
                  for b in (4, 512))
    lls = [[float(c[0][0]) for r in _resps(res, MC1) for c in r] for res in (small, big)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert all(len(tok(" " + x, add_special_tokens=False).input_ids) == 1 for x in letters)
    hf = _hf(model_dir, [MC1], tm)
    assert max(abs(a - b) for a, b in zip(lls[1], [float(c[0][0]) for r in _resps(hf, MC1) for c in r])) < 1e-4
    assert max(abs(a - b) for a, b in zip(*lls)) > 1e-3  # the budget reaches the one scored token


def test_question_marker_ruler_finds_rulers_question(tok):
    """`question_marker=ruler`: the question of a RULER prompt starts where RULER's template puts it (kvpress's split),
    found without a hand-written marker; a prompt of no RULER family is refused, never cut elsewhere."""
    from types import SimpleNamespace

    from fxbudget.harness.tasks.ruler import RULER_TASKS
    from fxbudget.lmeval.options import parse

    def prefilled(context):
        # one token per character: every position is a token boundary
        fake = SimpleNamespace(opts=parse({"budget": 8, "protocol": "query-agnostic", "question_marker": "ruler"}),
                               _question_at={}, tok_encode=lambda text: list(range(len(text))))
        ids = list(range(len(context)))
        return FxBudgetLM._prefilled(fake, context, ids, len(ids))

    sample = RULER_TASKS["ruler:niah_single_1"](tok, 1024, seed=0)
    prompt = sample.context + sample.question
    assert prefilled(prompt) == len(sample.context)
    with pytest.raises(ValueError, match="question_marker"):
        prefilled("a context with no question of any RULER family")


def test_a_ruler_prompt_without_a_marker_is_told_question_marker_ruler(tok):
    """Query-agnostic without a marker on RULER's own prompt (lm-eval's `ruler` tasks, `--tasks niah_single_1`): the
    one-line error names `question_marker=ruler`; another unmarked context keeps the general message."""
    from types import SimpleNamespace

    from fxbudget.harness.tasks.ruler import RULER_TASKS
    from fxbudget.lmeval.options import parse

    fake = SimpleNamespace(opts=parse({"budget": 8, "protocol": "query-agnostic"}), _question_at={},
                           tok_encode=lambda text: list(range(len(text))))
    sample = RULER_TASKS["ruler:niah_single_1"](tok, 1024, seed=0)
    prompt = sample.context + sample.question
    with pytest.raises(ValueError, match=r"is a RULER prompt .*: give question_marker=ruler,") as e:
        FxBudgetLM._prefilled(fake, prompt, list(range(len(prompt))), len(prompt))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--apply_chat_template") as e:
        FxBudgetLM._prefilled(fake, "no question here", list(range(16)), 16)
    assert "RULER" not in str(e.value)
