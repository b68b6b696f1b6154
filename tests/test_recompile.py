"""No recompile wall (issue 20 item 4): every call length is bucketed, so any sequence of prompt lengths serves with
a bounded number of graphs (`fxbudget.compiler.buckets.MAX_GRAPHS_PER_REGION`), and the bucketed runs equal the eager path."""

import torch

import fxbudget
from conftest import fresh, matmul_nodes, tiny_model

NEW = 3  # greedy tokens per prompt


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (1, n), generator=g) for n in lengths]


def _generate(m, ids):
    with torch.no_grad():
        return m.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)


def test_short_prompts_do_not_hit_the_recompile_limit():
    # Today's main: calls shorter than the observation window keep their length, one graph each, and the 8th
    # distinct length dies with FailOnRecompileLimitHit (7 of these 17 served).
    model = tiny_model("qwen3")
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=64, backend="aot_eager")
    for ids in _prompts(range(3, 37, 2)):
        out = _generate(m, ids)
        assert out.sequences.shape[1] == ids.shape[1] + NEW


# 30 distinct prompt lengths from 1 to 300: every short length below the observation window, and longer ones.
LENGTHS = (1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 40, 47, 64, 65, 90, 127, 150, 200,
           257, 300)


def test_thirty_lengths_serve_with_bounded_graphs_and_equal_eager():
    from fxbudget.compiler.buckets import bucket_length, bucket_set

    assert len(set(LENGTHS)) == 30
    model = tiny_model("qwen3")
    kw = dict(rule="snapkv", budget=24, block=8)  # a budget below most prompts: the prefill evicts
    m = fxbudget.compile(fresh(model), backend="aot_eager", **kw)
    ref = fxbudget.compile(fresh(model), backend=None, **kw)
    for ids in _prompts(LENGTHS):
        got, want = _generate(m, ids), _generate(ref, ids)
        assert torch.equal(got.sequences, want.sequences), ids.shape[1]
        assert (torch.stack(got.logits) - torch.stack(want.logits)).abs().max().item() <= 1e-4, ids.shape[1]
    # Both layers share one region: one graph per bucket used, plus the decode step (a 1-token prompt runs there too).
    shapes = sorted({next(n for n in gm.graph.nodes if n.op == "placeholder").meta["example_value"].shape[1]
                     for gm in m.forward.graphs})
    assert shapes == sorted({1} | {bucket_length(n) for n in LENGTHS if n > 1}) == [1, 16, 32, 48, 64, 80, 96, 128,
                                                                                   160, 224, 320]
    assert len(m.forward.graphs) == len(shapes) <= len(bucket_set(max(LENGTHS))) + 1
    # The stated bound: 48 buckets from 2 to 128K tokens, plus the decode step.
    assert len(bucket_set(2**17)) + 1 == 49


def test_short_call_on_a_filled_cache_scores_as_eager():
    # A call shorter than the observation window, padded to its bucket, on a cache that already holds tokens: the
    # rule's window (snapkv protects it) counts real tokens only, so the kept slots equal the unpadded eager run's.
    model = tiny_model("llama")
    kw = dict(rule="snapkv", budget=12, block=4, window=8)
    runs = {}
    for backend in (None, "aot_eager"):
        m = fxbudget.compile(fresh(model), backend=backend, **kw)
        cache = m.forward.new_cache()
        with torch.no_grad():
            for ids in _prompts((20, 5, 3), seed=3):  # the 5- and 3-token calls run at bucket 16 compiled
                out = m(input_ids=ids, past_key_values=cache)
        runs[backend] = out.logits, [cache.positions(i) for i in range(len(cache.layers))]
    (ref_logits, ref_pos), (logits, pos) = runs[None], runs["aot_eager"]
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    for a, b in zip(pos, ref_pos):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)


def test_chunked_generate_on_two_prompts_compiles_two_graphs():
    """Issue 30's case, shrunk: `chunk_size` and `generate` on two prompts whose last chunks are shorter than
    `chunk_size` (70 = 32 + 32 + 6, 55 = 32 + 23): every chunk runs at `chunk_size` and every decode step at one
    token, so the whole session compiles two graphs (benchmarks/studies/chunked_compile.py times the full-size case)."""
    model = tiny_model("qwen2")
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=32, chunk_size=32, backend="aot_eager")
    ref = fxbudget.compile(fresh(model), rule="snapkv", budget=32, chunk_size=32, backend=None)
    for ids in _prompts((70, 55)):
        got, want = _generate(m, ids), _generate(ref, ids)
        assert torch.equal(got.sequences, want.sequences), ids.shape[1]
    lengths = sorted(next(n for n in gm.graph.nodes if n.op == "placeholder").meta["example_value"].shape[1]
                     for gm in m.forward.graphs)
    assert lengths == [1, 32]


def test_long_prefill_on_an_empty_cache_skips_the_slots_and_equals_eager():
    """A one-call prefill longer than the slots on a fresh cache runs a graph without the slots' matmuls (they would
    add exact zeros: issue 30's compiled prefill); the same length on a filled cache, and after `restore()`ing the
    filled state, runs the graph with them. Every call equals the eager kernel; the cache's Python-side `empty`
    follows reset, calls and snapshots."""
    model = tiny_model("qwen2")
    kw = dict(rule="snapkv", budget=8, block=4)
    m = fxbudget.compile(fresh(model), backend="aot_eager", **kw)
    ref = fxbudget.compile(fresh(model), backend=None, **kw)
    runs = {}
    for x in (m, ref):
        cache = x.forward.new_cache()
        assert cache.empty
        empty_snap = cache.snapshot()
        logits = []
        with torch.no_grad():
            for ids in _prompts((40, 40), seed=5):  # both at bucket 40, above the 8 slots
                logits.append(x(input_ids=ids, past_key_values=cache).logits)
                assert not cache.empty
            filled = cache.snapshot()
            cache.restore(empty_snap)
            assert cache.empty
            cache.restore(filled)
            assert not cache.empty
            logits.append(x(input_ids=_prompts((40,), seed=6)[0], past_key_values=cache).logits)
        cache.reset()
        assert cache.empty
        runs[id(x)] = logits, filled
    (got, got_snap), (want, want_snap) = runs[id(m)], runs[id(ref)]
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-4
    for a, b in zip(got_snap["layers"], want_snap["layers"]):
        assert torch.equal(a["pos"].sort(-1).values, b["pos"].sort(-1).values)
    # Two graphs of the same shape: the fresh cache's without the slot matmuls, then the filled cache's.
    (first, second) = m.forward.graphs
    assert matmul_nodes(first) < matmul_nodes(second), (matmul_nodes(first), matmul_nodes(second))
