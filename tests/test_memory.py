"""Bounded memory: cache tensors never change, and with chunk_size no graph value grows with the sequence."""

import math
import re

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
    """Elements of the largest tensor computed in the rewritten graphs and every graph nested in them (the scan
    body over query blocks included); inputs and weights excluded."""
    sizes = [0]
    for gm in graphs:
        for sub in gm.modules():
            if not isinstance(sub, torch.fx.GraphModule):
                continue
            for node in sub.graph.nodes:
                val = node.meta.get("val", node.meta.get("example_value"))
                if node.op == "call_function" and isinstance(val, torch.Tensor):
                    sizes.append(val.numel())
    return max(sizes)


def _scan_bodies(graphs) -> list[torch.fx.GraphModule]:
    """The body graphs of the scans over query blocks in `graphs`."""
    return [getattr(gm, n.args[0].target) for gm in graphs for n in gm.graph.nodes
            if n.target is torch.ops.higher_order.scan]


def test_chunked_prefill_memory_does_not_grow():
    model = tiny_model("llama")
    budget, chunk = 16, 8

    def run(length, chunk_size, block=None):
        m = fxbudget.compile(fresh(model), rule="snapkv", budget=budget, backend="eager", chunk_size=chunk_size,
                             block=block)
        with torch.no_grad():
            m(input_ids=torch.randint(0, 96, (1, length)))
        return m.forward.graphs

    short, long = run(32, chunk), run(256, chunk)
    # One graph per chunk shape, the same at both lengths: nothing depends on the total length.
    assert [g.code for g in short] == [g.code for g in long]
    heads, vocab = model.config.num_attention_heads, model.config.vocab_size
    # Attention probabilities or the chunk's logits: `wov_norm` reads W_o as its per-head R factors (q_heads x
    # head_dim^2, laid out once), so no W_o-sized copy and no [chunk, heads, hidden] product is allowed any more.
    bound = max(heads * chunk * (budget + chunk), chunk * vocab)
    assert _largest_value(long) <= bound
    # Without chunks, a 256-token prefill is one call whose measure phase loops over query blocks (a scan, whose body
    # is traced once): nothing in the graph is [queries x candidates] of the whole call (tests/test_blocks.py bounds
    # the block's own temporaries).
    one_call = run(256, None, block=32)  # the automatic block would cover 256 queries at once
    bodies = _scan_bodies(one_call)
    assert bodies
    # The largest temporary of a scan step is a block's logits over what the step's two folded query blocks see
    # between them (`kernel.key_scan.fold_scan`: nb + 1 key tiles of one block, so n + block new tokens) plus the
    # slots, `heads x 32 x (16 + 256 + 32)`: nothing anywhere (the scan body included) is [queries x candidates] of
    # the whole call.
    block_bound = heads * 32 * (budget + 256 + 32)
    assert heads * 32 * 256 <= _largest_value(bodies) <= block_bound  # the body is measured, and bounded
    assert _largest_value(one_call) <= max(block_bound, 256 * vocab)


class _AttentionLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.o = torch.nn.Linear(16, 16)

    def forward(self, q, k, v, past_key_values):
        keys, values = past_key_values.update(k, v, 0)
        y = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(1, -1, 16))


@pytest.mark.inductor
def test_compiled_decode_does_not_rewrite_the_cache():
    # 41 slots x head dim 8 = 328 elements per K/V buffer. With Inductor's locality reordering (the bug this guards
    # against; `reorder_for_locality=True` reproduces it) the write-back could not be done in place: the compiled
    # step allocated a (1, 1, 41, 8) temporary and copied a whole K/V buffer through it every step.
    from types import SimpleNamespace

    from torch._inductor.utils import run_and_get_code

    from fxbudget.compiler.backend import make_backend

    cfg = SimpleNamespace(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, hidden_size=16)
    cache = fxbudget.BudgetCache(cfg, 41)
    cache.layers[0].pos.copy_(torch.arange(41))
    cache.layers[0].seen.fill_(41)
    keys_before = cache.layers[0].keys.clone()
    layer = torch.compile(_AttentionLayer(), backend=make_backend("knorm"), fullgraph=True, dynamic=False)
    with torch.no_grad():
        _, code = run_and_get_code(layer, torch.randn(1, 2, 1, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8),
                                   cache)
    source = "\n".join(code)
    assert "index_put" in source
    # Every buffer the compiled step allocates, from the wrapper's empty_strided_<device>((sizes), (strides), dtype).
    shapes = [tuple(int(x) for x in m.split(",") if x.strip())
              for m in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", source)]
    assert shapes, "no buffer allocations found in the generated code"
    assert max(math.prod(shape) for shape in shapes) < 41 * 8, "the decode step allocates a whole K/V buffer"
    # And it did evict: one slot now holds position 41 (or the new token was the one dropped).
    changed = (cache.layers[0].keys != keys_before).any(-1).sum().item()
    assert changed <= 1 and (changed == 1) == (41 in cache.positions(0).tolist()[0][0])


def test_kv_bytes_held_and_allocated():
    model = tiny_model("llama")  # 2 layers, 2 KV heads, head dim 16, fp32
    m = fxbudget.compile(fresh(model), rule="h2o", budget=16, backend=None, headroom=4)
    with torch.no_grad():
        cache = m(input_ids=torch.randint(0, 96, (1, 10))).past_key_values
    per_token = 2 * 2 * 16 * 4 * 2  # layers x KV heads x head dim x bytes x (key, value)
    assert cache.kv_bytes() == 20 * per_token  # every slot: budget + head-room, empty ones included
    assert cache.held_kv_bytes() == 10 * per_token
