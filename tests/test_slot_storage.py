"""Quantized slots (issue 58, `kernel.slot_storage`): fp8, int8 and int4 keys and values with a float32 scale per
entry and head. The oracle is the unmodified model whose cached keys and values are quantized and dequantized the
same way (a call's own tokens attended in the model's dtype); the bounds are against float64."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import fxbudget
from conftest import fresh, greedy, tiny_model
from fxbudget.cache import BudgetCache
from fxbudget.cache.byte_budget import tokens_for_bytes
from fxbudget.checks import SLOT_DTYPES
from fxbudget.kernel.slot_storage import SCALE_BYTES, decode, round_trip

QUANTIZED = [s for s in SLOT_DTYPES if s != "model"]


class QuantizedOracle(DynamicCache):
    """transformers' own cache, storing `round_trip(k)` and `round_trip(v)`: each call attends the stored past and its
    own tokens as computed (the semantics of fxbudget's quantized slots at a covering budget)."""

    def __init__(self, slot_dtype: str, **kwargs):
        super().__init__(**kwargs)
        self.slot_dtype = slot_dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        n = key_states.shape[2]
        k, v = super().update(round_trip(key_states, self.slot_dtype), round_trip(value_states, self.slot_dtype),
                              layer_idx, *args, **kwargs)
        return torch.cat([k[:, :, :-n], key_states], dim=2), torch.cat([v[:, :, :-n], value_states], dim=2)


@pytest.mark.parametrize("slot_dtype, bound", [("int8", 0.5 / 127), ("int4", 0.5 / 7), ("float8_e4m3fn", 2 ** -4)])
def test_round_trip_error_against_float64(slot_dtype, bound):
    """Per entry and head: int codes round to the nearest step (half a step of absmax / qmax at most); e4m3 keeps 3
    mantissa bits (relative rounding error 2^-4 at most). The measured worst case is in docs/api.md's numbers."""
    x = torch.randn(4, 2, 64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    err = (round_trip(x.float(), slot_dtype).double() - x).abs().amax(-1) / x.abs().amax(-1)
    assert float(err.max()) <= bound * (1 + 1e-6)
    assert float(err.max()) > bound / 8  # quantized, not a copy
    zero = torch.zeros(1, 32)
    assert torch.equal(round_trip(zero, slot_dtype), zero)


def _one_kv_head():
    """A Llama with a single KV head (multi-query attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import COMMON

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **{**COMMON, "num_key_value_heads": 1})).eval()


@pytest.mark.newest
@pytest.mark.parametrize("slot_dtype", QUANTIZED)
@pytest.mark.parametrize("arch", ["llama", "gemma3", "one-kv-head"])  # gemma3: sliding layers' windows too
def test_a_covering_budget_is_the_quantized_oracle(slot_dtype, arch):
    model = _one_kv_head() if arch == "one-kv-head" else tiny_model(arch)
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    ref, _ = greedy(model, ids, 5, cache=QuantizedOracle(slot_dtype, config=model.config))
    plain, _ = greedy(model, ids, 5)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=64, backend=None, slot_dtype=slot_dtype)
    got, cache = greedy(m, ids, 5)
    assert cache.slot_dtype == slot_dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert float((got - plain).abs().max()) > 1e-4  # the oracle is not the unquantized model


@pytest.mark.parametrize("slot_dtype", ["int8", "int4"])
def test_in_bf16_as_close_to_the_fp32_oracle_as_the_bf16_oracle(slot_dtype):
    """bf16 end to end (gemma3: sliding and full layers): the budgeted bf16 model with quantized slots is no further
    from the fp32 quantized oracle than that oracle in bf16 is (<= 1.1x, RMS over a prefill's and 5 decode steps'
    logits), as tests/test_exactness.py holds the model dtype's."""
    model = tiny_model("gemma3")
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(7))
    ref, _ = greedy(model, ids, 5, cache=QuantizedOracle(slot_dtype, config=model.config))
    half = fresh(model).to(torch.bfloat16)
    plain, _ = greedy(half, ids, 5, cache=QuantizedOracle(slot_dtype, config=model.config))
    got, _ = greedy(fxbudget.compile(fresh(model).to(torch.bfloat16), rule="snapkv", budget=64, backend=None,
                                     slot_dtype=slot_dtype), ids, 5)
    rms = lambda x: ((x.double() - ref.double()) ** 2).mean().sqrt().item()  # noqa: E731
    assert rms(got) <= 1.1 * rms(plain), (rms(got), rms(plain))


@pytest.mark.parametrize("rule", ["h2o", "knorm", "tova", "expected_attention", "adakv:snapkv"])
def test_every_rule_and_layout_at_a_covering_budget(rule):
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    ref, _ = greedy(model, ids, 3, cache=QuantizedOracle("int8", config=model.config))
    got, _ = greedy(fxbudget.compile(fresh(model), rule=rule, budget=48, backend=None, slot_dtype="int8"), ids, 3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.newest
def test_left_padding_and_chunked_prefill_are_the_oracle():
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 18), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(max_new_tokens=4, do_sample=False, attention_mask=mask, pad_token_id=0)
    ref = model.generate(ids, past_key_values=QuantizedOracle("int4", config=model.config), **kw)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=40, backend=None, slot_dtype="int4", chunk_size=7)
    assert torch.equal(m.generate(ids, **kw), ref)


CASES = [(s, "aot_eager") for s in QUANTIZED] + [pytest.param("int4", "inductor", marks=pytest.mark.inductor)]


@pytest.mark.parametrize("slot_dtype, backend", CASES)
def test_evicting_compiled_graph_equals_the_eager_kernel(slot_dtype, backend):
    """Under a budget that evicts, the graph pass runs the same dequantize and quantize ops as eagerly: the same
    logits and kept positions, and (aot_eager, the same ops) the same stored bytes. Inductor (int4, whose unpacking
    and scale bytes are the most ops) may round x / s on the other side of a half: a code one step off, rarely."""
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    runs = []
    for b in (None, backend):
        m = fxbudget.compile(fresh(model), rule="h2o", budget=12, backend=b, slot_dtype=slot_dtype)
        logits, cache = greedy(m, ids, 3)
        layer = cache.layers[0]
        runs.append((logits, cache.positions(0).clone(), layer.keys.view(torch.uint8).clone(),
                     decode(layer.keys, layer.head_dim, torch.float64)))
    (l0, p0, k0, d0), (l1, p1, k1, d1) = runs
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert torch.equal(p0, p1)
    if backend == "aot_eager":
        assert torch.equal(k0, k1)
    else:
        step = d0.abs().amax(-1, keepdim=True) / 7
        assert bool(((d1 - d0).abs() <= step * (1 + 1e-3) + 1e-12).all())
        assert float((k0 != k1).float().mean()) < 0.02, float((k0 != k1).float().mean())


def test_the_stored_bytes_are_the_codes_and_a_scale():
    config = tiny_model("llama").config  # 2 layers, 2 KV heads, head_dim 16
    full = BudgetCache(config, 10)
    for slot_dtype, row in (("float8_e4m3fn", 16 + SCALE_BYTES), ("int8", 16 + SCALE_BYTES),
                            ("int4", 8 + SCALE_BYTES), ("bfloat16", 16 * 2)):
        cache = BudgetCache(config, 10, slot_dtype=slot_dtype)
        assert cache.kv_bytes() == 2 * 2 * 10 * 2 * row
        assert full.kv_bytes() == 2 * 2 * 10 * 2 * 16 * 4
    # a byte budget buys more entries in fewer bits
    tokens = {s: tokens_for_bytes("64KiB", config, dtype=torch.float32, slot_dtype=s) for s in SLOT_DTYPES}
    assert tokens["model"] < tokens["bfloat16"] < tokens["float8_e4m3fn"] == tokens["int8"] < tokens["int4"]


def test_bfloat16_slots_of_a_bfloat16_model_are_the_model_dtype():
    """A cast to the model's own dtype is no cast: the same logits and slots, bit for bit."""
    model = tiny_model("gemma3").to(torch.bfloat16)
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    outs = {}
    for storage in ("model", "bfloat16"):
        m = fxbudget.compile(fresh(model), rule="knorm", budget=12, backend=None, slot_dtype=storage)
        outs[storage] = greedy(m, ids, 4)
        m.forward.restore()
    assert torch.equal(outs["model"][0], outs["bfloat16"][0])
    for a, b in zip(outs["model"][1].layers, outs["bfloat16"][1].layers):
        assert torch.equal(a.keys, b.keys) and a.keys.dtype == torch.bfloat16


def test_held_bytes_follow_the_storage():
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(6))
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=16, backend=None, slot_dtype="int4")
    _, cache = greedy(m, ids, 1)
    assert cache.held_kv_bytes() == 2 * 2 * 16 * 2 * (8 + SCALE_BYTES)


def test_bad_slot_dtypes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="slot_dtype must be one of model, float8_e4m3fn, int8, int4"):
        fxbudget.compile(tiny_model("llama"), rule="snapkv", budget=8, slot_dtype="fp16", backend=None)
    odd = tiny_model("llama").config
    odd.head_dim = 15
    with pytest.raises(ValueError, match="head_dim 15 must be even"):
        BudgetCache(odd, 8, slot_dtype="int4")
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=8, backend=None, slot_dtype="int8")
    with pytest.raises(ValueError, match="cache slots store model, the compiled run's store int8"):
        m(input_ids=torch.ones(1, 4, dtype=torch.long), past_key_values=BudgetCache(model.config, 8))


SMALL = ["--tasks", "passkey", "--lengths", "300", "--samples", "1", "--max-new-tokens", "2", "--quiet",
         "--rules", "full,snapkv,streamingllm", "--budgets", "8KiB"]


@pytest.mark.usefixtures("shared_fingerprints")
def test_compare_spends_equal_bytes_in_each_storage(tiny_dir, tmp_path, capsys):
    """`compare --slot-dtype`: each storage its own folder, its own kernel fingerprint and entries per byte; the
    report of both folders puts them side by side; a folder of one storage refuses a command of another."""
    import json

    from fxbudget.cli import main
    from fxbudget.harness.report import load_rows, markdown
    from fxbudget.models import load_model

    config = load_model(tiny_dir)[0].config
    runs = {}
    for storage in ("model", "int4"):
        out = tmp_path / storage
        assert main(["compare", "--model", tiny_dir, *SMALL, "--slot-dtype", storage, "--out", str(out)]) == 0
        rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        budgeted = [r for r in rows if r["rule"] != "full"]
        assert {r["slot_dtype"] for r in rows} == {storage}
        assert {r["budget"] for r in budgeted} == {tokens_for_bytes("8KiB", config, dtype=torch.float32,
                                                                    slot_dtype=storage)}
        assert all(r["shared_prefill"] for r in budgeted)  # branched into either storage (tests/test_branch.py)
        runs[storage] = budgeted
    assert runs["int4"][0]["budget"] > 2 * runs["model"][0]["budget"]
    assert runs["int4"][0]["kernel_fingerprint"] != runs["model"][0]["kernel_fingerprint"]
    assert len({r["kernel_fingerprint"] for r in runs["int4"]}) == 1
    text = markdown(load_rows([tmp_path / "model", tmp_path / "int4"]), [], "accuracy")
    assert "one per slot storage" in text and "## protocol: query-agnostic, prefill chunk: one call, backend: none, " \
                                             "slots: int4" in text
    capsys.readouterr()
    assert main(["compare", "--model", tiny_dir, *SMALL, "--out", str(tmp_path / "int4")]) == 2
    assert "holds rows of another slot storage (--slot-dtype) (int4; this command: model)" in capsys.readouterr().err
