"""Decode-time eviction at an interval (`BudgetCache(interval=k)`, `fxbudget.compile(interval=k)`, `fxbudget compare
--protocol streaming --interval k`): kvpress DecodingPress's semantics on the shared kernel.

Oracles: interval 1 is today's streaming, bit for bit; with interval k a layer never holds more than budget + k - 1
entries between calls and exactly the budget after each evicting step; the kept sets after N steps equal (a) a
pure-Python position oracle for streamingllm, (b) a pure-Python key-norm oracle for knorm on a hand-written layer and
(c) for the score-based rules, a reference loop that freezes eviction by hand on every step but each k-th and runs the
rule's own kernel throughout (so the rule-free growth steps change nothing); the compiled path equals the eager one
with a fixed number of graphs.
"""

import json

import pytest
import torch

import fxbudget
from conftest import fails_in_one_line, fresh, tiny_model

PROMPT, BUDGET = 24, 10


def _tokens(n: int, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (1, n), generator=g)


def _counts(cache) -> list[torch.Tensor]:
    return [cache.head_counts(i) for i, layer in enumerate(cache.layers) if not layer.sliding]


def _decode(m, cache, steps: int, each=None):
    """Prefill a fixed prompt, then feed `steps` fixed tokens one per call (no argmax: a near-tie could differ
    between two runs only through a bug elsewhere); `each(i, cache)` after step i (1-based). Returns the logits."""
    out = [m(input_ids=_tokens(PROMPT), past_key_values=cache).logits[:, -1]]
    for i, t in enumerate(_tokens(steps, seed=6)[0].tolist(), 1):
        out.append(m(input_ids=torch.tensor([[t]]), past_key_values=cache).logits[:, -1])
        if each is not None:
            each(i, cache)
    return torch.stack(out)


def _state(cache) -> list[dict]:
    return [layer.snapshot() for layer in cache.layers]


def _equal_states(a, b) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"layer {i}: {name} differs"


@torch.no_grad()
def test_interval_one_is_todays_streaming():
    model = tiny_model("llama")
    runs = []
    for kwargs in ({}, {"interval": 1}):
        m = fxbudget.compile(fresh(model), rule="h2o", budget=BUDGET, backend=None, **kwargs)
        cache = m.forward.new_cache()
        assert cache.interval == 1 and all(layer.slots == BUDGET for layer in cache.layers)  # nothing allocated
        grew = []
        logits = _decode(m, cache, 9, lambda i, c: grew.append(c.evicting))
        runs.append((logits, _state(cache)))
        assert all(grew)  # every call evicted
        m.forward.restore()
    assert torch.equal(runs[0][0], runs[1][0])
    _equal_states(runs[0][1], runs[1][1])


@pytest.mark.parametrize("rule", ["h2o", "snapkv", "knorm", "tova", "streamingllm", "adakv:snapkv"])
@torch.no_grad()
def test_interval_bounds_the_growth_and_evicts_down_to_the_budget(rule):
    k, steps = 4, 13
    model = tiny_model("qwen2")
    m = fxbudget.compile(fresh(model), rule=rule, budget=BUDGET, backend=None, interval=k,
                         **({"window": 4} if "snapkv" in rule else {}))
    cache = m.forward.new_cache()
    assert all(layer.slots == BUDGET + k - 1 for layer in cache.layers)
    heads = cache.layers[0].num_heads

    def check(i, c):
        counts = _counts(c)
        if i % k == 0:  # the k-th step since the prefill's eviction evicts, down to exactly the budget
            assert c.evicting
            for n in counts:
                if c.head_pool:  # the pool's heads share the layer's kv_heads x budget entries
                    assert int(n.sum()) == heads * BUDGET
                else:
                    assert torch.all(n == BUDGET)
        else:  # in between: every token appended, nothing evicted
            assert not c.evicting
            for n in counts:
                assert int(n.sum()) == heads * (BUDGET + i % k)
                assert int(n.max()) <= BUDGET + k - 1 or c.head_pool

    _decode(m, cache, steps, check)
    assert cache.tokens_seen == PROMPT + steps


@torch.no_grad()
def test_streamingllm_kept_sets_match_a_position_oracle():
    k, steps, sinks = 5, 17, 4
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), rule="streamingllm", budget=BUDGET, backend=None, interval=k)
    cache = m.forward.new_cache()
    kept = set(range(sinks)) | set(range(PROMPT - (BUDGET - sinks), PROMPT))  # after the prefill
    expected = []
    for i in range(1, steps + 1):  # the oracle: append, and every k-th step keep the sinks and the newest
        kept.add(PROMPT + i - 1)
        if i % k == 0:
            newest = sorted(kept - set(range(sinks)))[-(BUDGET - sinks):]
            kept = set(range(sinks)) | set(newest)
        expected.append(set(kept))

    def check(i, c):
        for layer in range(len(c.layers)):
            for row in c.positions(layer).reshape(-1, c.layers[layer].slots):
                assert set(row.tolist()) - {-1} == expected[i - 1], f"step {i}, layer {layer}"

    _decode(m, cache, steps, check)


@torch.no_grad()
def test_knorm_kept_sets_match_a_key_norm_oracle():
    # A hand-written one-layer model (no RoPE): each token's key is `k(emb(id))`, so the oracle computes every key
    # norm itself and keeps, at the prefill and at every k-th decode step, the `BUDGET` lowest norms of what is held.
    from tiny_attention import CONFIG, OneLayer

    k, steps, prompt = 4, 14, 12
    model = OneLayer(vocab=64).double()
    budget = BUDGET - 4
    m = fxbudget.compile(model, rule="knorm", budget=budget, backend=None)
    cache = fxbudget.BudgetCache(CONFIG, budget, interval=k, dtype=torch.float64)
    # Distinct tokens: no two keys alike, so no tie (a tie goes to the newer token) for the oracle to break.
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(9))[:prompt + steps].unsqueeze(0)
    norms = model.k(model.emb(ids[0])).norm(dim=-1).tolist()

    def lowest(held):
        return set(sorted(held, key=lambda p: norms[p])[:budget])

    m(input_ids=ids[:, :prompt], past_key_values=cache)
    kept = lowest(range(prompt))
    assert set(cache.positions(0).flatten().tolist()) - {-1} == kept
    for i in range(1, steps + 1):
        m(input_ids=ids[:, prompt + i - 1:prompt + i], past_key_values=cache)
        kept = kept | {prompt + i - 1}
        if i % k == 0:
            kept = lowest(kept)
        assert set(cache.positions(0).flatten().tolist()) - {-1} == kept, f"step {i}"
    m.forward.restore()


@pytest.mark.parametrize("rule", ["h2o", "snapkv", "knorm", "tova", "adakv:snapkv"])
@torch.no_grad()
def test_kept_sets_equal_a_reference_that_freezes_by_hand(rule):
    # The reference: an interval-1 cache with k - 1 slots of head-room, every step but each k-th run frozen
    # (`cache.frozen()`), all on the rule's own eager kernel. The interval cache must hold the same tokens, keys,
    # values and carried state after every step, and give the same logits: its growth steps run the rule-free
    # kernel (the `window` rule) and skip the rule's scoring, which must change nothing.
    k, steps = 3, 11
    model = tiny_model("qwen2").double()
    params = {"window": 4} if "snapkv" in rule else {}
    m = fxbudget.compile(fresh(model), rule=rule, budget=BUDGET, backend=None, interval=k, **params)
    cache = m.forward.new_cache()
    states = []
    logits = _decode(m, cache, steps, lambda i, c: states.append(_state(c)))
    m.forward.restore()

    m = fxbudget.compile(fresh(model), rule=rule, budget=BUDGET, backend=None, **params)
    ref = m.forward.new_cache(headroom=k - 1)
    ref_logits = [m(input_ids=_tokens(PROMPT), past_key_values=ref).logits[:, -1]]
    for i, t in enumerate(_tokens(steps, seed=6)[0].tolist(), 1):
        with ref.frozen() if i % k else torch.no_grad():
            ref_logits.append(m(input_ids=torch.tensor([[t]]), past_key_values=ref).logits[:, -1])
        _equal_states(states[i - 1], _state(ref))
    m.forward.restore()
    assert torch.equal(logits, torch.stack(ref_logits))


@torch.no_grad()
def test_snapshot_restore_keeps_the_step_count():
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), rule="h2o", budget=BUDGET, backend=None, interval=4)
    cache = m.forward.new_cache()
    _decode(m, cache, 2)
    snap = cache.snapshot()
    m(input_ids=torch.tensor([[3]]), past_key_values=cache)
    m(input_ids=torch.tensor([[4]]), past_key_values=cache)  # the 4th step: evicts
    after = _state(cache)
    cache.restore(snap)
    m(input_ids=torch.tensor([[3]]), past_key_values=cache)
    m(input_ids=torch.tensor([[4]]), past_key_values=cache)
    _equal_states(after, _state(cache))
    assert all(torch.all(n == BUDGET) for n in _counts(cache))


@pytest.mark.parametrize("rule", ["h2o", "snapkv"])
def test_compiled_equals_eager_with_one_graph_per_kind_of_step(rule):
    # Compiled: the evicting steps run the rule's decode graph, the steps between them the frozen runner's (the rule
    # scoring skipped); two decode graphs whatever the number of steps, never one per step.
    k = 3
    model = tiny_model("qwen2").double()
    params = {"window": 4} if rule == "snapkv" else {}
    runs = {}
    for backend in (None, "aot_eager"):
        m = fxbudget.compile(fresh(model), rule=rule, budget=BUDGET, backend=backend, interval=k, **params)
        cache = m.forward.new_cache()
        with torch.no_grad():
            logits = _decode(m, cache, 2 * k)
            graphs = len(m.forward.graphs) if backend else None
            more = _decode(m, m.forward.new_cache(), 4 * k + 1)
        runs[backend] = logits, _state(cache), graphs, more
        if backend:
            assert len(m.forward.graphs) == graphs == 3  # prefill, evicting decode step, growing decode step
        m.forward.restore()
    assert (runs[None][0] - runs["aot_eager"][0]).abs().max().item() <= 1e-9
    for a, b in zip(runs[None][1], runs["aot_eager"][1]):
        assert torch.equal(a["pos"], b["pos"])
    assert (runs[None][3] - runs["aot_eager"][3]).abs().max().item() <= 1e-9


def test_bad_intervals_are_refused_in_one_line(tiny_dir, tmp_path, capsys, no_model_load):
    from fxbudget.harness.grid import Grid

    model = tiny_model("llama")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="interval must be an int >= 1"):
            fxbudget.compile(fresh(model), rule="h2o", budget=8, backend=None, interval=bad)
        with pytest.raises(ValueError, match="interval must be an int >= 1"):
            fxbudget.BudgetCache(model.config, 8, interval=bad)
        with pytest.raises(ValueError, match="interval must be an int >= 1"):
            Grid(protocols=["streaming"], interval=bad).validate()
    with pytest.raises(ValueError, match="add --protocol streaming"):
        Grid(interval=4).validate()
    base = ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--rules", "full,h2o",
            "--budgets", "32", "--samples", "1", "--protocol", "streaming", "--device", "cpu", "--out",
            str(tmp_path / "o"), "--dry-run"]
    fails_in_one_line(capsys, base + ["--interval", "0"], r"--interval must be an int >= 1")
    fails_in_one_line(capsys, base + ["--interval", "9", "--max-new-tokens", "8"],
                      r"--interval 9 is larger than the generation \(8 new tokens, passkey\)")
    fails_in_one_line(capsys, base[:-9] + ["--out", str(tmp_path / "o"), "--interval", "4", "--dry-run"],
                      r"add --protocol streaming")
    assert not (tmp_path / "o").exists()


def test_compare_streaming_at_an_interval_writes_and_reports_it(tiny_dir, tmp_path, capsys):
    from fxbudget.cli import main

    out = tmp_path / "out"
    argv = ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--rules", "full,h2o",
            "--budgets", "32", "--samples", "1", "--protocol", "streaming", "--max-new-tokens", "6", "--device",
            "cpu", "--quiet", "--no-likelihood", "--out", str(out)]
    assert main(argv + ["--interval", "3"]) == 0
    err = capsys.readouterr().err
    assert "streaming decode evicts every 3 steps" in err and "budget + max(head-room, 2) slots" in err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["decode_interval"] for r in rows} == {3}
    h2o = next(r for r in rows if r["rule"] == "h2o")
    report = (out / "report.md").read_text()
    assert "`streaming` at decode interval 3" in report and "budget + 2 entries" in report
    assert "memory is the budget throughout" not in report  # interval 1's sentence: no row of this run is it
    # The same grid at interval 1 is another setting: its rows are new, not the interval-3 rows resumed.
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["decode_interval"] for r in rows) == [1, 1, 3, 3]
    report = (out / "report.md").read_text()  # the two settings, each said
    assert "memory is the budget throughout" in report and "`streaming` at decode interval 3" in report
    one = next(r for r in rows if r["rule"] == "h2o" and r["decode_interval"] == 1)
    assert h2o["kv_allocated_bytes"] == one["kv_allocated_bytes"] * (32 + 2) // 32  # the growth slots, accounted
