"""Shared prefill + branching gives exactly the caches and outputs of separate runs, for every rule (and for a
head-adaptive rule on the head-pooled cache)."""

import pytest
import torch

import fxbudget
from fxbudget.harness.branch import branch, shared_prefill
from fxbudget.rules import plain_generation_rules

from conftest import greedy, tiny_model

# kvzip evicts only in its replay protocol (tests/test_kvzip.py)
RULES = plain_generation_rules()
# `owner`: the KV head each slot's entry belongs to (it moves between heads in the head-pooled layout).
from fxbudget.cache import LAYER_STATE as SLOT_TENSORS  # noqa: E402  (every state tensor, declared once)


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def prefilled(request):
    """(model, ids, shared prefills by their observation window: None = the default window's)."""
    model = tiny_model(request.param, layers=3)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 40))
    return model, ids, {None: shared_prefill(model, ids)}


def _separate_equals_branched(m, ids, sp):
    """A prefill of `ids` through compiled `m` and a branch of `sp` into a fresh cache: every slot tensor, the
    last logits and 5 greedy steps on from each (eviction on) identical. Returns both caches after decoding."""
    separate = m.forward.new_cache(2)
    out = m(input_ids=ids, past_key_values=separate, logits_to_keep=1)
    branched = m.forward.new_cache(2)
    branch(sp, branched, m.forward.rule)
    for i, (a, b) in enumerate(zip(separate.layers, branched.layers)):
        for name in SLOT_TENSORS:
            assert torch.equal(getattr(a, name), getattr(b, name)), (i, name)
    assert torch.equal(out.logits[:, -1], sp.logits)
    tok = sp.logits.argmax(-1, keepdim=True)
    assert torch.equal(greedy(m, tok, 5, separate)[0], greedy(m, tok, 5, branched)[0])
    return separate, branched


# (rule, its params, the shared prefill's window: None = the default)
CASES = [(r, {"window": 4} if r == "pyramidkv" else {}, None) for r in RULES] + [
    ("snapkv", {"window": 8}, None),  # another window than the prefill's: the kernel-replay path
    ("adakv:snapkv", {"window": 4}, 4),  # head-adaptive: the head-pooled cache, the prefill's own window
]


@pytest.mark.parametrize("rule, params, prefill_window", CASES,
                         ids=[r + "".join(f"-{k}{v}" for k, v in p.items()) + ("" if w is None else f"-prefill{w}")
                              for r, p, w in CASES])
def test_branch_equals_separate_run(prefilled, rule, params, prefill_window):
    model, ids, prefills = prefilled
    if prefill_window not in prefills:
        prefills[prefill_window] = shared_prefill(model, ids, window=prefill_window)
    sp = prefills[prefill_window]
    with torch.no_grad():
        m = fxbudget.compile(model, rule=rule, budget=12, backend=None, headroom=4, **params)
        try:
            separate, _ = _separate_equals_branched(m, ids, sp)
            # It did evict: after decoding with eviction on, every budgeted layer holds exactly its budget, in every
            # row and head (pooled: the heads' budgets together, spread unevenly somewhere), of more tokens than that.
            spread = []
            for i, layer in enumerate(separate.layers):
                if not layer.sliding:
                    held = separate.head_counts(i)
                    if layer.pooled:
                        per_row = held.sum(-1)
                        assert torch.equal(per_row, torch.full_like(per_row, layer.num_heads * layer.budget)), i
                        spread.append(len(set(held.flatten().tolist())) > 1)
                    else:
                        assert torch.equal(held, torch.full_like(held, layer.budget)), i
                    assert layer.budget < separate.tokens_seen
            assert separate.head_pool == m.forward.rule.head_adaptive == bool(spread)
            assert not spread or any(spread)  # the head-adaptive rule did give the heads different shares
        finally:
            model.forward.restore()


# Quantized slots: the per-token signals, the sliding layers and the slots the rule reads are of the stored values;
# a norm rule, the kernel-replay path (another window) and the head-pooled layout each read them differently.
SLOT_CASES = [("knorm", {}), ("snapkv", {"window": 8}), ("adakv:snapkv", {"window": 4})]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
@pytest.mark.parametrize("storage", ["float8_e4m3fn", "int8", "int4", "bfloat16"])
@pytest.mark.parametrize("rule, params", SLOT_CASES, ids=[r for r, _ in SLOT_CASES])
def test_branch_into_quantized_slots_equals_separate_run(arch, storage, rule, params):
    model = tiny_model(arch, layers=3)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    sp = shared_prefill(model, ids, slot_dtype=storage)
    plain = shared_prefill(model, ids)  # of the model dtype's values: refused below
    with torch.no_grad():
        m = fxbudget.compile(model, rule=rule, budget=12, backend=None, headroom=4, slot_dtype=storage, **params)
        try:
            separate, _ = _separate_equals_branched(m, ids, sp)
            assert separate.layers[0].keys.dtype != torch.float32  # it did store codes (or bf16)
            with pytest.raises(ValueError, match="recorded for them"):  # a prefill of the model dtype's values
                branch(plain, m.forward.new_cache(2), m.forward.rule)
        finally:
            model.forward.restore()


def test_branch_refuses_used_or_foreign_cache(prefilled):
    model, ids, prefills = prefilled
    sp = prefills[None]
    m = fxbudget.compile(model, rule="h2o", budget=12, backend=None)
    try:
        cache = m.forward.new_cache(2)
        branch(sp, cache, "h2o")
        with pytest.raises(ValueError, match="empty cache"):
            branch(sp, cache, "h2o")
        with pytest.raises(ValueError, match="batch size"):
            branch(sp, m.forward.new_cache(1), "h2o")
    finally:
        model.forward.restore()


@pytest.mark.parametrize("rule", ["snapkv", "h2o", "expected_attention"])
def test_branch_equals_separate_run_in_query_blocks(rule):
    """With a one-call prefill computed in several query blocks (40 tokens, block 16), the branch stays bit-identical."""
    model = tiny_model("gemma3", layers=3)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    sp = shared_prefill(model, ids, block=16)
    with torch.no_grad():
        m = fxbudget.compile(model, rule=rule, budget=12, backend=None, block=16)
        try:
            _separate_equals_branched(m, ids, sp)
        finally:
            model.forward.restore()
