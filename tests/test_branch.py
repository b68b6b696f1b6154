"""Shared prefill + branching gives exactly the caches and outputs of separate runs, for every rule."""

import pytest
import torch

import fxbudget
from fxbudget.harness.branch import branch, shared_prefill
from fxbudget.rules import available

from conftest import greedy, tiny_model

RULES = [r for r in available() if r != "full"]
SLOT_TENSORS = ("keys", "values", "pos", "state", "norms", "totals", "seen")


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def prefilled(request):
    model = tiny_model(request.param, layers=3)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 40))
    return model, ids, shared_prefill(model, ids)


@pytest.mark.parametrize("rule, params", [(r, {"window": 4} if r == "pyramidkv" else {}) for r in RULES]
                         + [("snapkv", {"window": 8})])  # another window: the kernel-replay path
def test_branch_equals_separate_run(prefilled, rule, params):
    model, ids, sp = prefilled
    with torch.no_grad():
        m = fxbudget.compile(model, rule=rule, budget=12, backend=None, headroom=4, **params)
        try:
            separate = m.forward.new_cache(2)
            out = m(input_ids=ids, past_key_values=separate, logits_to_keep=1)
            branched = m.forward.new_cache(2)
            branch(sp, branched, m.forward.rule)
            for i, (a, b) in enumerate(zip(separate.layers, branched.layers)):
                for name in SLOT_TENSORS:
                    assert torch.equal(getattr(a, name), getattr(b, name)), (i, name)
            assert torch.equal(out.logits[:, -1], sp.logits)
            # Decoding on from both caches (eviction on) stays identical.
            tok = sp.logits.argmax(-1, keepdim=True)
            la, _ = greedy(m, tok, 5, separate)
            lb, _ = greedy(m, tok, 5, branched)
            assert torch.equal(la, lb)
            # It did evict: after decoding with eviction on, every budgeted layer holds exactly its budget, in every
            # row and head, of more tokens than that.
            for layer in separate.layers:
                if not layer.sliding:
                    held = (layer.pos >= 0).sum(-1)
                    assert torch.equal(held, torch.full_like(held, layer.budget))
                    assert layer.budget < separate.tokens_seen
        finally:
            model.forward.restore()


def test_branch_refuses_used_or_foreign_cache(prefilled):
    model, ids, sp = prefilled
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
            separate = m.forward.new_cache(2)
            out = m(input_ids=ids, past_key_values=separate, logits_to_keep=1)
            branched = m.forward.new_cache(2)
            branch(sp, branched, m.forward.rule)
            for i, (a, b) in enumerate(zip(separate.layers, branched.layers)):
                for name in SLOT_TENSORS:
                    assert torch.equal(getattr(a, name), getattr(b, name)), (i, name)
            assert torch.equal(out.logits[:, -1], sp.logits)
        finally:
            model.forward.restore()
