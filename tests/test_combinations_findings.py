"""The eight combinations a review found silently wrong (issue 29), each pinned by a test that failed before its fix.

1. a pooled cache restored after the likelihood's scratch calls (`owner` included): `BudgetCache.snapshot/restore`;
2. rules that sum over heads (`tova(share_heads=True)`, `chunkkv`) keep the same sets pooled and unpooled;
3. `adakv:kvzip` is replay-only, like kvzip (wrappers delegate every capability);
4. NoPE layers (SmolLM3's `no_rope_layers`) get no rotation: pre-RoPE keys are the keys;
5. partial rotary: `Signals.prerope_keys` un-rotates the rotated dims only (leverage/compactor ran into a shape error);
6. lm-eval's first continuation token is predicted over the compressed cache (tests/test_lmeval.py);
7. `adakv:defensivekv` refuses a budget below its protected window, as `adakv:snapkv` does (asked of the rule);
8. lm-eval's model arguments go through `compare`'s rule validation (tests/test_lmeval.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import PhiConfig, PhiForCausalLM, SmolLM3Config, SmolLM3ForCausalLM

import fxbudget
from fxbudget.cache import LAYER_STATE
from fxbudget.harness.likelihood import answer_logprobs
from fxbudget.rules import get
from fxbudget.rules.base import Signals

from conftest import COMMON, fresh, tiny_model


def _state(cache):
    return [{n: getattr(layer, n).clone() for n in LAYER_STATE} for layer in cache.layers]


# --- 1 --------------------------------------------------------------------------------------------------------------

def test_streaming_likelihood_leaves_a_pooled_cache_bit_identical():
    model = fxbudget.compile(tiny_model("llama"), rule="adakv:snapkv", budget=8, backend=None, window=2)
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (1, 20))
    cache = model.forward.new_cache(1)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
    before = _state(cache)
    counts = [layer.head_counts().clone() for layer in cache.layers]
    answer = torch.randint(0, 96, (1, 6))
    answer_logprobs(model, cache, out.logits[:, -1], answer, evict=True)  # streaming: evicting scratch calls
    for got, want in zip(_state(cache), before):
        for n in LAYER_STATE:
            assert torch.equal(got[n], want[n]), n
    assert all(torch.equal(layer.head_counts(), c) for layer, c in zip(cache.layers, counts))


# --- 2 --------------------------------------------------------------------------------------------------------------

def _kept_sets(model, ids, steps, **kw):
    m = fxbudget.compile(fresh(model), backend=None, **kw)
    cache = m.forward.new_cache(ids.shape[0])
    kept, tok = [], ids
    with torch.no_grad():
        for _ in range(steps + 1):
            out = m(input_ids=tok, past_key_values=cache)
            kept.append([[[sorted(p for p in head if p >= 0) for head in row]
                          for row in cache.head_positions(i).tolist()] for i in range(len(cache.layers))])
            tok = out.logits[:, -1:].argmax(-1)
    return kept, out.logits


@pytest.mark.parametrize("rule, params", [("tova", {"share_heads": True}),
                                          ("chunkkv", {"window": 2, "chunk_length": 3})])
def test_head_summing_rules_keep_the_same_sets_pooled(rule, params):
    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 24))
    kept, logits = _kept_sets(model, ids, 8, rule=rule, budget=10, **params)
    kept_pool, logits_pool = _kept_sets(model, ids, 8, rule=rule, budget=10, head_pool=True, **params)
    assert kept_pool == kept
    assert (logits_pool - logits).abs().max().item() <= 1e-5
    # every head of a layer holds the same positions (the rule's premise), in both layouts
    assert all(row[0] == h for step in kept_pool for layer in step for row in layer for h in row)


# --- 3 --------------------------------------------------------------------------------------------------------------

def test_adakv_kvzip_is_replay_only_and_refused_in_plain_generation():
    assert get("adakv:kvzip").replay_only and get("kvzip").replay_only
    model = fxbudget.compile(tiny_model("llama"), rule="adakv:kvzip", budget=4, backend=None)
    with pytest.raises(ValueError, match="replay"), torch.no_grad():
        model(input_ids=torch.randint(0, 96, (1, 12)))


# --- 4 --------------------------------------------------------------------------------------------------------------

def test_nope_layers_get_no_rotation():
    cfg = SmolLM3Config(num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, **COMMON)
    assert list(cfg.no_rope_layers) == [1, 1, 1, 0]
    model = SmolLM3ForCausalLM(cfg).eval()
    m = fxbudget.compile(model, rule="expected_attention", budget=64, backend=None)
    cache = m.forward.new_cache(1)
    for i, layer in enumerate(cache.layers):
        nope = not cfg.no_rope_layers[i]
        assert bool((layer.inv_freq == 0).all()) == nope, i
    ids = torch.randint(0, 96, (1, 24))
    with torch.no_grad():  # and a covering budget still reproduces the model
        full = m(input_ids=ids).logits
        m.forward.restore()
        assert (full - model(input_ids=ids).logits).abs().max().item() <= 1e-4


# --- 5 --------------------------------------------------------------------------------------------------------------

def _rotate(x, pos, inv_freq):
    """transformers' partial rotary (Phi): `apply_rotary_pos_emb` on the first `2 * len(inv_freq)` dims."""
    rot = 2 * inv_freq.shape[0]
    theta = pos.double().unsqueeze(-1) * inv_freq.double()
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    r, rest = x[..., :rot], x[..., rot:]
    a, b = r.chunk(2, dim=-1)
    return torch.cat([r * cos + torch.cat([-b, a], -1) * sin, rest], dim=-1)


def test_prerope_keys_unrotate_only_the_rotated_dims():
    torch.manual_seed(0)
    d, C = 16, 7
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)  # partial rotary 0.5: 8 of 16 dims
    pre = torch.randn(1, 2, C, d, dtype=torch.float64)
    pos = torch.arange(C).view(1, 1, C).expand(1, 2, C)
    keys = _rotate(pre, pos, inv_freq)
    z = torch.zeros(1, 2, C, dtype=torch.float64)
    s = Signals(z, z, z, z, z, z, pos, z, keys[:, :, :4], z, torch.arange(4, C).view(1, -1), inv_freq,
                z, z, z, z, budget=4, window=torch.ones(1, 1, 1, dtype=torch.long))
    s.k_new = keys[:, :, 4:]
    assert torch.allclose(s.prerope_keys(), pre, atol=1e-12)


@pytest.mark.parametrize("rule", ["leverage", "compactor"])
def test_key_rules_run_on_partial_rotary(rule):
    cfg = PhiConfig(num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **COMMON)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    model = PhiForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        m = fxbudget.compile(model, rule=rule, budget=64, backend=None)
        assert (m(input_ids=ids).logits - ref).abs().max().item() <= 1e-4  # covering budget: the model
        m.forward.restore()
        small = fxbudget.compile(model, rule=rule, budget=12, backend=None, chunk_size=16)  # evicting calls
        assert torch.isfinite(small(input_ids=ids).logits).all()


# --- 7 --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule, need", [("adakv:snapkv", 32), ("adakv:defensivekv", 32), ("adakv:streamingllm", 4),
                                        ("adakv:compactor", 12), ("adakv:h2o", 4)])
def test_adakv_refuses_a_budget_below_what_the_rule_protects(rule, need):
    """`need`: the tokens the wrapped rule protects in a full head at budget `need` (its defaults: snapkv's and
    defensivekv's window 32, four sinks, compactor's 8 + 4 ends, h2o's half of a budget of 4... at 8: 4)."""
    if rule == "adakv:h2o":
        get(rule).check_budget([4])  # h2o protects a fraction of the budget: always fits
        return
    with pytest.raises(ValueError, match="protects in every head"):
        get(rule).check_budget([need - 1])
    get(rule).check_budget([need])
