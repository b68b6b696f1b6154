"""A memory budget in bytes (issue 58, the model's dtype): `budget="256MiB"` is the largest token budget whose cache
fits, counted off the cache's own tensors; it runs the same kernel as that token budget, and a covering one is the
unmodified model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import MistralConfig

import fxbudget
from conftest import fails_in_one_line, fresh, greedy, tiny_model
from fxbudget.checks import byte_size, size_label
from fxbudget.cache import BudgetCache
from fxbudget.cache.byte_budget import cache_bytes, tokens_for_bytes
from fxbudget.harness.grid import Grid, budget_kind
from fxbudget.harness.grouping import budget_label, budgets
from fxbudget.kernel.signals import TOKEN_SIGNALS
from fxbudget.kernel.state import SLOT_FIELDS, TOTALED

pytestmark = pytest.mark.usefixtures("shared_fingerprints")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("spec, n", [("256MiB", 256 * 2**20), ("1.5GiB", 3 * 2**29), ("1GB", 10**9), ("100B", 100),
                                     ("4 KiB", 4096), ("0.5KB", 500)])
def test_sizes_parse(spec, n):
    assert byte_size(spec) == n and budget_kind(spec) == "bytes"


@pytest.mark.parametrize("spec", [128, "12.5%", "128"])
def test_other_budgets_are_not_sizes(spec):
    assert byte_size(spec) is None


@pytest.mark.parametrize("spec, match", [("12XB", "a number and a unit"), ("MiB", "a number and a unit"),
                                         ("1.2.3MiB", "a number and a unit"), ("0B", "at least 1 B"),
                                         ("0.4B", "at least 1 B")])
def test_malformed_sizes_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        byte_size(spec)


def test_labels_fold_one_size_written_two_ways():
    assert size_label(byte_size("1MiB")) == size_label(byte_size("1024KiB")) == "1 MiB"
    assert size_label(1536 * 1024) == "1.5 MiB" and size_label(100) == "100 B"
    rows = [{"budget": 9, "budget_bytes": 4096}, {"budget": 20, "budget_bytes": 2**20}, {"budget": 5}]
    assert [budget_label(r) for r in rows] == ["4 KiB", "1 MiB", 5]
    assert budgets(rows + [{"budget": 3, "budget_fraction": 0.125}]) == [5, "4 KiB", "1 MiB", "12.5%"]


def _real_bytes(cache: BudgetCache) -> int:
    return sum(getattr(layer, f).numel() * getattr(layer, f).element_size() for layer in cache.layers
               for f in SLOT_FIELDS)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_pool", [False, True])
def test_tokens_are_the_most_that_fit(arch, dtype, head_pool):
    """The tokens of a size are the largest budget whose real (CPU) cache fits in it, and one more does not fit."""
    config = tiny_model(arch).config
    for spec in ("8KiB", "20KiB", "1MiB"):
        t = tokens_for_bytes(spec, config, dtype=dtype, head_pool=head_pool)
        fits = _real_bytes(BudgetCache(config, t, dtype=dtype, head_pool=head_pool))
        over = _real_bytes(BudgetCache(config, t + 1, dtype=dtype, head_pool=head_pool))
        assert fits <= byte_size(spec) < over
        assert cache_bytes(config, t, dtype=dtype, head_pool=head_pool) == fits


def test_an_entry_costs_its_keys_values_and_bookkeeping():
    """The stated formula (docs/api.md): per full-attention layer and KV head, an entry is K and V at the dtype plus
    its position (int64), carried attention and per-token signals (fp32) and owner head (int32); the per-head totals
    and the sliding layers' windows are fixed."""
    config = tiny_model("gemma3").config  # 2 sliding layers (window 8) and 1 full, 2 KV heads, head_dim 16
    entry = 2 * 16 * 2 + 8 + 4 + 4 * len(TOKEN_SIGNALS) + 4
    fixed = 3 * 2 * 4 * len(TOTALED) + 2 * 2 * 8 * entry
    for t in (1, 7, 100):
        assert cache_bytes(config, t, dtype=torch.bfloat16) == fixed + t * 2 * entry
    bookkeeping = entry - 2 * 16 * 2
    assert f"{bookkeeping} B of bookkeeping" in (ROOT / "docs" / "api.md").read_text()


def test_too_small_and_unbudgeted_models_say_what_works():
    config = tiny_model("llama").config
    smallest = cache_bytes(config, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"below one entry per layer and KV head for this model in float32: the "
                                         rf"smallest byte budget that works is {smallest} B"):
        tokens_for_bytes(f"{smallest - 1}B", config, dtype=torch.float32)
    assert tokens_for_bytes(f"{smallest}B", config, dtype=torch.float32) == 1
    sliding = MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=16, vocab_size=96)
    with pytest.raises(ValueError, match="no full-attention layer"):
        tokens_for_bytes("1MiB", sliding, dtype=torch.float32)


@pytest.mark.newest
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_covering_byte_budget_is_the_unmodified_model(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    ref, _ = greedy(model, ids, 4)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget="1MiB", backend=None)
    assert m.forward.budget_bytes == 2**20 and m.forward.budget > 28
    got, _ = greedy(m, ids, 4)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_byte_budget_runs_the_kernel_of_its_tokens():
    """Evicting: the same outputs, bit for bit, as the token budget the size buys."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    tokens = tokens_for_bytes("6KiB", model.config, dtype=torch.float32)
    assert 1 < tokens < 40
    by_bytes = fxbudget.compile(fresh(model), rule="h2o", budget="6KiB", backend=None)
    assert by_bytes.forward.budget == tokens
    a, _ = greedy(by_bytes, ids, 3)
    b, _ = greedy(fxbudget.compile(fresh(model), rule="h2o", budget=tokens, backend=None), ids, 3)
    assert torch.equal(a, b)


@pytest.mark.parametrize("budget, match", [("1 mib", "an int >= 1 .* or a size in bytes such as '256MiB'"),
                                           ("12XB", "a number and a unit"),
                                           ("10B", "smallest byte budget that works is")])
def test_compile_refuses_bad_byte_budgets_in_one_line(budget, match):
    with pytest.raises(ValueError, match=match):
        fxbudget.compile(tiny_model("llama"), rule="snapkv", budget=budget, backend=None)


def test_grid_keeps_one_kind_of_budget():
    with pytest.raises(ValueError, match="mix tokens and bytes"):
        Grid(rules=["full", "snapkv"], budgets=[128, "1MiB"]).validate()
    Grid(rules=["full", "snapkv"], budgets=["1MiB", "2MiB"]).validate()


SMALL = ["--tasks", "passkey", "--lengths", "300", "--samples", "1", "--max-new-tokens", "2", "--quiet",
         "--rules", "full,snapkv,streamingllm"]


def test_compare_runs_byte_budgets_end_to_end(tiny_dir, tmp_path):
    from fxbudget.cli import main
    from fxbudget.models import load_model

    out = tmp_path / "run"
    assert main(["compare", "--model", tiny_dir, *SMALL, "--budgets", "4KiB,8KiB", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    model = load_model(tiny_dir)[0]
    want = {b: tokens_for_bytes(b, model.config, dtype=torch.float32) for b in ("4KiB", "8KiB")}
    budgeted = [r for r in rows if r["rule"] != "full"]
    assert len(budgeted) == 4
    assert sorted({(r["budget_bytes"], r["budget"]) for r in budgeted}) == sorted(
        (byte_size(b), t) for b, t in want.items())
    assert all(r["budget"] < r["context_tokens"] for r in budgeted)  # they evict
    report = (out / "report.md").read_text()
    assert "| 4 KiB |" in report or "4 KiB" in report.split("## ")[2], report[:2000]


def test_compare_refuses_a_byte_budget_below_one_entry_before_the_model(tiny_dir, tmp_path, capsys, no_model_load):
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, *SMALL, "--budgets", "100B", "--out",
                               str(tmp_path / "r")],
                      r"--budgets: \S+: budget 100B is below one entry per layer and KV head for this model in "
                      r"float32: the smallest byte budget that works is \d+ B")
