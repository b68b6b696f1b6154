"""AdaKV and the head-pooled cache layout (issue 22): uniform allocation on the pool is the unpooled layout, AdaKV's
selection is kvpress's (flatten, per-head floor, one top-k over the layer's heads), a covering budget reproduces the
model, decode evicts with changing per-head counts and no copy of the pool, one fingerprint (branching a pooled cache:
tests/test_branch.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import fxbudget
from conftest import fresh, greedy, tiny_model
from fxbudget.cache import BudgetCache
from fxbudget.kernel import budget_attention
from fxbudget.kernel import TOTALED
from fxbudget.rules import AdaKV, Pyramid, Rule, get
from fxbudget.rules.base import Signals
from fxbudget.rules.snapkv import SnapKV

STEPS = 20


def _kept(cache: BudgetCache, layer: int) -> list[list[list[int]]]:
    """Sorted positions per row and KV head."""
    return [[sorted(p for p in head if p >= 0) for head in row] for row in cache.head_positions(layer).tolist()]


def _run(model, ids, steps, **kw):
    """Prefill `ids`, then `steps` greedy steps, recording each layer's kept sets after every call."""
    m = fxbudget.compile(fresh(model), **kw)
    cache = m.forward.new_cache(ids.shape[0])
    kept, logits = [], []
    tok = ids
    with torch.no_grad():
        for _ in range(steps + 1):
            out = m(input_ids=tok, past_key_values=cache)
            logits.append(out.logits[:, -1])
            kept.append([_kept(cache, i) for i in range(len(cache.layers))])
            tok = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits), kept, cache


# --- uniform allocation on the pool is the unpooled layout ------------------------------------------------------------

@pytest.mark.parametrize("rule, params", [("snapkv", {"window": 4}), ("h2o", {}), ("streamingllm", {}),
                                          ("keydiff", {})])
def test_uniform_rule_pooled_equals_unpooled_eager(rule, params):
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 24))
    ref, kept_ref, c_ref = _run(model, ids, STEPS, rule=rule, budget=12, backend=None, **params)
    got, kept, c_pool = _run(model, ids, STEPS, rule=rule, budget=12, backend=None, head_pool=True, **params)
    assert c_pool.head_pool and not c_ref.head_pool
    assert c_pool.kv_bytes() == c_ref.kv_bytes()
    assert kept == kept_ref  # every call (prefill and 20 decode steps, each evicting), layer, row and head
    assert (got - ref).abs().max().item() <= 1e-6
    assert all(len(h) == 12 for step in kept[1:] for layer in step for row in layer for h in row)


def test_uniform_rule_pooled_equals_unpooled_aot_eager():
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 24))
    # A query block of 8: the compiled prefill runs measure's scan over blocks on the pool.
    ref, kept_ref, _ = _run(model, ids, STEPS, rule="snapkv", budget=12, backend=None, window=4, block=8)
    got, kept, _ = _run(model, ids, STEPS, rule="snapkv", budget=12, backend="aot_eager", window=4, head_pool=True,
                        block=8)
    assert kept == kept_ref
    assert (got - ref).abs().max().item() <= 1e-6


# --- a covering budget reproduces the model ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_covering_budget_adakv_reproduces_model(backend):
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 24))
    with torch.no_grad():
        ref, _ = greedy(model, ids, STEPS)
        m = fxbudget.compile(fresh(model), rule="adakv:snapkv", budget=64, backend=backend)
        got, cache = greedy(m, ids, STEPS)
    assert cache.head_pool
    assert (got - ref).abs().max().item() <= 1e-4
    for i in range(len(cache.layers)):
        assert all(h == list(range(24 + STEPS)) for row in _kept(cache, i) for h in row)


# adakv:kvzip is replay-only like kvzip (refused in plain generation: tests/test_combinations_findings.py)
@pytest.mark.parametrize("rule", fxbudget.rules.plain_generation_rules())
def test_covering_budget_every_adakv_rule_eager(rule):
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        ref, _ = greedy(model, ids, 8)
        got, cache = greedy(fxbudget.compile(fresh(model), rule=f"adakv:{rule}", budget=64, backend=None), ids, 8)
    assert (got - ref).abs().max().item() <= 1e-4
    assert all(h == list(range(32)) for i in range(2) for row in _kept(cache, i) for h in row)


# --- AdaKV's selection against a plain-torch reference ----------------------------------------------------------------

@dataclass
class _KeyNorm(Rule):
    """Scores = key norms: random, distinct per head and token, known to the reference."""

    name = "keynorm-test"

    def score(self, s: Signals):
        return s.key_norm


def _reference(scores: list[list[tuple[int, float]]], B: int, floor: int) -> set[tuple[int, int]]:
    """AdaKV in float64 (kvpress's AdaKVPress.compress): per head its top `floor` candidates raised to the top,
    then one top-k of `h * B` over the flattened heads. `scores[j]` = head j's (position, score) candidates."""
    flat = []
    for j, cands in enumerate(scores):
        ranked = sorted(cands, key=lambda c: -c[1])
        for r, (p, sc) in enumerate(ranked):
            flat.append((math.inf if r < floor else sc, j, p))
    flat.sort(key=lambda c: -c[0])
    return {(j, p) for _, j, p in flat[:len(scores) * B]}


@pytest.mark.parametrize("alpha, seed", [(0.2, 0), (0.5, 1), (0.0, 2), (1.0, 3)])
def test_adakv_selection_matches_reference(alpha, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, B, n, d, gq = 2, 4, 10, 7, 8, 2
    S = B
    P = h * S
    # A full pool whose entries are spread unevenly over the heads (positions 0..P-1, each owned by a random head).
    owner = torch.randint(0, h, (b, P), generator=g).to(torch.int32)
    pos = torch.arange(P).expand(b, P).clone()
    # Head 0 scores far below the others: without the per-head floor it would keep nothing.
    scale = torch.tensor([0.05, 1.0, 1.5, 2.0], dtype=torch.float64)
    keys = torch.randn(b, P, d, generator=g, dtype=torch.float64) * scale[owner.long()].unsqueeze(-1)
    norms = torch.stack([keys.norm(dim=-1), torch.rand(b, P, generator=g, dtype=torch.float64),
                         torch.rand(b, P, generator=g, dtype=torch.float64)], -1).float()
    k_slots, v_slots = keys.view(b, h, S, d).float(), torch.randn(b, h, S, d, generator=g)
    pos_slots, owner4 = pos.view(b, h, S).clone(), owner.view(b, h, S).clone()
    state, totals = torch.zeros(b, h, S), torch.zeros(b, h, len(TOTALED))
    k_new = torch.randn(b, h, n, d, generator=g) * scale.float().view(1, h, 1, 1)
    v_new = torch.randn(b, h, n, d, generator=g)
    new_pos = torch.arange(P, P + n).expand(b, n)
    q = torch.randn(b, h * gq, n, d, generator=g)
    rule = AdaKV(_KeyNorm(), alpha=alpha)
    expect = []
    for r in range(b):
        scores = [[(int(pos[r, s]), float(norms[r, s, 0])) for s in range(P) if owner[r, s] == j]
                  + [(P + t, float(k_new[r, j, t].norm())) for t in range(n)] for j in range(h)]
        expect.append(_reference(scores, B, int(alpha * B)))
    norms4 = norms.view(b, h, S, 3).clone()
    budget_attention(q, k_slots, v_slots, pos_slots, state, norms4, totals, k_new, v_new, new_pos, None, None, owner4,
                     rule=rule, budget=B, pooled=True)
    for r in range(b):
        got = {(int(o), int(p)) for o, p in zip(owner4[r].flatten(), pos_slots[r].flatten()) if p >= 0}
        assert got == expect[r]
        counts = torch.bincount(owner4[r].flatten().long(), minlength=h)
        assert int(counts.sum()) == h * B and int(counts.min()) >= int(alpha * B)
        if alpha < 1:
            assert len(set(counts.tolist())) > 1  # the spread is uneven
        # Each kept new token's key and value went into its slot, under its head.
        for s in range(P):
            p, o = int(pos_slots.view(b, P)[r, s]), int(owner4.view(b, P)[r, s])
            if p >= P:
                assert torch.equal(k_slots.view(b, P, d)[r, s], k_new[r, o, p - P])
                assert torch.equal(v_slots.view(b, P, d)[r, s], v_new[r, o, p - P])


def test_adakv_prefill_counts_and_floor():
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 40))
    m = fxbudget.compile(fresh(model), rule="adakv:snapkv", budget=12, backend=None, window=2, alpha=0.25)
    cache = m.forward.new_cache(2)
    with torch.no_grad():
        m(input_ids=ids, past_key_values=cache)
    spread = False
    for i in range(len(cache.layers)):
        counts = cache.head_counts(i)
        assert torch.equal(counts.sum(-1), torch.full((2,), 2 * 12))
        assert int(counts.min()) >= 3
        spread |= len(set(counts.flatten().tolist())) > 1
        pos = cache.head_positions(i)
        assert pos.shape == (2, 2, 2 * 12)
        assert all(38 in h and 39 in h for row in _kept(cache, i) for h in row)  # the window is protected
    assert spread


# --- decode: counts change, no copy of the pool ----------------------------------------------------------------------

def test_adakv_decode_counts_change_and_graph_copies_no_pool():
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 24))  # two rows: with one, even a broadcasting matmul's copy is a view
    eager, kept_e, _ = _run(model, ids, 12, rule="adakv:snapkv", budget=10, backend=None, window=2)
    m = fxbudget.compile(fresh(model), rule="adakv:snapkv", budget=10, backend="aot_eager", window=2)
    cache = m.forward.new_cache(2)
    counts, logits, tok = [], [], ids
    with torch.no_grad():
        for _ in range(13):
            out = m(input_ids=tok, past_key_values=cache)
            counts.append([cache.head_counts(i).tolist() for i in range(2)])
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1:].argmax(-1)
    assert (torch.stack(logits) - eager).abs().max().item() <= 1e-5
    assert [[[len(h) for h in row] for row in layer] for layer in kept_e[-1]] == counts[-1]
    assert len({str(c) for c in counts[1:]}) > 1  # the per-head counts move as tokens arrive
    decode = [gm for gm in m.forward.graphs if _call_length(gm) == 1]
    assert decode
    P, d, seen = 2 * 10, 16, 0
    for gm in decode:
        for node in gm.graph.nodes:
            val = node.meta.get("val", node.meta.get("example_value"))
            if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.numel() < 2 * P * d:
                continue
            # Only views of the pool (and its in-place writes) are as large as the pool: nothing copies it (a
            # broadcasting matmul over the pool would: one copy per head).
            op = node.target
            assert isinstance(op, torch._ops.OpOverload) and (op.is_view or op._schema.is_mutable), \
                (node.name, str(op), tuple(val.shape))
            seen += 1
    assert seen  # the check did look at the pool's views


def _call_length(gm) -> int:
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("example_value")
            if isinstance(val, torch.Tensor) and val.dtype == torch.long and val.dim() == 2:
                return val.shape[1]  # input_ids
    return -1


# --- fingerprint (branching a pooled cache: tests/test_branch.py, the `adakv:snapkv` case) ----------------------------

def test_one_fingerprint_pooled_uniform_and_adaptive():
    model = tiny_model("qwen2", layers=2)
    prints = {name: fxbudget.kernel_fingerprint(model, rule=rule, budget=40, head_pool=pool)
              for name, rule, pool in [("snapkv-pooled", "snapkv", True), ("adakv:snapkv", "adakv:snapkv", None),
                                       ("adakv:expected_attention", "adakv:expected_attention", None),
                                       ("snapkv", "snapkv", None)]}
    assert prints["snapkv-pooled"] == prints["adakv:snapkv"] == prints["adakv:expected_attention"]
    assert prints["snapkv"] != prints["snapkv-pooled"]


# --- the API and bad input --------------------------------------------------------------------------------------------

def test_get_routes_alpha_to_adakv_and_the_rest_to_the_rule():
    r = get("adakv:snapkv", alpha=0.1, window=64, kernel=5, pooling="avg")
    assert isinstance(r, AdaKV) and r.head_adaptive and not SnapKV.head_adaptive
    assert r.name == "adakv:snapkv" and r.alpha == 0.1 and r.window == 64
    assert r.rule == SnapKV(window=64, kernel=5, pooling="avg")
    assert r.params() == {"alpha": 0.1, "window": 64, "kernel": 5, "pooling": "avg"}
    assert r.head_floor(256) == 25 and get("adakv:snapkv").head_floor(256) == 51
    # Schedules compose: the layer's total from pyramidkv, its spread from AdaKV.
    p = get("adakv:pyramidkv", window=4)
    assert p.layer_budgets(16, 4) == get("pyramidkv", window=4).layer_budgets(16, 4)
    assert AdaKV(Pyramid(SnapKV(window=4))).layer_budgets(16, 4) == p.layer_budgets(16, 4)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), "0.2", True])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match=r"adakv:snapkv.*alpha must be a number in \[0, 1\]"):
        get("adakv:snapkv", alpha=alpha)


def test_bad_input_before_model_work():
    model = tiny_model("llama")
    forward = model.forward
    with pytest.raises(ValueError, match="'adakv:full'.*never evicts"):
        fxbudget.compile(model, rule="adakv:full", budget=16, backend=None)
    with pytest.raises(ValueError, match="'adakv:snapkv'.*budget 16 is below the 32 tokens"):
        fxbudget.compile(model, rule="adakv:snapkv", budget=16, backend=None, window=32)
    with pytest.raises(ValueError, match="needs the head-pooled cache layout"):
        fxbudget.compile(model, rule="adakv:snapkv", budget=64, backend=None, head_pool=False)
    with pytest.raises(ValueError, match="head_pool must be"):
        fxbudget.compile(model, rule="snapkv", budget=64, backend=None, head_pool="yes")
    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        fxbudget.compile(model, rule="adakv:nope", budget=64, backend=None)
    assert model.forward == forward  # left unmodified
    # A cache of the other layout is refused, naming both.
    m = fxbudget.compile(model, rule="adakv:snapkv", budget=64, backend=None)
    try:
        with pytest.raises(ValueError, match="cache layout is unpooled"):
            m(input_ids=torch.zeros(1, 4, dtype=torch.long), past_key_values=BudgetCache(model.config, 64))
    finally:
        model.forward.restore()


def test_rules_command_lists_the_wrappers(capsys):
    from fxbudget.cli import main
    from fxbudget.cli.rules_table import static_rules_table

    assert static_rules_table() is not None  # adakv.py does not stop the torch-free reader
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    assert "`adakv:<rule>` (`alpha=0.2`" in out and "| `snapkv` |" in out


def test_frozen_headroom_and_chunked_prefill_pooled():
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 40))
    kw = dict(budget=12, backend=None, headroom=4, chunk_size=16, window=2)
    ref = fxbudget.compile(fresh(model), rule="snapkv", **kw)
    pooled = fxbudget.compile(fresh(model), rule="snapkv", head_pool=True, **kw)
    ada = fxbudget.compile(fresh(model), rule="adakv:snapkv", **kw)
    caches = [m.forward.new_cache(2) for m in (ref, pooled, ada)]
    with torch.no_grad():
        outs = [m(input_ids=ids, past_key_values=c).logits for m, c in zip((ref, pooled, ada), caches)]
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-6  # chunked prefill: uniform pooled = unpooled
        before = [c.head_positions(0).clone() for c in caches]
        for m, c in zip((ref, pooled, ada), caches):
            with c.frozen():  # the head-room takes 4 more tokens per head, nothing is evicted
                m(input_ids=ids[:, :4], past_key_values=c)
    for c, old in zip(caches, before):
        counts = c.head_counts(0)
        assert torch.equal(counts.sum(-1), torch.full((2,), 2 * 16))
        held = [set(h) for row in _kept(c, 0) for h in row]
        was = [set(p for p in h if p >= 0) for row in old.tolist() for h in row]
        assert all(w | {40, 41, 42, 43} == h for w, h in zip(was, held))
    assert _kept(caches[0], 0) == _kept(caches[1], 0)


@pytest.mark.inductor
def test_adakv_inductor_matches_eager():
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 24))
    eager, kept_e, _ = _run(model, ids, 6, rule="adakv:snapkv", budget=10, backend=None, window=2)
    got, kept, _ = _run(model, ids, 6, rule="adakv:snapkv", budget=10, backend="inductor", window=2)
    assert kept == kept_e
    assert (got - eager).abs().max().item() <= 1e-4
