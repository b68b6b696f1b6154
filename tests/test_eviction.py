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


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
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


def test_frozen_calls_share_one_compiled_runner_across_rules():
    # A frozen call evicts nothing the rule chooses, so one compiled runner serves every rule's frozen calls
    # (BudgetForward.share_frozen): each rule, after evicting with its own kernel, must still match its eager run.
    model = tiny_model("qwen2")
    torch.manual_seed(3)
    ids, question = torch.randint(0, 96, (1, 24)), torch.randint(0, 96, (1, 5))
    graphs, shared = [], None
    for rule in ("snapkv", "h2o", "knorm"):
        runs = {}
        for backend in (None, "aot_eager"):
            m = fxbudget.compile(model, rule=rule, budget=8, backend=backend, headroom=8)
            if backend is not None:
                shared = shared or fxbudget.frozen_runner(m, backend, m.forward.window, on_graph=graphs.append)
                m.forward.share_frozen(shared)
            cache = m.forward.new_cache()
            with torch.no_grad():
                m(input_ids=ids, past_key_values=cache)  # evicts down to 8 with the rule's own kernel
                with cache.frozen():
                    logits, _ = greedy(m, question, 3, cache=cache)
            m.forward.restore()
            runs[backend] = logits, [cache.positions(i) for i in range(len(cache.layers))]
        (ref_logits, ref_pos), (logits, pos) = runs[None], runs["aot_eager"]
        assert (logits - ref_logits).abs().max().item() <= 1e-4
        assert all(torch.equal(a, b) for a, b in zip(pos, ref_pos)), rule
    assert len(graphs) == 2  # the frozen question and decode graphs, compiled once for the three rules


def test_full_rule_refuses_to_evict():
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), rule="full", budget=16, backend=None)
    with torch.no_grad():
        out = m(input_ids=torch.randint(0, 96, (1, 10)))
        with pytest.raises(ValueError, match="'full' keeps everything.*budget 16"):
            m(input_ids=torch.randint(0, 96, (1, 7)), past_key_values=out.past_key_values)
