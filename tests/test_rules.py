"""Rule library: protected sets at their boundary, seeded randomness, per-layer budgets, user-defined rules."""

import math
import re
from pathlib import Path

import pytest
import torch

import fxbudget
from fxbudget import rules
from fxbudget.kernel import budget_attention
from fxbudget.kernel import TOTALED
from conftest import fresh, tiny_model
from fxbudget.cache.keyword import output_cache


def _kept_after_one_call(rule, budget, n=20, seed=0):
    """Positions kept by one call of `n` tokens into an empty cache of `budget` slots (1 row, 2 KV heads)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d = 1, 2, 8
    z = torch.zeros(b, h, budget, d)
    pos = torch.full((b, h, budget), -1)
    budget_attention(torch.randn(b, 2 * h, n, d, generator=gen), z, z.clone(), pos, torch.zeros(b, h, budget),
                     torch.zeros(b, h, budget, 3), torch.zeros(b, h, len(TOTALED)),
                     torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen), torch.arange(n),
                     rule=rule, budget=budget, window=rule.window or 32)
    return [sorted(p for p in row.tolist() if p >= 0) for row in pos[0]]


def test_streamingllm_sinks_at_boundary():
    assert _kept_after_one_call(rules.get("streamingllm"), 4) == [[0, 1, 2, 3]] * 2
    assert _kept_after_one_call(rules.get("streamingllm"), 5) == [[0, 1, 2, 3, 19]] * 2


def test_snapkv_window_at_boundary():
    assert _kept_after_one_call(rules.get("snapkv", window=4), 4) == [[16, 17, 18, 19]] * 2
    for row in _kept_after_one_call(rules.get("snapkv", window=4), 5):
        assert row[-4:] == [16, 17, 18, 19] and len(row) == 5 and row[0] < 16


def test_h2o_recent_window_at_boundary():
    assert _kept_after_one_call(rules.get("h2o", recent_ratio=1.0), 6) == [list(range(14, 20))] * 2
    for row in _kept_after_one_call(rules.get("h2o", recent_ratio=0.5), 6):
        assert row[-3:] == [17, 18, 19] and len(row) == 6


def test_random_is_seeded():
    a = _kept_after_one_call(rules.get("random", seed=0), 8)
    assert a == _kept_after_one_call(rules.get("random", seed=0), 8, seed=1)  # the draw ignores the inputs
    assert a != _kept_after_one_call(rules.get("random", seed=1), 8)
    assert a[0] != a[1]  # heads draw independently


def test_tova_share_heads_keeps_one_set_per_layer():
    shared = _kept_after_one_call(rules.get("tova", share_heads=True), 6)
    assert shared[0] == shared[1]
    assert len({tuple(r) for r in _kept_after_one_call(rules.get("tova"), 6)}) == 2


def test_pyramid_budgets_sum_exactly_and_memory_matches_uniform():
    for budget, layers, beta, window in ((256, 24, 20, 32), (64, 7, 5, 8), (40, 2, 20, 32), (33, 3, 2, 32)):
        b = rules.pyramid_budgets(budget, layers, beta, window)
        assert sum(b) == budget * layers and b == sorted(b, reverse=True) and min(b) >= 1
    model = tiny_model("llama", layers=4)
    m = fxbudget.compile(fresh(model), rule="pyramidkv", budget=48, window=8, backend=None)
    cache = m.forward.new_cache()
    assert cache.layer_budgets != [48] * 4 and cache.kv_bytes() == fxbudget.BudgetCache(model.config, 48).kv_bytes()
    with pytest.raises(ValueError, match="sum to 100, not 4 layers x budget 48"):
        fxbudget.BudgetCache(model.config, 48, layer_budgets=[40, 30, 20, 10])
    with pytest.raises(ValueError, match="needs per-layer budgets"):
        m(input_ids=torch.zeros(1, 3, dtype=torch.long), past_key_values=fxbudget.BudgetCache(model.config, 48))
    with torch.no_grad():
        cache = output_cache(m(input_ids=torch.randint(0, 96, (1, 100))))
    assert cache.layer_budgets == rules.pyramid_budgets(48, 4, 20, 8, prompt=100) != [48] * 4
    held = [int((cache.positions(i)[0, 0] >= 0).sum()) for i in range(4)]
    assert held == [min(100, b) for b in cache.layer_budgets]


def test_pyramid_schedule_follows_the_prompt():
    """As KVCache-Factory's PyramidKV: uniform for prompts below max(B, 2(B - w)); the lowest layer's budget is
    capped at the prompt; the sum stays layers x budget."""
    B, w = 128, 32
    for n in (10, 127, 128, 191):  # below max(B, 2(B - w)) = 192
        assert rules.pyramid_budgets(B, 2, 20, w, prompt=n) == [B, B]
    fixed = rules.pyramid_budgets(B, 4, 20, w)
    assert fixed == [219, 158, 98, 37]  # w + 188 - 61 i (188 = 2(B - w) - (B - w) // 20), less 2 of rounding
    for n in (192, 200, 218):  # the lowest layer would get more than the prompt: capped, the rest moves up
        b = rules.pyramid_budgets(B, 4, 20, w, prompt=n)
        assert sum(b) == 4 * B and b == sorted(b, reverse=True) and abs(b[0] - n) <= 1 and b[-1] > fixed[-1], b
    assert rules.pyramid_budgets(B, 4, 20, w, prompt=5000) == fixed
    # Where the length is known: the cache made on a call without one, and new_cache(prompt=); else the fixed one.
    model = tiny_model("llama", layers=4)
    m = fxbudget.compile(fresh(model), rule="pyramidkv", budget=B, backend=None)
    assert m.forward.new_cache().layer_budgets == fixed
    with torch.no_grad():
        for n in (48, 200):
            cache = output_cache(m(input_ids=torch.randint(0, 96, (1, n))))
            assert cache.layer_budgets == rules.pyramid_budgets(B, 4, 20, w, prompt=n)
            m(input_ids=torch.zeros(1, 1, dtype=torch.long), cache=cache)  # its schedule is accepted on later calls
        sized = m.forward.new_cache(prompt=200)
        m(input_ids=torch.randint(0, 96, (1, 200)), cache=sized)
        assert sized.layer_budgets == cache.layer_budgets


def test_pyramid_wraps_any_rule():
    p = rules.Pyramid(rules.get("h2o"), beta=4)
    assert p.layer_budgets(64, 4) == rules.pyramid_budgets(64, 4, 4, 0) and p.name == "pyramid(h2o)"
    model = tiny_model("llama", layers=2)
    m = fxbudget.compile(fresh(model), rule=p, budget=16, backend=None)
    with torch.no_grad():
        cache = output_cache(m(input_ids=torch.randint(0, 96, (1, 40))))
    assert cache.layer_budgets == [28, 4]


def _readme_example() -> str:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    return re.search(r"<!-- user-rule-example -->\s*```python\n(.*?)```", text, re.S).group(1)


def test_readme_user_rule_example_runs_and_shares_the_kernel(monkeypatch):
    code = _readme_example()
    assert len(code.strip().splitlines()) <= 22
    model = tiny_model("llama")
    # The block loads the embedded model itself (it runs alone: tests/test_readme.py); here a tiny one stands in.
    monkeypatch.setattr("fxbudget.models.load_default", lambda *a, **k: (fresh(model), None))
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert "late_heavy" in rules.available()
    m = ns["model"]
    m.forward.restore()
    fxbudget.compile(m, rule="late_heavy", budget=16, backend=None)
    with torch.no_grad():
        cache = m(input_ids=torch.randint(0, 96, (1, 30))).past_key_values
    assert int((cache.positions(0) >= 0).sum(-1).max()) == 16
    ids = torch.randint(0, 96, (1, 12))
    assert fxbudget.kernel_fingerprint(model, ids, rule="late_heavy", budget=40) == \
        fxbudget.kernel_fingerprint(model, ids, rule="snapkv", budget=40)


def test_function_rule():
    @rules.register("newest_first_fn")
    def newest(s):
        """Keep the newest tokens."""
        return s.pos.float()

    assert isinstance(rules.get("newest_first_fn"), rules.Rule)
    assert _kept_after_one_call(rules.get("newest_first_fn"), 5) == [[15, 16, 17, 18, 19]] * 2


class _Scored(rules.Rule):
    """A test rule whose score is `fn(signals)` (not registered)."""

    name = "scored"

    def __init__(self, fn):
        self.fn = fn

    def score(self, s):
        return self.fn(s)


def _one_call(fn, slot_pos, n, *, dtype=torch.float32):
    """Positions kept after one call of `n` tokens into slots holding `slot_pos` (-1 = empty), keep = len(slot_pos)."""
    b, h, S, d = 1, 1, len(slot_pos), 4
    z = torch.zeros(b, h, S, d, dtype=dtype)
    pos = torch.tensor(slot_pos).view(b, h, S)
    start = max(slot_pos) + 1
    budget_attention(torch.randn(b, h, n, d, dtype=dtype), z, z.clone(), pos, torch.zeros(b, h, S),
                     torch.zeros(b, h, S, 3), torch.zeros(b, h, len(TOTALED)), torch.randn(b, h, n, d, dtype=dtype),
                     torch.randn(b, h, n, d, dtype=dtype), torch.arange(start, start + n), rule=_Scored(fn), budget=S)
    return sorted(p for p in pos.flatten().tolist() if p >= 0)


def _scores(values, dtype=torch.float32):
    return lambda s: torch.tensor(values, dtype=dtype).view(1, 1, -1)


@pytest.mark.parametrize("bad, match", [
    (lambda s: s.attn[..., :1], r"shape \(1, 1, 1\), expected exactly the candidates' shape \(1, 1, 3\)"),
    (lambda s: s.attn[0, 0], r"shape \(3,\), expected exactly"),
    (lambda s: s.pos, "must be a floating tensor, got torch.int64"),
    (lambda s: 1.0, "must be a tensor, got float"),
])
def test_score_must_have_the_candidates_shape_and_a_float_dtype(bad, match):
    from fxbudget.kernel import RuleContractError

    with pytest.raises(RuleContractError, match="rule 'scored': .*" + match):
        _one_call(bad, [0, 1], 1)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_nan_score_ranks_lowest_among_tokens(sign):
    nan = math.copysign(math.nan, sign)
    assert torch.signbit(torch.tensor(nan)) == (sign < 0)
    # Full cache: the NaN slot goes first, whatever its sign (+NaN used to outrank every score, +inf included).
    assert _one_call(_scores([5.0, nan, 3.0]), [0, 1], 1) == [0, 2]
    # Empty slots go before a NaN token (-NaN used to rank below the empty slots' -inf and lose the token).
    assert _one_call(_scores([0.0, 0.0, 0.0, 0.0, nan, 1.0]), [-1, -1, -1, -1], 2) == [0, 1]


def test_float64_scores_rank_in_float32():
    # Documented (kernel.rule_region): scores are ranked in float32, so these two tie and the newer token wins.
    assert _one_call(_scores([1.0 + 1e-12, 1.0], torch.float64), [0], 1, dtype=torch.float64) == [1]
