"""With budget < sequence: compiled == eager (positions and logits), and rules keep what they promise."""

import pytest
import torch

import fxbudget
from conftest import fresh, greedy, tiny_model

RULES = [r for r in fxbudget.rules.available() if r != "full"]  # `full` never evicts: tested below
PARAMS = {"pyramidkv": {"window": 4}}  # small budgets need a small observation window


def _run(model, rule, backend, ids, budget, chunk_size, steps=10):
    with torch.no_grad():
        m = fxbudget.compile(fresh(model), rule=rule, budget=budget, backend=backend, chunk_size=chunk_size,
                             **PARAMS.get(rule, {}))
        logits, cache = greedy(m, ids, steps)
    return logits, cache


def _compare_paths(arch, rule, backend, layers=2, budget=12, chunk_size=8):
    model = tiny_model(arch, layers=layers)
    torch.manual_seed(2)
    ids = torch.randint(0, 96, (2, 30))
    ref_logits, ref_cache = _run(model, rule, None, ids, budget, chunk_size)
    logits, cache = _run(model, rule, backend, ids, budget, chunk_size)
    for i in range(len(cache.layers)):
        assert torch.equal(cache.positions(i), ref_cache.positions(i)), f"layer {i} keeps different tokens"
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    # The cache really evicted: each budgeted layer holds exactly its budget of the 40 tokens seen.
    for i, layer in enumerate(cache.layers):
        if not layer.sliding:
            assert int((cache.positions(i) >= 0).sum(-1).max()) == layer.budget < 40


@pytest.mark.parametrize("arch, rule", [
    pytest.param(arch, rule, marks=pytest.mark.newest if (arch, rule) in (("llama", "snapkv"), ("gemma3", "h2o"))
                 else ()) for arch in ("llama", "gemma3") for rule in RULES])
def test_aot_eager_equals_eager(arch, rule):
    _compare_paths(arch, rule, "aot_eager")


@pytest.mark.inductor
@pytest.mark.parametrize("rule", ["snapkv", "h2o"])
def test_inductor_equals_eager(rule):
    _compare_paths("llama", rule, "inductor", layers=1)


def test_streamingllm_keeps_sinks_and_recent():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 37))
    _, cache = _run(model, "streamingllm", None, ids, budget=10, chunk_size=5, steps=6)
    seen = 37 + 6
    for i in range(len(cache.layers)):
        for row in cache.positions(i).reshape(-1, 10):
            assert sorted(row.tolist()) == [0, 1, 2, 3] + list(range(seen - 6, seen))


def test_window_rule_keeps_most_recent():
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (1, 20))
    _, cache = _run(model, "window", None, ids, budget=7, chunk_size=None, steps=3)
    assert sorted(cache.positions(0)[0, 1].tolist()) == list(range(23 - 7, 23))


def test_frozen_headroom_appends_without_eviction():
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=8, backend=None)
    cache = fxbudget.BudgetCache(model.config, 8, headroom=6)
    with torch.no_grad():
        m(input_ids=torch.randint(0, 96, (1, 20)), past_key_values=cache)  # context, evicted down to 8
        context = set(cache.positions(0)[0, 0].tolist()) - {-1}
        assert len(context) == 8
        with cache.frozen():
            m(input_ids=torch.randint(0, 96, (1, 4)), past_key_values=cache)  # question: all kept
            m(input_ids=torch.randint(0, 96, (1, 1)), past_key_values=cache)
            held = set(cache.positions(0)[0, 0].tolist()) - {-1}
            assert held == context | {20, 21, 22, 23, 24}
            with pytest.raises(RuntimeError, match="headroom"):
                m(input_ids=torch.randint(0, 96, (1, 2)), past_key_values=cache)
        m(input_ids=torch.randint(0, 96, (1, 1)), past_key_values=cache)  # eviction back on: down to budget
        assert int((cache.positions(0)[0, 0] >= 0).sum()) == 8
    assert cache.get_seq_length().item() == 26  # the refused call did not run


def test_full_rule_refuses_to_evict():
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), rule="full", budget=16, backend=None)
    with torch.no_grad():
        out = m(input_ids=torch.randint(0, 96, (1, 10)))
        with pytest.raises(ValueError, match="'full' keeps everything.*budget 16"):
            m(input_ids=torch.randint(0, 96, (1, 7)), past_key_values=out.past_key_values)


def _attention_layer() -> torch.nn.Module:
    """Attention only: the call's K/V through the BudgetCache, then SDPA (what the pass rewrites). A new class per
    call: Dynamo caches compiled graphs per code object, and one per rule would pass its recompile limit."""

    class AttentionLayer(torch.nn.Module):
        def forward(self, q, k, v, past_key_values):
            keys, values = past_key_values.update(k, v, 0)
            return torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    return AttentionLayer()


def _full_layer(budget: int, seed: int = 0):
    """A one-layer BudgetCache holding `budget` tokens in shuffled slots (so every call evicts), and a call of 3."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          hidden_size=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cache = fxbudget.BudgetCache(cfg, budget)
    g = torch.Generator().manual_seed(seed)
    L = cache.layers[0]
    L.keys.copy_(torch.randn(L.keys.shape, generator=g))
    L.values.copy_(torch.randn(L.values.shape, generator=g))
    L.pos.copy_(torch.stack([torch.randperm(budget, generator=g) for _ in range(2)]).unsqueeze(0))
    L.state.copy_(torch.rand(L.state.shape, generator=g))
    L.norms.copy_(torch.stack([L.keys.norm(dim=-1), L.values.norm(dim=-1)], dim=-1))
    L.seen.fill_(budget)
    call = (torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g),
            torch.randn(1, 2, 3, 8, generator=g))
    return cache, call


@pytest.mark.inductor
@pytest.mark.parametrize("rule", RULES)
def test_inductor_layer_evicts_like_eager(rule):
    # Every rule compiled by Inductor with eviction, at layer level (one small graph each): the same kept slots,
    # state and output as the eager kernel.
    from fxbudget.backend import kernel_window, make_backend
    from fxbudget.eager import BudgetAttentionMode

    params = {"snapkv": {"window": 2}, "pyramidkv": {"window": 2}}.get(rule, {})
    eager_cache, call = _full_layer(8)
    compiled_cache, _ = _full_layer(8)
    r = fxbudget.rules.get(rule, **params)
    with torch.no_grad():
        with BudgetAttentionMode(r, kernel_window(r), fxbudget.rules.get("window")):
            expected = _attention_layer()(*call, eager_cache)
        torch._dynamo.reset()  # one layer class for every rule: without a reset the 9th rule hits the recompile limit
        layer = torch.compile(_attention_layer(), backend=make_backend(r), fullgraph=True, dynamic=False)
        out = layer(*call, compiled_cache)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    a, b = eager_cache.layers[0], compiled_cache.layers[0]
    assert torch.equal(a.pos, b.pos)
    for name in ("keys", "values", "state", "norms", "totals"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-5, atol=1e-5, msg=name)
    assert int((b.pos >= 0).sum()) == 2 * 8  # each KV head kept 8 of its 11 candidates
