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
                                  "rule=knorm,budget=512,protocol=streaming"])
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


def test_batch_size_does_not_change_results(setup):
    """Left-padded batches: a row's result does not depend on what it is batched with."""
    model_dir, tm, _ = setup
    args = "rule=tova,budget=7,protocol=query-aware"
    one, four = (_fx(model_dir, [GEN, MC, ROLL], tm, args, batch_size=b) for b in (1, 4))
    assert _resps(one, GEN) == _resps(four, GEN)
    assert max(abs(a - b) for a, b in zip(_loglikelihoods(one), _loglikelihoods(four))) < 1e-4
    assert math.isclose(_perplexities(one)["word_perplexity,none"], _perplexities(four)["word_perplexity,none"],
                        rel_tol=1e-5)
