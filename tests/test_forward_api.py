"""The installed forward's lifecycle and what `inspect` prints (issue 21), and its CUDA-graph readiness (issue 20
item 6: what a CPU can check)."""

import pytest
import torch

import fxbudget
from conftest import fresh, tiny_model
from fxbudget.compiler.forward import BudgetForward


def test_restore_twice_is_a_clear_error():
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 6))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    m = fxbudget.compile(model, budget=8, backend=None)
    fwd = m.forward
    assert fwd.restore() is model and "forward" not in vars(model)
    # Today's main: AttributeError: 'function' object has no attribute 'restore'.
    with pytest.raises(RuntimeError, match="restore\\(\\) was already called"):
        model.forward.restore()
    assert fwd.restore() is model  # the forward object's own restore: a no-op once restored
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)  # the unmodified model
    fxbudget.compile(model, budget=8, backend=None)  # compiled again, restored again
    assert isinstance(model.forward, BudgetForward)
    model.forward.restore()
    assert "forward" not in vars(model)


@pytest.mark.parametrize("rule", ["snapkv", "h2o"])
def test_inspect_prints_the_fingerprint_compare_records(rule):
    from fxbudget.fairness.graph_summary import summary

    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0))  # as `fxbudget inspect` traces
    text = summary(model, ids, rule=rule, budget=64)
    # What the compare runner records for every row (harness/runner.py: 8 zeros, its largest absolute budget).
    recorded = fxbudget.kernel_fingerprint(model, torch.zeros(1, 8, dtype=torch.long), rule=rule, budget=1024)
    assert f"# kernel fingerprint (rule ops masked): {recorded}" in text
    assert recorded == fxbudget.kernel_fingerprint(model, rule=rule, budget=64)  # the default probe: one definition
    assert "what every compare row records" in text


def test_printed_kernel_marks_the_rule_region():
    from fxbudget.fairness.graph_summary import RULE_BEGIN, RULE_END, summary

    model = tiny_model("qwen2")
    text = summary(model, torch.randint(0, 96, (1, 16)), rule="snapkv", budget=8)
    lines = text.splitlines()
    begin = [i for i, line in enumerate(lines) if line.strip() == RULE_BEGIN]
    end = [i for i, line in enumerate(lines) if line.strip() == RULE_END]
    assert len(begin) == len(end) == 1 and begin[0] < end[0]
    inside, outside = "\n".join(lines[begin[0]:end[0]]), "\n".join(lines[:begin[0]] + lines[end[0]:])
    assert "max_pool" in inside and "max_pool" not in outside  # snapkv's pooling is the rule's
    assert "topk" in outside and "topk" not in inside  # selection is the shared kernel's


def test_cudagraphs_needs_inductor():
    with pytest.raises(ValueError, match="cudagraphs=True needs backend='inductor'"):
        fxbudget.compile(fresh(tiny_model("llama")), budget=8, backend="aot_eager", cudagraphs=True)


def _generate_cache(m, seed):
    ids = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    return out.past_key_values, out.sequences


def test_cudagraphs_cache_is_static_and_kept():
    # What CUDA graphs need, checked on CPU: the cache's tensors marked static before the first compiled call, the
    # same tensors (addresses) for every generate() call, and no graph more than without CUDA graphs (the marks are
    # unguarded: the layers still share one region graph).
    from fxbudget.rules import get

    model = tiny_model("qwen3")
    counts, results = {}, {}
    for cudagraphs in (False, True):
        fwd = BudgetForward(fresh(model), get("snapkv"), 8, chunk_size=None, backend="aot_eager", headroom=0,
                            cudagraphs=cudagraphs)  # bypasses compile()'s inductor-only check: aot_eager on CPU
        m = fwd.install()
        first, seq1 = _generate_cache(m, 0)
        ptrs = [t.data_ptr() for layer in first.layers for t in layer.tensors()]
        second, seq2 = _generate_cache(m, 1)
        counts[cudagraphs], results[cudagraphs] = len(fwd.graphs), (seq1, seq2)
        if cudagraphs:
            assert second is first  # reset and reused: a new sequence, the same addresses
            assert [t.data_ptr() for layer in second.layers for t in layer.tensors()] == ptrs
            assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded"
                       for layer in second.layers for t in layer.tensors())
        else:
            assert second is not first
            assert not any(hasattr(t, "_dynamo_static_input_type") for layer in first.layers for t in layer.tensors())
    assert counts[True] == counts[False]
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))  # reset: the same answers
