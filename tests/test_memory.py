"""Bounded memory: cache tensors never change, and with chunk_size no graph value grows with the sequence."""

import pytest
import torch

import fxbudget
from conftest import fresh, greedy, tiny_model


def _cache_tensors(cache):
    return [t for layer in cache.layers for t in (layer.keys, layer.values, layer.pos, layer.state, layer.totals)]


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_cache_tensors_never_change(backend):
    model = tiny_model("gemma3")
    m = fxbudget.compile(fresh(model), rule="h2o", budget=6, backend=backend, chunk_size=5)
    cache = m.forward.new_cache()
    before = [(t.data_ptr(), t.shape, t.dtype) for t in _cache_tensors(cache)]
    with torch.no_grad():
        greedy(m, torch.randint(0, 96, (1, 23)), 4, cache=cache)
    assert [(t.data_ptr(), t.shape, t.dtype) for t in _cache_tensors(cache)] == before
    assert cache.tokens_seen == 27


def _largest_value(graphs) -> int:
    """Elements of the largest tensor computed in the rewritten graphs (inputs and weights excluded)."""
    sizes = [0]
    for gm in graphs:
        for node in gm.graph.nodes:
            val = node.meta.get("val", node.meta.get("example_value"))
            if node.op == "call_function" and isinstance(val, torch.Tensor):
                sizes.append(val.numel())
    return max(sizes)


def test_chunked_prefill_memory_does_not_grow():
    model = tiny_model("llama")
    budget, chunk = 16, 8

    def run(length, chunk_size):
        m = fxbudget.compile(fresh(model), rule="snapkv", budget=budget, backend="eager", chunk_size=chunk_size)
        with torch.no_grad():
            m(input_ids=torch.randint(0, 96, (1, length)))
        return m.forward.graphs

    short, long = run(32, chunk), run(256, chunk)
    # One graph per chunk shape, the same at both lengths: nothing depends on the total length.
    assert [g.code for g in short] == [g.code for g in long]
    heads, vocab = model.config.num_attention_heads, model.config.vocab_size
    bound = max(heads * chunk * (budget + chunk), chunk * vocab)  # attention probabilities, or the chunk's logits
    assert _largest_value(long) <= bound
    # Without chunks the attention of a 256-token prefill is quadratic: the measure would see it.
    assert _largest_value(run(256, None)) >= heads * 256 * 256
