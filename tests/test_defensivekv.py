"""`defensivekv` (issue 23): its score against a float64 reference written from DefensiveKV's formula, its kernel
signals (`window_max_attn`, `wov_norm`) on a real model, bad hyperparameters, and the refusal without W_o."""

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import fxbudget
from conftest import chunked_prefill_then_decode, fresh, tiny_model
from fxbudget import rules
from fxbudget.cache import BudgetCache
from fxbudget.cli.rules_table import rules_table
from fxbudget.kernel import LayerConstants, LayerSlots, NewTokens, measure
from fxbudget.kernel.signals import out_projection_factors
from fxbudget.rules.base import Signals

B, H, G, D, HIDDEN, EMPTY = 1, 2, 3, 16, 24, 5
DT = torch.float64


def _prompt(L, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(H, L, D, generator=gen, dtype=DT)
    v = torch.randn(H, L, D, generator=gen, dtype=DT) * torch.rand(H, L, 1, generator=gen, dtype=DT)
    q = torch.randn(H * G, L, D, generator=gen, dtype=DT) * 1.5
    wo = torch.randn(HIDDEN, H * G * D, generator=gen, dtype=DT)
    return k, v, q, wo


def _kernel_score(rule, k, v, q, wo, window, budget):
    """The rule's score of a one-call prefill of the prompt on `EMPTY` empty slots, from the kernel's signals."""
    L = k.shape[1]
    z = torch.zeros(1, H, EMPTY, D, dtype=DT)
    slots = LayerSlots(z, z, torch.full((1, H, EMPTY), -1), torch.zeros(1, H, EMPTY, dtype=DT),
                       torch.zeros(1, H, EMPTY, 3, dtype=DT), None, None)
    const = LayerConstants(torch.full((D // 2,), float("nan"), dtype=DT), out_projection_factors(wo, H, D))
    _, _, sig = measure(q.unsqueeze(0), slots, NewTokens(k.unsqueeze(0), v.unsqueeze(0), torch.arange(L).unsqueeze(0)),
                        const, window=window, sliding=0, scale=None)
    s = Signals(**sig, budget=budget, window=torch.tensor(min(window, L)).view(1, 1, 1))
    score = rule.score(s).masked_fill(rule.protect(s), float("inf"))
    return score[0, :, EMPTY:]


def _reference(k, v, q, wo, window, kernel, budget, threshold=0.9):
    """DefensiveKV's score (EfficientDefensiveKVPress.score and vwl1norm), one KV head budget each, with the max
    over the window's queries and the group taken before the pooling and the L2 norm of W_o v in place of the L1
    norm (the documented departures), float64."""
    L = k.shape[1]
    ctx = L - window
    lg = torch.einsum("hgqd,hkd->hgqk", q.view(H, G, L, D)[:, :, -window:], k) / math.sqrt(D)
    causal = torch.arange(L).view(1, -1) > torch.arange(L - window, L).view(-1, 1)
    attn = lg.masked_fill(causal, float("-inf")).softmax(-1)  # [H, G, window, L]
    window_bias = attn[..., ctx:].sum(-1).mean()  # the window's attention on its own tokens
    attn = attn[..., :ctx]
    ave = attn.mean(dim=(1, 2))  # [H, ctx]
    top = attn.amax(dim=(1, 2))  # the defensive max: over the group and the window's queries
    pooled = F.avg_pool1d(top.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)
    scores = pooled.clamp(min=pooled.mean(dim=-1, keepdim=True))
    per_head = wo.t().reshape(H * G, D, HIDDEN)
    wov = torch.stack([(v[i // G, :ctx] @ per_head[i]).norm(dim=-1) for i in range(H * G)]).view(H, G, ctx).mean(1)
    scores = scores * wov / wov.sum(dim=0, keepdim=True)  # normalized over the KV heads, per position
    norm = ave / ave.sum(dim=-1, keepdim=True)
    sorted_scores, sorted_idx = torch.sort(norm, dim=-1, descending=True)
    count = torch.argmax((sorted_scores.cumsum(-1) >= threshold - window_bias).int(), dim=-1)
    count = count.clamp(max=budget - window)
    first = torch.zeros_like(scores, dtype=torch.bool)
    for hh in range(H):
        first[hh, sorted_idx[hh, :count[hh]]] = True
    scores = torch.where(first, float("inf"), scores)
    return torch.cat([scores, torch.full((H, window), float("inf"), dtype=DT)], dim=-1), count


@pytest.mark.parametrize("L, window, kernel, budget", [(60, 8, 5, 30), (75, 16, 3, 40), (40, 4, 7, 10)])
def test_score_is_the_reference(L, window, kernel, budget):
    k, v, q, wo = _prompt(L, seed=L)
    rule = rules.get("defensivekv", window=window, kernel=kernel)
    got = _kernel_score(rule, k, v, q, wo, window, budget)
    ref, count = _reference(k, v, q, wo, window, kernel, budget)
    assert torch.equal(got.isinf(), ref.isinf())
    torch.testing.assert_close(got[~ref.isinf()], ref[~ref.isinf()], rtol=1e-10, atol=1e-12)
    assert (count > 0).all() and (count < L - window).all()  # the first stage chose some tokens, not all


def test_first_stage_is_capped_by_the_budget():
    """At a budget barely above the window the first stage keeps at most `budget - window` tokens."""
    k, v, q, wo = _prompt(60, seed=3)
    got = _kernel_score(rules.get("defensivekv", window=8), k, v, q, wo, 8, 10)
    ref, count = _reference(k, v, q, wo, 8, 5, 10)
    assert (count == 2).all() and (got.isinf().sum(-1) == 10).all()
    assert torch.equal(got.isinf(), ref.isinf())


def test_signals_on_a_model_match_its_attention_and_output_projection():
    """On a real model, one-call prefill: `window_max_attn` is the max over the window's queries and the group's
    query heads of the model's own attention probabilities (eager attention, output_attentions), and `wov_norm`
    the group mean of ||W_o v||_2 with the layer's o_proj."""
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    seen = []

    @dataclass
    class Probe(rules.Rule):
        name = "probe"
        window: int = 4

        def score(self, s):
            seen.append((s.window_max_attn.clone(), s.wov_norm.clone(), s.v_new.clone(), s.pos.clone()))
            return s.attn

    # signals="all": no dry run at compile (whose probe call would be recorded in `seen` first)
    m = fxbudget.compile(fresh(model), rule=Probe(), budget=32, backend=None, signals="all")
    with torch.no_grad():
        m(input_ids=ids)
    eager = fresh(model)
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        att = eager(input_ids=ids, output_attentions=True).attentions
    kv = model.config.num_key_value_heads
    g = model.config.num_attention_heads // kv
    for i, (win_max, wov, v_new, pos) in enumerate(seen):
        n = v_new.shape[2]
        S = pos.shape[-1] - n
        p = att[i][0].view(kv, g, n, n)[:, :, -4:]  # the window's queries
        torch.testing.assert_close(win_max[0, :, S:], p.amax(dim=(1, 2)), rtol=1e-5, atol=1e-6)
        assert torch.equal(win_max[0, :, :S], torch.zeros(kv, S))
        w = model.model.layers[i].self_attn.o_proj.weight.t().reshape(kv * g, -1, model.config.hidden_size)
        ref = torch.stack([(v_new[0, j // g] @ w[j]).norm(dim=-1) for j in range(kv * g)]).view(kv, g, n).mean(1)
        torch.testing.assert_close(wov[0, :, S:], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_chunked_prefill_and_decode_evict_to_the_budget(backend):
    model = tiny_model("qwen2", layers=2)
    m = fxbudget.compile(fresh(model), rule="defensivekv", budget=24, backend=backend, chunk_size=16, window=8)
    logits, held, _ = chunked_prefill_then_decode(m)
    assert torch.isfinite(logits).all()
    for i, row in held:
        assert len(row) == 24 == len(set(row)) and max(row) == 72, (i, sorted(row))


@pytest.mark.parametrize("params, match", [
    ({"window": 0}, "defensivekv window must be an int >= 1, got 0"),
    ({"kernel": 4}, "defensivekv kernel must be a positive odd int, got 4"),
    ({"kernel": -1}, "defensivekv kernel must be a positive odd int, got -1"),
    ({"threshold": 0}, "defensivekv threshold must be a number in (0, 1], got 0"),
    ({"threshold": 1.5}, "defensivekv threshold must be a number in (0, 1], got 1.5"),
    ({"threshold": "0.9"}, "defensivekv threshold must be a number in (0, 1], got '0.9'"),
])
def test_bad_hyperparameters_are_refused(params, match):
    with pytest.raises(ValueError, match="^" + match.replace("(", r"\(").replace(")", r"\)") + "$"):
        rules.get("defensivekv", **params)


def test_listed_with_the_reference_defaults():
    assert "| `defensivekv` |" in rules_table() and "window=32, kernel=5, threshold=0.9" in rules_table()


def test_refused_without_the_output_projection():
    """A model whose attention layers have no linear `o_proj` is refused at compile time; a cache without W_o (a
    plain BudgetCache) is refused when handed to the compiled forward; other rules are unaffected."""
    model = tiny_model("qwen2", layers=2)
    m = fxbudget.compile(fresh(model), rule="defensivekv", budget=8, backend=None)
    assert m.forward.new_cache(1).has_wo
    bare = BudgetCache(model.config, 8)
    assert not bare.has_wo
    with pytest.raises(ValueError, match="rule 'defensivekv' needs each layer's output projection"), torch.no_grad():
        m(input_ids=torch.zeros(1, 4, dtype=torch.long), past_key_values=bare)
    odd = fresh(model)
    odd.model.layers[1].self_attn.o_proj = torch.nn.Identity()  # no linear o_proj: W_o cannot be found
    with pytest.raises(ValueError, match="rule 'defensivekv' needs each attention layer's output projection"):
        fxbudget.compile(odd, rule="defensivekv", budget=8)
    fxbudget.compile(fresh(odd), rule="snapkv", budget=8)  # a rule that does not read W_o: no refusal

    from tiny_attention import CONFIG, OneLayer  # no config: the cache check is what refuses

    one = fxbudget.compile(OneLayer(), rule="defensivekv", budget=4, backend=None)
    with pytest.raises(ValueError, match="needs each layer's output projection"), torch.no_grad():
        one(torch.zeros(1, 3, dtype=torch.long), past_key_values=BudgetCache(CONFIG, 4))


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_adakv_defensivekv_covering_budget_reproduces_the_model(backend):
    """`adakv:defensivekv` (the reference's cross-head selection) on the head-pooled layout: with a budget covering
    the prompt and the decode steps the model is reproduced and every head holds every token; at a small budget it
    evicts with per-head counts that differ (a low first-stage threshold), within the pool."""
    from conftest import greedy

    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, _ = greedy(model, ids, 6)
        got, cache = greedy(fxbudget.compile(fresh(model), rule="adakv:defensivekv", budget=64, backend=backend,
                                             window=8), ids, 6)
    assert cache.head_pool and cache.has_wo
    assert (got - ref).abs().max().item() <= 1e-4
    for i in range(2):
        for head in cache.head_positions(i)[0].tolist():
            assert sorted(p for p in head if p >= 0) == list(range(30))
    # A low threshold: at the default one the first stage (up to `budget - window` per head, +inf) fills every
    # head's budget on this short prompt, so no head can take another's share.
    m = fxbudget.compile(fresh(model), rule="adakv:defensivekv", budget=12, backend=backend, window=4, alpha=0.25,
                         threshold=0.1)
    small = m.forward.new_cache(1)
    with torch.no_grad():
        m(input_ids=torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(3)), past_key_values=small)
    counts = [small.head_counts(i)[0].tolist() for i in range(2)]
    assert all(sum(c) == 2 * 12 and min(c) >= 3 for c in counts)
    assert any(len(set(c)) > 1 for c in counts), counts  # the budget is spread unevenly over the heads


def test_pooled_fingerprint_is_one_value_with_defensivekv():
    """Every rule pooled shares one kernel fingerprint, defensivekv and adakv:defensivekv included (the new
    signals are computed for every rule), and unpooled defensivekv shares the unpooled one."""
    model = tiny_model("qwen2", layers=2)
    fp = {name: fxbudget.kernel_fingerprint(model, rule=rule, budget=40, head_pool=pool)
          for name, rule, pool in [("adakv:snapkv", "adakv:snapkv", None),
                                   ("adakv:defensivekv", "adakv:defensivekv", None),
                                   ("defensivekv-pooled", "defensivekv", True), ("snapkv", "snapkv", None),
                                   ("defensivekv", "defensivekv", None)]}
    assert fp["adakv:snapkv"] == fp["adakv:defensivekv"] == fp["defensivekv-pooled"]
    assert fp["snapkv"] == fp["defensivekv"] != fp["adakv:snapkv"]


def test_adakv_defensivekv_refused_without_the_output_projection():
    """The AdaKV wrapper carries the wrapped rule's need for W_o: refused on a model whose W_o is not found."""
    model = tiny_model("qwen2", layers=2)
    odd = fresh(model)
    odd.model.layers[0].self_attn.o_proj = torch.nn.Identity()
    assert rules.get("adakv:defensivekv").needs_wo and rules.Pyramid(rules.get("defensivekv")).needs_wo
    assert not rules.get("adakv:snapkv").needs_wo and not rules.Pyramid(rules.get("snapkv")).needs_wo
    with pytest.raises(ValueError, match="rule 'adakv:defensivekv' needs each attention layer's output projection"):
        fxbudget.compile(odd, rule="adakv:defensivekv", budget=64)  # above the 32 it protects per head
