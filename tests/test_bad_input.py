"""DESIGN §7: every bad input raises a clear error and leaves the model as it was."""

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fxbudget
from conftest import COMMON, fresh, tiny_model
from tiny_attention import CONFIG, OneLayer


def _untouched(model, impl="sdpa"):
    assert "forward" not in vars(model), "model.forward was replaced"
    if getattr(model, "config", None) is not None:
        assert model.config._attn_implementation == impl


@pytest.fixture
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("rule, params, err, match", [
    ("nope", {}, ValueError, "unknown rule 'nope'; known rules: .*snapkv"),
    ("snapkv", {"windw": 3}, TypeError, "bad parameters for rule 'snapkv'"),
    ("snapkv", {"pooling": "median"}, ValueError, "pooling"),
    (3, {}, TypeError, "rule must be a name"),
])
def test_bad_rule(model, rule, params, err, match):
    with pytest.raises(err, match=match):
        fxbudget.compile(model, rule=rule, budget=8, **params)
    _untouched(model)


@pytest.mark.parametrize("budget", [0, -3, 2.5, True, "8", None])
def test_bad_budget(model, budget):
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        fxbudget.compile(model, rule="h2o", budget=budget)
    _untouched(model)


def test_bad_backend_and_chunk(model):
    with pytest.raises(ValueError, match="backend must be one of"):
        fxbudget.compile(model, budget=8, backend="tensorrt")
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        fxbudget.compile(model, budget=8, chunk_size=0)
    _untouched(model)


def test_budget_above_max_positions_warns(model):
    with pytest.warns(UserWarning, match="exceeds the model's max_position_embeddings 512"):
        fxbudget.compile(fresh(model), budget=1000, backend=None)


def test_non_sdpa_attention():
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **{**COMMON, "attn_implementation": "eager"}))
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        fxbudget.compile(model, budget=8)
    _untouched(model, impl="eager")


def test_unsupported_layer_type():
    cfg = LlamaConfig(num_hidden_layers=2, **COMMON)
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        fxbudget.BudgetCache(cfg, 8)


@pytest.mark.newest
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_no_sdpa_in_model(backend):
    """A model fxbudget cannot budget fails on every call, never runs unbudgeted; restore() gives it back."""
    model = OneLayer(use_sdpa=False)
    fxbudget.compile(model, rule="knorm", budget=4, backend=backend)
    for _ in range(2):  # the second call must not silently run the unmodified model
        with pytest.raises(fxbudget.NoBudgetAttentionError, match="scaled_dot_product_attention.*restore()"):
            model(torch.zeros(1, 3, dtype=torch.long), past_key_values=fxbudget.BudgetCache(CONFIG, 4))
    assert model.forward.restore() is model
    _untouched(model)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_failed_model_stays_failed_in_generate(backend):
    """An HF model whose attention stops being SDPA: every generate() raises, none runs the full cache."""
    model = fxbudget.compile(tiny_model("llama"), rule="snapkv", budget=16, backend=backend)
    model.config._attn_implementation = "eager"  # attention fxbudget cannot see (matmul + softmax, no SDPA)
    ids = torch.randint(0, 96, (1, 6))
    for _ in range(2):
        with pytest.raises(fxbudget.NoBudgetAttentionError, match="restore()"):
            model.generate(ids, max_new_tokens=2, do_sample=False)
    model.forward.restore()
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 8)


def test_compile_twice(model):
    m = fxbudget.compile(fresh(model), budget=8, backend=None)
    with pytest.raises(ValueError, match="already compiled"):
        fxbudget.compile(m, budget=8)
    assert m.forward.restore() is m
    _untouched(m)


def test_right_padded_batch(model):
    m = fxbudget.compile(fresh(model), budget=8, backend=None)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="must be left padding"):
        m(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=mask)


@pytest.mark.parametrize("cache_kwargs, match", [
    (dict(budget=8, dtype=torch.float64), "cache is torch.float64 on cpu, model is torch.float32"),
    (dict(budget=8, batch_size=2), "batch size 2"),
    (dict(budget=9), "budget 9 differs"),
    (dict(budget=8, config=LlamaConfig(num_hidden_layers=3, **COMMON)), "another model"),
])
def test_mismatched_cache(model, cache_kwargs, match):
    m = fxbudget.compile(fresh(model), budget=8, backend=None)
    config = cache_kwargs.pop("config", model.config)
    cache = fxbudget.BudgetCache(config, **cache_kwargs)
    with pytest.raises(ValueError, match=match):
        m(input_ids=torch.zeros(1, 3, dtype=torch.long), past_key_values=cache)
    assert cache.tokens_seen == 0


def test_cache_outside_fxbudget(model):
    with pytest.raises(RuntimeError, match="used outside fxbudget"):
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), past_key_values=fxbudget.BudgetCache(model.config, 8))


def test_use_cache_false(model):
    m = fxbudget.compile(fresh(model), budget=8, backend=None)
    with pytest.raises(ValueError, match="use_cache=False"):
        m(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False)


def test_bad_cache_arguments(model):
    for kwargs in (dict(budget=0), dict(budget=4, headroom=-1), dict(budget=4, batch_size=0)):
        with pytest.raises(ValueError, match="must be an int"):
            fxbudget.BudgetCache(model.config, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxbudget.BudgetCache(model.config, 4, headroom=0)


def test_expected_attention_needs_default_rope():
    cfg = LlamaConfig(num_hidden_layers=1, **COMMON)
    # dynamic scaling changes the frequencies with the length inside the forward: refused (llama3, YaRN, linear are
    # read off the model's rotary embedding: tests/test_model_rope.py)
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="needs the model's RoPE frequencies"):
        fxbudget.compile(model, rule="expected_attention", budget=8)
    _untouched(model)


def test_recompile_limit_error_is_scoped_to_fxbudget_calls():
    # fxbudget wants an error past Dynamo's recompile limit (not a silent eager fallback), but only in its own calls.
    import torch._dynamo.config as dynamo_config

    seen = []

    class Probe(fxbudget.rules.Rule):  # runs while the pass traces the kernel, inside the compiled call
        name = "probe"

        def score(self, s):
            seen.append(dynamo_config.fail_on_recompile_limit_hit)
            return s.attn

    before = dynamo_config.fail_on_recompile_limit_hit
    # signals="all": no dry run of the score at compile (outside any compiled call), which `seen` would record
    m = fxbudget.compile(tiny_model("llama", layers=1), rule=Probe(), budget=8, backend="eager", signals="all")
    with torch.no_grad():
        m(input_ids=torch.randint(0, 96, (1, 5)))
    assert seen and set(seen) == {True}
    assert dynamo_config.fail_on_recompile_limit_hit == before
