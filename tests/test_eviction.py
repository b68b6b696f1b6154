"""With budget < sequence: compiled == eager (positions and logits), and rules keep what they promise."""

import pytest
import torch

import fxbudget
from conftest import fresh, greedy, tiny_model

# `full` never evicts: tested below; kvzip evicts only in its replay protocol (tests/test_kvzip.py)
RULES = fxbudget.rules.plain_generation_rules()
PARAMS = {"pyramidkv": {"window": 4}}  # small budgets need a small observation window


def _run(model, rule, backend, ids, budget, chunk_size, steps=10):
    with torch.no_grad():
        m = fxbudget.compile(fresh(model), rule=rule, budget=budget, backend=backend, chunk_size=chunk_size,
                             **PARAMS.get(rule, {}))
        logits, cache = greedy(m, ids, steps)
    return logits, cache


def _compare_paths(arch, rule, backend, layers=2, budget=12, chunk_size=8):
    # float64: the two paths round differently, and in fp32 two candidates whose scores differ by that rounding
    # can swap places (a near-tie, which the random weights make on some CPUs and not others).
    model = tiny_model(arch, layers=layers).double()
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


@pytest.mark.parametrize("rule", ["snapkv", "h2o", "knorm"])
def test_bucket_padding_equals_the_unpadded_eager_run(rule):
    # Chunks of 40: the last chunk (35 tokens, evicting, longer than the window of 32) runs padded to 40, the frozen
    # 5-token question too (buckets (40,)). fxbudget's pads (position -1) must change nothing: not the logits, not the
    # kept tokens, not the tokens the cache counts; and the compiled forward needs one graph per bucket only.
    model = tiny_model("qwen2")
    torch.manual_seed(4)
    ids, question = torch.randint(0, 96, (1, 115)), torch.randint(0, 96, (1, 5))
    runs = {}
    for backend in (None, "aot_eager"):
        m = fxbudget.compile(model, rule=rule, budget=48, backend=backend, chunk_size=40, headroom=8)
        cache = m.forward.new_cache()
        with torch.no_grad():
            out = m(input_ids=ids, past_key_values=cache, logits_to_keep=0, output_hidden_states=True)
            prefill, hidden = out.logits, out.hidden_states[-1]  # every position's logits; the last chunk's states
            with cache.frozen():
                logits, _ = greedy(m, question, 2, cache=cache)
        runs[backend] = prefill, logits, [cache.positions(i) for i in range(len(cache.layers))], cache.tokens_seen
        runs[backend, "hidden"] = hidden
        graphs = m.forward.graphs
        m.forward.restore()
    (ref_prefill, ref_logits, ref_pos, ref_seen), (prefill, logits, pos, seen) = runs[None], runs["aot_eager"]
    assert prefill.shape[1] == 115 and (prefill - ref_prefill).abs().max().item() <= 1e-4
    hidden, ref_hidden = runs["aot_eager", "hidden"], runs[None, "hidden"]
    assert hidden.shape[1] == 35 and (hidden - ref_hidden).abs().max().item() <= 1e-4
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert all(torch.equal(a, b) for a, b in zip(pos, ref_pos)) and seen == ref_seen == 122
    # Each graph is one decoder layer's region: its first input is the hidden states, [batch, length, hidden].
    lengths = sorted(next(n for n in gm.graph.nodes if n.op == "placeholder").meta["example_value"].shape[1]
                     for gm in graphs)
    assert lengths == [1, 40, 40]  # the prefill chunk, the frozen question, the frozen decode step


def test_bucket_lengths():
    from fxbudget.api import bucket_length

    assert [bucket_length(n, (32, 256)) for n in (5, 32, 33, 256)] == [32, 32, 256, 256]
    # Past the buckets: a quarter of the power of two (at least 16), so at most a quarter more tokens.
    assert [bucket_length(n) for n in (17, 100, 2000, 2049)] == [32, 112, 2048, 2560]
    assert all(n <= bucket_length(n) <= 1.25 * n for n in range(64, 5000))


def test_full_rule_refuses_to_evict():
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), rule="full", budget=16, backend=None)
    with torch.no_grad():
        out = m(input_ids=torch.randint(0, 96, (1, 10)))
        with pytest.raises(ValueError, match="'full' keeps everything.*budget 16"):
            m(input_ids=torch.randint(0, 96, (1, 7)), past_key_values=out.past_key_values)


class _AttentionLayers(torch.nn.Module):
    """Attention only, one call per cache layer: each call's K/V through the BudgetCache, then SDPA (what the pass
    rewrites). `only` runs one layer's call (the eager reference runs each under its own rule)."""

    def forward(self, calls, past_key_values, only: int | None = None):
        outs = []
        for i, (q, k, v) in enumerate(calls):
            if only is None or i == only:
                keys, values = past_key_values.update(k, v, i)
                outs.append(torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True))
        return outs


def _full_cache(budget: int, layers: int, seed: int = 0):
    """A BudgetCache of `layers` layers, each holding `budget` tokens in shuffled slots (so every call evicts), and a
    call of 3 tokens per layer."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          hidden_size=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cache = fxbudget.BudgetCache(cfg, budget)
    g = torch.Generator().manual_seed(seed)
    cache.set_output_projections([torch.randn(32, 32, generator=g) for _ in range(layers)])  # W_o, for `wov_norm`
    calls = []
    for L in cache.layers:
        L.keys.copy_(torch.randn(L.keys.shape, generator=g))
        L.values.copy_(torch.randn(L.values.shape, generator=g))
        L.pos.copy_(torch.stack([torch.randperm(budget, generator=g) for _ in range(2)]).unsqueeze(0))
        L.state.copy_(torch.rand(L.state.shape, generator=g))
        L.norms[..., :2].copy_(torch.stack([L.keys.norm(dim=-1), L.values.norm(dim=-1)], dim=-1))
        L.norms[..., 2].copy_(torch.rand(L.state.shape, generator=g))
        L.seen.fill_(budget)
        calls.append((torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g),
                      torch.randn(1, 2, 3, 8, generator=g)))
    return cache, calls


@pytest.mark.inductor
def test_inductor_layer_evicts_like_eager():
    # Every rule compiled by Inductor with eviction, at layer level: the same kept slots, state and output as the
    # eager kernel. One graph holds every rule's layer (layer i runs RULES[i]: `rewrite`'s `layer_rules`), so
    # Inductor generates and builds code once, not once per rule (~5 s per extra layer against ~25 s per graph).
    from dataclasses import fields

    from fxbudget.compiler.backend import inductor
    from fxbudget.passes.eager import BudgetAttentionMode
    from fxbudget.passes.sdpa import rewrite

    window = 2  # the observation window of every layer: shorter than the call, so the window is a slice of it
    rules = [fxbudget.rules.get(name, **({"window": window} if "window" in {f.name for f in fields(
        fxbudget.rules.get(name))} else {})) for name in RULES]
    sliding = fxbudget.rules.get("window")
    eager_cache, calls = _full_cache(8, len(rules))
    compiled_cache, _ = _full_cache(8, len(rules))
    layers = _AttentionLayers()

    def backend(gm, example_inputs):
        report = rewrite(gm, rules[0], window, sliding, budget_ints=False, layer_rules=dict(enumerate(rules)))
        assert report.rewritten == list(range(len(rules)))
        return inductor(gm, example_inputs)

    with torch.no_grad():
        expected = []
        for i, rule in enumerate(rules):
            with BudgetAttentionMode(rule, window, sliding):
                expected += layers(calls, eager_cache, only=i)
        outs = torch.compile(layers, backend=backend, fullgraph=True, dynamic=False)(calls, compiled_cache)
    for name, out, want, a, b in zip(RULES, outs, expected, eager_cache.layers, compiled_cache.layers):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert torch.equal(a.pos, b.pos), f"{name} keeps other slots compiled"
        for field in ("keys", "values", "state", "norms", "totals"):
            torch.testing.assert_close(getattr(b, field), getattr(a, field), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name} {field}: {m}")
        assert int((b.pos >= 0).sum()) == 2 * 8, name  # each KV head kept 8 of its 11 candidates


@pytest.mark.parametrize("compiled", [False, True])
def test_signed_zero_scores_tie_and_the_newer_wins(compiled):
    """-0.0 == +0.0, so zero scores of either sign tie and the newer positions are kept (the sign bit used to rank
    -0.0 below +0.0: older +0.0 tokens beat newer -0.0 ones)."""
    from fxbudget.kernel import evict

    b, h, S, n, d = 1, 2, 4, 3, 8
    pos = torch.cat([torch.tensor([[3, 0, 2, 1]] * h), torch.tensor([[4, 5, 6]] * h)], dim=-1).unsqueeze(0)
    score = torch.where(pos >= 4, -0.0, 0.0).float()  # the new (newer) tokens score -0.0, the slots +0.0
    assert torch.signbit(score[..., S:]).all()
    from fxbudget.kernel import LayerSlots, NewTokens

    slots = LayerSlots(torch.randn(b, h, S, d), torch.randn(b, h, S, d), pos[..., :S].clone(), torch.zeros(b, h, S),
                       torch.zeros(b, h, S, 3), torch.zeros(b, h, 9), None)
    signals = {"pos": pos, "acc_attn": torch.zeros(b, h, S + n), "key_norm": torch.ones(b, h, S + n),
               "value_norm": torch.ones(b, h, S + n), "wov_norm": torch.ones(b, h, S + n)}
    fn = torch.compile(evict, backend="aot_eager", fullgraph=True) if compiled else evict
    fn(score, signals, torch.zeros(b, h, 9), slots, NewTokens(torch.randn(b, h, n, d), torch.randn(b, h, n, d),
                                                              pos[0, :1, S:]), keep=S)
    assert sorted(slots.pos[0, 0].tolist()) == [3, 4, 5, 6] and sorted(slots.pos[0, 1].tolist()) == [3, 4, 5, 6]
