"""The traced causal triangle in one block body (issue 30, `fxbudget.kernel.key_scan.fold_scan`): exactly the visible key
tiles, the eager kernel's results and an independent float64 reference's, one scan whatever the call's length."""

import pytest
import torch

from fxbudget import rules
from fxbudget.kernel import SIGNAL_NAMES
from fxbudget.kernel.key_scan import fold_pairs, padded_blocks, tile_blocks

from conftest import matmul_nodes
from host_sync import graph_host_syncs
from test_blocks import _call, _count, run_measure, run_traced_measure, trace

WINDOW = 4


def test_fold_pairs_visit_exactly_the_triangle():
    """Each step pairs block j with block nb' - 1 - j (nb' = nb rounded up to a multiple of 2 c) over nb' / c + 1 key
    tiles of c blocks; over all steps every (query block i, key tile k <= i // c) pair of the padded triangle comes
    once, nothing else."""
    assert fold_pairs(4) == [(0, [(0, 0), (3, 0), (3, 1), (3, 2), (3, 3)]),
                             (1, [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)])]
    assert fold_pairs(1) == [(0, [(0, 0), (1, 0), (1, 1)])]  # one block: a pad block joins it
    assert fold_pairs(4, 2) == [(0, [(0, 0), (3, 0), (3, 1)]), (1, [(1, 0), (2, 0), (2, 1)])]
    for nb in range(1, 40):
        for c in (1, 2, 3, 4):
            nb2 = padded_blocks(nb, c)
            assert nb2 >= nb and nb2 % (2 * c) == 0 and nb2 - nb < 2 * c
            steps = fold_pairs(nb, c)
            assert len(steps) == nb2 // 2 and all(len(tiles) == nb2 // c + 1 for _, tiles in steps)
            pairs = [p for _, tiles in steps for p in tiles]
            assert sorted(pairs) == sorted((i, k) for i in range(nb2) for k in range(i // c + 1))
            assert all({i for i, _ in tiles} == {j, nb2 - 1 - j} for j, tiles in steps)
    # Tiles of `TILE_KEYS` (512) new tokens in whole blocks, at most nb / 16 blocks; pads stay under 1/8 of the call.
    assert [tile_blocks(R, nb) for R, nb in ((64, 32), (32, 128), (16, 512), (16, 1024), (16, 32), (4, 7),
                                             (2, 10_000))] == [2, 8, 32, 32, 2, 1, 256]
    for nb in range(1, 600, 7):
        for R in (2, 5, 16, 64):
            assert padded_blocks(nb, tile_blocks(R, nb)) - nb <= max(1, nb // 8)


def reference(inputs: dict, window: int, sliding: int) -> tuple[torch.Tensor, ...]:
    """Float64, one (batch row, query head) at a time over the concatenated candidates: the attention output
    `[b, q_heads, n, d]` and the three weighted sums `[b, h, S + n]` (every valid query, the last `window` ones,
    the last one), summed over the group's query heads."""
    f = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    q, ks, vs, ps, kn, vn, np_ = (f[k] for k in ("q", "k_slots", "v_slots", "pos_slots", "k_new", "v_new", "new_pos"))
    b, hq, n, d = q.shape
    h = ks.shape[1]
    g = hq // h
    out = torch.zeros(b, hq, n, vn.shape[-1], dtype=torch.float64)
    sums = torch.zeros(3, b, h, ps.shape[-1] + n, dtype=torch.float64)
    for r in range(b):
        qp = np_[r]
        valid = qp >= 0
        last = qp.max()
        w = min(window, n)
        qw = torch.stack([valid, valid & (qp > last - w), valid & (qp == last)]).double()  # [3, n]
        for i in range(h):
            K, V = torch.cat([ks[r, i], kn[r, i]]), torch.cat([vs[r, i], vn[r, i]])
            P = torch.cat([ps[r, i], qp])
            vis = (P >= 0)[None] & (P[None] <= qp[:, None])
            if sliding:
                vis &= P[None] > qp[:, None] - sliding
            for j in range(g):
                logits = (q[r, i * g + j] @ K.T / d ** 0.5).masked_fill(~vis, float("-inf"))
                p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row that sees nothing attends to nothing
                out[r, i * g + j] = p @ V
                sums[:, r, i] += qw @ p
    return out, *sums


def _inputs(n, h, g, held, left_pads, S=7, d=8, dtype=torch.float64, seed=0):
    inputs = _call(h=h, g=g, S=S, held=held, n=n, d=d, left_pads=left_pads, seed=seed)
    # The output projection's factors stay fp32 (fp64 for fp64 inputs), as `out_projection_factors` makes them.
    return {k: v.to(torch.promote_types(dtype, torch.float32) if k == "wo" else dtype) if v.is_floating_point() else v
            for k, v in inputs.items()}


CASES = [  # n, block, sliding, h (KV heads), g (group), held slots, left pads per row
    (69, 4, 0, 2, 3, 3, (0, 3)),    # GQA; 18 blocks (9 steps), the last block part pads
    (50, 3, 0, 1, 6, 0, (5, 0)),    # MQA (one KV head), an empty cache; 17 blocks: a pad block makes 18
    (37, 5, 0, 3, 1, 7, (0, 4)),    # MHA, a full cache; 8 blocks
    (40, 4, 40, 2, 3, 7, (6, 0)),   # a sliding window covering the call: folded, the window masks the oldest slots
    (61, 4, 6, 2, 3, 3, (0, 9)),    # a sliding layer narrower than the call: the band scan
    (9, 2, 0, 2, 2, 3, (0, 2)),     # the smallest block, 5 blocks
    (17, 16, 0, 2, 2, 3, (1, 0)),   # two blocks, the second one query and pads
    (83, 2, 0, 2, 2, 5, (0, 7)),    # 42 blocks in tiles of 2 (tile_blocks): 44 with pads, 23 tiles a step
    (101, 3, 0, 1, 4, 2, (3, 0)),   # MQA, 34 blocks in tiles of 2, 36 with pads
    (1100, 4, 0, 2, 3, 5, (0, 9)),  # 275 blocks in tiles of 17 (wide tiles, an odd count): 306 with pads
]


def _measure(inputs, traced, sliding, block):
    return run_measure(inputs, window=WINDOW, sliding=sliding, scale=None, block=block, traced=traced)


@pytest.mark.parametrize("n, block, sliding, h, g, held, left_pads", CASES)
def test_folded_scan_equals_eager_and_float64_reference(n, block, sliding, h, g, held, left_pads):
    """Float64: the traced measure phase (run as is, and as the traced graph `trace_kernel` builds) gives the eager
    kernel's output and every signal to 1e-12, and the reference's output and attention sums."""
    inputs = _inputs(n, h, g, held, left_pads)
    traced = _measure(inputs, True, sliding, block)
    eager = _measure(inputs, False, sliding, block)
    kt = trace(inputs, rules.get("h2o"), budget=7, keep=7, sliding=sliding, window=WINDOW, scale=None, block=block)
    graph = run_traced_measure(kt, inputs)
    for name, a, gr, e in zip(("out", "totals", *SIGNAL_NAMES), traced, graph, eager):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(gr, e, rtol=1e-12, atol=1e-12, msg=name)
    ref = reference(inputs, WINDOW, sliding)
    for name, a, r in zip(("out", "attn", "window_attn", "last_attn"), (traced[0], *traced[2:5]), ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=name)
    for row, p in enumerate(left_pads):  # pads ask nothing: their output rows are exactly zero
        assert torch.equal(traced[0][row, :, :p], torch.zeros_like(traced[0][row, :, :p]))


@pytest.mark.parametrize("n, block, sliding, h, g, held, left_pads", [CASES[0], CASES[1], CASES[3]])
def test_bf16_accumulates_in_fp32(n, block, sliding, h, g, held, left_pads):
    """bf16 inputs: the traced scan computes in fp32 as the eager kernel does (signals fp32, the output rounded to
    bf16 once), so both are the float64 reference's (of the same bf16 values) to fp32 rounding, the output to one
    bf16 rounding."""
    inputs = _inputs(n, h, g, held, left_pads, d=16, dtype=torch.bfloat16, seed=3)
    traced = _measure(inputs, True, sliding, block)
    eager = _measure(inputs, False, sliding, block)
    assert traced[0].dtype == torch.bfloat16 and traced[2].dtype == torch.float32
    ref = reference(inputs, WINDOW, sliding)
    for res in (traced, eager):
        torch.testing.assert_close(res[0].double(), ref[0], rtol=8e-3, atol=8e-3)  # one bf16 rounding
        for a, r in zip(res[2:5], ref[1:]):
            torch.testing.assert_close(a.double(), r, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(traced[0], eager[0], rtol=8e-3, atol=8e-3)
    for a, e in zip(traced[1:], eager[1:]):
        if a.is_floating_point():
            torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5)


def _scans(gm):
    return [node for node in gm.graph.nodes if node.target is torch.ops.higher_order.scan]


@pytest.mark.parametrize("h, g", [(2, 3), (1, 6), (3, 1)])
def test_one_body_whatever_the_length(h, g):
    """A full-attention layer's traced measure phase holds one scan, of nb' / 2 steps over nb' / c + 1 key tiles,
    and the same graph (node count) from 8 blocks to 256; it reads nothing back to the host."""
    nodes = {}
    for n in (29, 253, 1021):
        inputs = {k: v.float() if v.is_floating_point() else v
                  for k, v in _call(h=h, g=g, n=n, left_pads=(0, 3)).items()}
        kt = trace(inputs, rules.get("h2o"), budget=7, keep=7, sliding=0, window=WINDOW, scale=None, block=4,
                          budget_ints=False)
        (scan,) = _scans(kt.measure)
        nb = -(-n // 4)
        c = tile_blocks(4, nb)
        nb2 = padded_blocks(nb, c)
        steps = scan.args[2][0].meta["val"].shape[0]
        tiles = scan.args[3][-1].meta["val"].shape[0]
        assert (steps, tiles) == (nb2 // 2, nb2 // c + 1)
        assert graph_host_syncs(kt.measure) == []
        nodes[n] = _count(kt.measure)
    assert len(set(nodes.values())) == 1, nodes


@pytest.mark.parametrize("n, block, sliding, h, g, left_pads", [
    (50, 3, 0, 1, 6, (5, 0)),   # MQA, folded
    (69, 4, 0, 2, 3, (0, 3)),   # GQA, folded in tiles
    (61, 4, 6, 2, 3, (0, 9)),   # a sliding layer's band scan
])
def test_a_call_on_an_empty_cache_skips_the_slots(n, block, sliding, h, g, left_pads):
    """Told the cache is empty (`empty`: the marker's static argument, a long prefill on a fresh cache), the traced
    measure phase has no slot matmuls, and still gives the eager kernel's results (which reads the emptiness from
    the positions) and the float64 reference's. Told so over held slots, the eager kernel refuses."""
    inputs = _inputs(n, h, g, 0, left_pads)
    told = run_measure(inputs, window=WINDOW, sliding=sliding, scale=None, block=block, traced=True, empty=True)
    eager = _measure(inputs, False, sliding, block)
    kw = dict(budget=7, keep=7, sliding=sliding, window=WINDOW, scale=None, block=block, budget_ints=False)
    traces = {e: trace(inputs, rules.get("h2o"), empty=e, **kw) for e in (False, True)}
    graphs = {e: kt.measure for e, kt in traces.items()}
    for name, a, gr, e in zip(("out", "totals", *SIGNAL_NAMES), told, run_traced_measure(traces[True], inputs),
                              eager):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(gr, e, rtol=1e-12, atol=1e-12, msg=name)
    ref = reference(inputs, WINDOW, sliding)
    for name, a, r in zip(("out", "attn", "window_attn", "last_attn"), (told[0], *told[2:5]), ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=name)
    # Every slot matmul gone: QK and PV of the slots in the scan body, and in the window's block.
    assert matmul_nodes(graphs[True]) < matmul_nodes(graphs[False]), {e: matmul_nodes(gm) for e, gm in graphs.items()}
    # Only the measure phase differs: the rule region and evict are the same graphs (the fingerprint's probe, on
    # slots, hashes those).
    assert traces[True].rule.code == traces[False].rule.code and traces[True].evict.code == traces[False].evict.code
    with pytest.raises(RuntimeError, match="said it was empty"):
        run_measure(_inputs(n, h, g, 3, left_pads), window=WINDOW, sliding=sliding, scale=None, block=block,
                    empty=True)
