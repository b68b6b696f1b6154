"""The `weighted` family (rules/weighted.py): it contains built-in rules as points, its statistics ignore empty
slots and pads, and every point runs the shared kernel."""

import pytest
import torch

import fxbudget
from fxbudget import rules
from fxbudget.rules.base import Signals
from fxbudget.rules.weighted import WEIGHTS, Weighted, builtin_points

from conftest import tiny_model

MIXED = dict(w_attn=0.3, w_window_attn=-0.2, w_last_attn=0.5, w_acc_attn=0.1, w_key_norm=-0.7, w_value_norm=0.4,
             w_recency=0.6, w_mean_attn=0.2, w_key_diff=-0.3, w_window_max_attn=0.25, w_wov_norm=-0.15, n_sink=2,
             n_recent=5, pool=3)


def _kept(model, ids, rule, budget, **params):
    m = fxbudget.compile(model, rule=rule, budget=budget, backend=None, **params)
    try:
        cache = m.forward.new_cache(ids.shape[0])
        with torch.no_grad():
            m(input_ids=ids, past_key_values=cache)
        return [cache.positions(i).sort(-1).values for i in range(len(cache.layers))]
    finally:
        m.forward.restore()


@pytest.mark.parametrize("name", list(builtin_points(48)))
def test_builtin_points_keep_what_the_builtin_rules_keep(name):
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (2, 100), generator=torch.Generator().manual_seed(0))
    point = builtin_points(48)[name]
    expected = _kept(model, ids, name, 48)
    assert all(torch.equal(a, b) for a, b in zip(expected, _kept(model, ids, "weighted", 48, **point)))
    # The oracle can fail: a changed weight keeps other tokens.
    other = {**point, **({"w_key_norm": 1.0} if name == "knorm" else {"w_key_norm": -1.0, "n_sink": 0, "n_recent": 0})}
    assert not all(torch.equal(a, b) for a, b in zip(expected, _kept(model, ids, "weighted", 48, **other)))


def test_default_is_the_snapkv_point():
    assert {k: v for k, v in Weighted().params().items()} == builtin_points(48)["snapkv"]


def _signals(c_valid: int, c_empty: int, seed: int = 0, garbage: float = 0.0) -> Signals:
    """Signals of `c_empty` empty slots (pos -1, every value `garbage`) followed by `c_valid` new tokens."""
    g = torch.Generator().manual_seed(seed)
    b, h, d, n = 1, 2, 4, c_valid

    def per(x):
        return torch.cat([torch.full((b, h, c_empty), garbage), x], dim=-1)

    att = {k: per(torch.rand(b, h, n, generator=g) + 0.01) for k in ("attn", "window_attn", "last_attn", "acc_attn")}
    pos = torch.cat([torch.full((b, h, c_empty), -1), torch.arange(n).expand(b, h, n)], dim=-1)
    return Signals(**att, key_norm=per(torch.rand(b, h, n, generator=g) * 3),
                   value_norm=per(torch.rand(b, h, n, generator=g)), pos=pos,
                   queries=torch.zeros(b, h, 2 * n, d), k_slots=torch.full((b, h, c_empty, d), garbage),
                   k_new=torch.randn(b, h, n, d, generator=g), new_pos=torch.arange(n).view(1, n),
                   inv_freq=torch.ones(d // 2), v_slots=torch.full((b, h, c_empty, d), garbage),
                   v_new=torch.randn(b, h, n, d, generator=g), window_max_attn=per(torch.rand(b, h, n, generator=g)),
                   wov_norm=per(torch.rand(b, h, n, generator=g)), budget=8, window=4)


@pytest.mark.parametrize("garbage", [0.0, 1e6])
def test_empty_slots_do_not_enter_the_statistics(garbage):
    rule = Weighted(**MIXED)
    alone = _signals(12, 0)
    with_empty = _signals(12, 5, garbage=garbage)
    feats = rule.features(with_empty)
    for name, x in rule.features(alone).items():
        assert torch.allclose(feats[name][..., 5:], x, atol=1e-6), name
        assert torch.equal(feats[name][..., :5], torch.zeros_like(feats[name][..., :5])), name
        assert torch.allclose(x.mean(-1), torch.zeros(()), atol=1e-6) and torch.allclose(x.std(-1, correction=0),
                                                                                        torch.ones(()), atol=1e-5)
    # The pooled score of a token next to the empty slots in sequence order is its own neighbours' only.
    assert torch.allclose(rule.score(with_empty)[..., 5:], rule.score(alone), atol=1e-6)


@pytest.mark.parametrize("weight, signal", [("w_window_max_attn", "window_max_attn"), ("w_wov_norm", "wov_norm")])
def test_defensivekv_signals_are_terms(weight, signal):
    """Issue 23's kernel signals are terms of the family: alone, each ranks the candidates as its signal does."""
    s = _signals(12, 0, seed=3)
    point = {**{w: 0.0 for w in WEIGHTS}, weight: 1.0, "pool": 1, "n_recent": 0}
    order = Weighted(**point).score(s).argsort(-1)
    assert torch.equal(order, getattr(s, signal).argsort(-1))
    assert not torch.equal(order, s.key_norm.argsort(-1))  # the oracle can fail
    assert Weighted(**point).needs_wo == (weight == "w_wov_norm")


def test_zero_wov_weight_runs_without_wo():
    """wov_norm is NaN where the model's W_o is unknown: a zero weight leaves it out (0 * NaN would be NaN)."""
    s = _signals(12, 0)
    s.wov_norm = torch.full_like(s.wov_norm, float("nan"))
    assert not Weighted().needs_wo and torch.isfinite(Weighted(**{**MIXED, "w_wov_norm": 0.0}).score(s)).all()
    assert torch.isnan(Weighted(**MIXED).score(s)).any()


def test_formula_names_every_nonzero_term():
    text = Weighted(**MIXED).formula()
    assert text.startswith("score = 0.3 * z(log attn) -0.2 * z(log window_attn)")
    assert "z(-log age)" in text and "max-pooled over 3" in text
    assert text.endswith("; always kept: the first 2 and the last 5 positions")
    assert Weighted(**{w: 0.0 for w in WEIGHTS}, pool=1, n_recent=0).formula() == "score = 0"
    assert Weighted(w_key_norm=-1.0, w_window_attn=0.0, pool=1, n_recent=0).formula() == "score = -1 * z(key_norm)"


def test_bad_parameters_are_refused():
    for bad in ({"pool": 2}, {"pool": 0}, {"n_sink": -1}, {"n_recent": 1.5}):
        with pytest.raises(ValueError):
            rules.get("weighted", **bad)


def test_every_point_runs_the_shared_kernel():
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (1, 12))
    base = fxbudget.kernel_fingerprint(model, ids, rule="snapkv", budget=40)
    assert fxbudget.kernel_fingerprint(model, ids, rule="weighted", budget=40, **MIXED) == base
    assert fxbudget.kernel_fingerprint(model, ids, rule="weighted", budget=40, pool=1) == base
