"""The second embedded model, Gemma 3 270M (base): loaded from its PyPI chunks, prompted without a chat template, and
a budget applied to its full-attention layers only (its sliding layers keep their window of 512).

Runs the eager kernel (backend=None), as tests/test_real_model.py does for the default model.
"""

import pytest
import torch

import fxbudget
from conftest import assert_covering_budget_exact, generated
from fxbudget.cache.keyword import output_cache
from fxbudget.models.embedded import GEMMA3_270M
from fxbudget.harness.tasks import chat_ids, passkey
from fxbudget.models.layer_config import budgeted_layers_line
from fxbudget.models import default_model_available, load_embedded

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not default_model_available(GEMMA3_270M),
                       reason=f"{GEMMA3_270M.name} weights not installed: {GEMMA3_270M.install_hint}"),
]


@pytest.fixture(scope="module")
def loaded():
    return load_embedded(GEMMA3_270M, progress=False)


def test_loads_as_a_base_model_with_its_windows(loaded):
    model, tok = loaded
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa" and not model.training
    assert tok.chat_template is None  # a base model: the tasks prompt it as plain text
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.sliding_window, cfg.num_key_value_heads, cfg.head_dim) == (18, 512, 1, 256)
    assert budgeted_layers_line(cfg) == ("a budget applies to 3 of 18 layers (full attention: 5, 11, 17); the 15 "
                                         "sliding layers keep their window of 512 tokens")


def test_passkey_prompt_is_a_completion_after_bos(loaded):
    _, tok = loaded
    sample = passkey(tok, 300, seed=1)
    ctx, question = chat_ids(tok, sample)
    assert ctx[0, 0].item() == tok.bos_token_id and (ctx[0, 1:] != tok.bos_token_id).all()
    assert tok.decode(ctx[0, 1:]) == sample.context
    assert tok.decode(question[0]) == f"\n\n{sample.question}\nAnswer: The pass key is"


def test_covering_budget_reproduces_model_past_the_window(loaded):
    """700 tokens: the sliding layers' window (512) is in force, and the covering budget changes no greedy token."""
    model, tok = loaded
    sample = passkey(tok, 700, seed=3)
    ids = torch.cat(chat_ids(tok, sample), dim=1)
    assert ids.shape[1] > 512
    assert_covering_budget_exact(model, tok, ids, sample.answer)


def test_snapkv_budget_256_finds_passkey(loaded):
    model, tok = loaded
    sample = passkey(tok, 1500, seed=2)
    ids = torch.cat(chat_ids(tok, sample), dim=1)
    fxbudget.compile(model, rule="snapkv", budget=256, backend=None)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        cache = output_cache(out)
        kinds = model.config.layer_types
        held = [int((cache.positions(i) >= 0).sum(-1).max()) for i in range(len(kinds))]
        answer = tok.decode(generated(model, ids), skip_special_tokens=True)
    finally:
        model.forward.restore()
    # The budget on the full-attention layers only; a sliding layer holds its window.
    assert {h for h, k in zip(held, kinds) if k == "full_attention"} == {256}, held
    assert {h for h, k in zip(held, kinds) if k == "sliding_attention"} == {512}, held
    assert sample.answer in answer, answer
