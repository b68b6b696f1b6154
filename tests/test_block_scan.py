"""The traced query-blocked prefill (issues 20, 30): one scan per layer whatever the call's length, the eager loop's
results; a full layer folds its query blocks in pairs over the exact causal triangle (`fxbudget.key_scan`), a sliding
layer scans bands."""

import pytest
import torch
from expecttest import assert_expected_inline

from fxbudget import rules
from fxbudget.kernel import SIGNAL_NAMES

from host_sync import graph_host_syncs
from test_blocks import _call, _count, run_measure, run_traced_measure, trace


def _traced_vs_eager(n, block, sliding, h, g, held, left_pads, S=7):
    inputs = _call(h=h, g=g, S=S, held=held, n=n, left_pads=left_pads)  # float64
    kt = trace(inputs, rules.get("h2o"), budget=S, keep=S, sliding=sliding, window=4, scale=None, block=block)
    return kt, run_traced_measure(kt, inputs), run_measure(inputs, window=4, sliding=sliding, scale=None, block=block)


@pytest.mark.parametrize("n, block, sliding, h, g, held, left_pads", [
    (69, 2, 0, 2, 3, 3, (0, 3)),    # 35 blocks (a pad block makes 36: 18 folded steps), the last part pads; GQA
    (50, 3, 0, 1, 6, 0, (5, 0)),    # one KV head (MQA), an empty cache, 17 blocks
    (131, 2, 0, 2, 3, 7, (0, 4)),   # a full cache; 66 blocks
    (69, 2, 69, 1, 6, 3, (4, 0)),   # a sliding window covering the call: folded, the window masks old slots
    (61, 4, 6, 2, 3, 3, (0, 9)),    # a sliding layer: the band scan
    (29, 4, 0, 2, 3, 3, (0, 2)),    # 8 blocks: 4 folded steps
])
def test_traced_scan_equals_the_eager_loop(n, block, sliding, h, g, held, left_pads):
    """In float64 the traced scan gives the eager loop's output and every signal (the same probabilities; sums in
    another order)."""
    kt, traced, eager = _traced_vs_eager(n, block, sliding, h, g, held, left_pads)
    for name, a, e in zip(("out", "totals", *SIGNAL_NAMES), traced, eager):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)
    # Pads ask nothing: their output rows are exactly zero.
    pads = torch.tensor(left_pads)
    for row, p in enumerate(pads.tolist()):
        assert torch.equal(traced[0][row, :, :p], torch.zeros_like(traced[0][row, :, :p]))


def _scans_of(gm) -> list[tuple[int, int]]:
    """Each scan of a traced measure phase: (steps, new tokens a step attends over): a folded scan's tiles (its
    last additional input, the tile indices) times the block, or a sliding layer's band (the offsets, additional
    input 6)."""
    found = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.scan:
            xs, extra = node.args[2], node.args[3]
            if len(extra) == 7 and extra[3].meta["val"].dim() == 5:  # folded: key tiles [nb', b, h, R, d]
                keys = extra[6].meta["val"].shape[0] * extra[3].meta["val"].shape[3]
            else:
                keys = extra[6].meta["val"].shape[0]
            found.append((xs[0].meta["val"].shape[0], keys))
    return found


def test_traced_scans_snapshot():
    """The graph's scans for calls of growing length (block 4), as steps x new tokens a step attends over: one scan
    and the same graph (node count) whatever `n`. A full layer's step is two query blocks over `nb' / c + 1` key
    tiles of `c` blocks (`key_scan.tile_blocks`: 1 up to 31 blocks, 16 at 256), so the work over the new tokens is
    the triangle, `(nb' + c) / (2 nb')` of the padded square (0.5 + c / (2 nb')); a sliding layer keeps one band
    scan. None of these graphs reads anything back to the host."""
    rows = {}
    for n, sliding in ((9, 0), (61, 0), (125, 0), (253, 0), (1021, 0), (61, 6), (1021, 6)):
        inputs = {k: v.float() if v.is_floating_point() else v for k, v in _call(n=n, left_pads=(0, 3)).items()}
        kt = trace(inputs, rules.get("h2o"), budget=7, keep=7, sliding=sliding, window=4, scale=None, block=4)
        assert graph_host_syncs(kt.measure) == []
        rows[n, sliding] = _scans_of(kt.measure), _count(kt.measure)
    lines = []
    for (n, sliding), (scans, nodes) in rows.items():
        square = -(-n // 4) * 4 * n  # every (padded) query over every new token
        # A step's tiles of 4 keys are each attended by one block of 4 queries (its own block's, when folded).
        work = sum(4 * steps * keys for steps, keys in scans) / square
        lines.append(f"n={n} sliding={sliding}: {' '.join(f'{s}x{k}' for s, k in scans)} (work {work:.3f} of the "
                     f"square, nodes {nodes - rows[1021, sliding][1]:+d} vs n=1021)")
    assert_expected_inline("\n".join(lines), """\
n=9 sliding=0: 2x20 (work 1.481 of the square, nodes +0 vs n=1021)
n=61 sliding=0: 8x68 (work 0.557 of the square, nodes +0 vs n=1021)
n=125 sliding=0: 16x136 (work 0.544 of the square, nodes +0 vs n=1021)
n=253 sliding=0: 32x272 (work 0.538 of the square, nodes +0 vs n=1021)
n=1021 sliding=0: 128x1088 (work 0.533 of the square, nodes +0 vs n=1021)
n=61 sliding=6: 16x9 (work 0.148 of the square, nodes +0 vs n=1021)
n=1021 sliding=6: 256x9 (work 0.009 of the square, nodes +0 vs n=1021)""")
