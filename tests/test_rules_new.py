"""The kvpress-derived rules (`observed_attention`, `chunkkv`, `lagkv`, `cur`, `leverage`, `compactor`): listed,
validated with messages naming the rule and the field, kept sets of a real call, and their kernel is the shared one."""

import pytest
import torch

import fxbudget
from conftest import chunked_prefill_then_decode, fresh, tiny_model
from fxbudget import rules
from fxbudget.cli.rules_table import rules_table

NEW = ("observed_attention", "chunkkv", "lagkv", "cur", "leverage", "compactor")


def test_listed_with_their_reference_defaults():
    table = rules_table()
    for name in NEW:
        assert f"| `{name}` |" in table
    assert "chunk_length=20" in table and "lag_size=128" in table and "local_window_size=16" in table
    assert "sketch_dimension=48" in table and "sink_size_start=8" in table and "chunk_size=256" in table


@pytest.mark.parametrize("name, params, match", [
    ("chunkkv", {"chunk_length": 0}, "chunkkv chunk_length must be an int >= 1, got 0"),
    ("chunkkv", {"kernel": 4}, "chunkkv kernel must be a positive odd int, got 4"),
    ("chunkkv", {"window": -1}, "chunkkv window must be an int >= 1, got -1"),
    ("lagkv", {"lag_size": 0}, "lagkv lag_size must be an int >= 1, got 0"),
    ("lagkv", {"n_sink": -1}, "lagkv n_sink must be an int >= 0, got -1"),
    ("lagkv", {"cross_scoring": 1}, "lagkv cross_scoring must be a bool, got 1"),
    ("cur", {"local_window_size": 0}, "cur local_window_size must be an int >= 1, got 0"),
    ("cur", {"num_sinks": -2}, "cur num_sinks must be an int >= 0, got -2"),
    ("cur", {"leverage_type": "kv"}, "cur leverage_type must be one of key, value, kv_avg, kv_product, got 'kv'"),
    ("cur", {"use_random_leverage": "yes"}, "cur use_random_leverage must be a bool, got 'yes'"),
    ("leverage", {"sketch_dimension": 0}, "leverage sketch_dimension must be an int >= 1, got 0"),
    ("leverage", {"seed": -1}, "leverage seed must be an int >= 0, got -1"),
    ("compactor", {"chunk_size": 0}, "compactor chunk_size must be an int >= 1, got 0"),
    ("compactor", {"sink_size_end": -1}, "compactor sink_size_end must be an int >= 0, got -1"),
    ("compactor", {"blending": -0.5}, "compactor blending must be None or a float >= 0, got -0.5"),
    ("compactor", {"sketch_dimension": 2.5}, "compactor sketch_dimension must be an int >= 1, got 2.5"),
])
def test_bad_hyperparameters_are_refused(name, params, match):
    with pytest.raises(ValueError, match="^" + match.replace("(", r"\(").replace(")", r"\)") + "$"):
        rules.get(name, **params)


def test_rope_rules_refuse_models_without_default_rope():
    assert rules.get("leverage").needs_rope and rules.get("compactor").needs_rope


@pytest.mark.parametrize("name", NEW)
def test_chunked_prefill_and_decode_evict_to_the_budget(name):
    """A real model, chunked prefill then decode (cached entries and new tokens scored together): every layer holds
    exactly the budget, positions distinct, and the output is finite."""
    model = tiny_model("qwen2", layers=2)
    params = {"chunk_length": 4} if name == "chunkkv" else {"lag_size": 8} if name == "lagkv" else \
        {"chunk_size": 16, "sketch_dimension": 8} if name == "compactor" else \
        {"sketch_dimension": 8} if name == "leverage" else {}
    # An instance: compactor's `chunk_size` (its attention chunks) is not compile's `chunk_size` (prefill chunks).
    m = fxbudget.compile(fresh(model), rule=rules.get(name, **params), budget=24, backend=None, chunk_size=16)
    logits, held, cache = chunked_prefill_then_decode(m)
    assert torch.isfinite(logits).all()
    for i, row in held:
        assert len(row) == 24 == len(set(row)) and max(row) <= 72, (i, sorted(row))
    if name == "chunkkv":  # heads keep the same positions
        assert all(torch.equal(cache.positions(i)[0, 0].sort().values, cache.positions(i)[0, 1].sort().values)
                   for i in range(len(cache.layers)))
