"""A budget that covers the sequence reproduces the unmodified model, for every registered rule."""

import pytest
import torch

import fxbudget
from conftest import fresh, greedy, tiny_model

RULES = fxbudget.rules.available()
STEPS = 20


def _check_exact(arch: str, rule: str, backend, layers: int = 2, batch: int = 1, chunk_size=None):
    model = tiny_model(arch, layers=layers)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (batch, 24))
    with torch.no_grad():
        ref, _ = greedy(model, ids, STEPS)
        compiled = fxbudget.compile(fresh(model), rule=rule, budget=64, backend=backend, chunk_size=chunk_size)
        got, cache = greedy(compiled, ids, STEPS)
    assert (got - ref).abs().max().item() <= 1e-4
    seq = 24 + STEPS
    for i, layer in enumerate(cache.layers):
        held = sorted(p for p in cache.positions(i)[0, 0].tolist() if p >= 0)
        expect = list(range(seq - layer.sliding, seq)) if layer.sliding else list(range(seq))
        assert held == expect, f"layer {i} (sliding={layer.sliding}) holds {held}"


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_full_budget_reproduces_model_eager(arch, rule):
    _check_exact(arch, rule, backend=None)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_full_budget_batched_and_chunked_eager(arch):
    _check_exact(arch, "snapkv", backend=None, batch=2, chunk_size=7)


@pytest.mark.parametrize("rule", RULES)
def test_full_budget_reproduces_model_aot_eager_gemma3(rule):
    # The graph pass on a model with sliding-window layers (cheap: no Inductor).
    _check_exact("gemma3", rule, backend="aot_eager")


@pytest.mark.inductor
@pytest.mark.parametrize("rule", RULES)
def test_full_budget_reproduces_model_inductor(rule):
    _check_exact("llama", rule, backend="inductor", layers=1)
