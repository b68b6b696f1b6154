"""The traced query-blocked prefill in levels (issue 20): static key extents that recover most of the causal
triangle, the eager loop's results, a graph that does not grow with the call."""

import pytest
import torch
from expecttest import assert_expected_inline

from fxbudget import rules
from fxbudget.kernel.block_scan import LEVEL_BLOCKS, SCAN_LEVELS, scan_levels
from fxbudget.kernel import SIGNAL_NAMES

from host_sync import graph_host_syncs
from test_blocks import _call, _count, run_measure, run_traced_measure, trace


def test_scan_levels_cover_the_blocks():
    """Levels are consecutive, cover every block once, one per `LEVEL_BLOCKS` blocks and at most `SCAN_LEVELS`
    (so at least one), as equal as whole blocks allow; each sees the new tokens up to its last block's end, the last
    one all `n`."""
    assert scan_levels(8, 4, 29, levels=4) == [(0, 2, 8), (2, 4, 16), (4, 6, 24), (6, 8, 29)]
    assert scan_levels(3, 4, 9, levels=4) == [(0, 1, 4), (1, 2, 8), (2, 3, 9)]
    assert scan_levels(1, 16, 5) == [(0, 1, 5)]
    # The automatic block: 2K tokens in 32 blocks of 64, 4 levels; 8K in 512 blocks of 16, 8 levels.
    assert scan_levels(32, 64, 2048) == [(0, 8, 512), (8, 16, 1024), (16, 24, 1536), (24, 32, 2048)]
    assert len(scan_levels(512, 16, 8192)) == SCAN_LEVELS == 8
    for nb in range(1, 200, 3):
        for R in (2, 7, 16):
            n = nb * R - (nb * 5) % R  # not always a multiple of the block
            lv = scan_levels(nb, R, n)
            assert len(lv) == min(SCAN_LEVELS, max(1, nb // LEVEL_BLOCKS))
            assert [b0 for b0, _, _ in lv] == [0] + [b1 for _, b1, _ in lv[:-1]] and lv[-1][1] == nb
            widths = [b1 - b0 for b0, b1, _ in lv]
            assert max(widths) - min(widths) <= 1
            assert [k for _, _, k in lv] == [min(b1 * R, n) for _, b1, _ in lv] and lv[-1][2] == n


def _traced_vs_eager(n, block, sliding, h, g, held, left_pads, S=7):
    inputs = _call(h=h, g=g, S=S, held=held, n=n, left_pads=left_pads)  # float64
    kt = trace(inputs, rules.get("h2o"), budget=S, keep=S, sliding=sliding, window=4, scale=None, block=block)
    return kt, run_traced_measure(kt, inputs), run_measure(inputs, window=4, sliding=sliding, scale=None, block=block)


@pytest.mark.parametrize("n, block, sliding, h, g, held, left_pads", [
    (69, 2, 0, 2, 3, 3, (0, 3)),    # 35 blocks in 4 levels (8, 9, 9, 9), the last block part pads; GQA
    (50, 3, 0, 1, 6, 0, (5, 0)),    # one KV head (MQA), an empty cache, 17 blocks in 2 levels
    (131, 2, 0, 2, 3, 7, (0, 4)),   # a full cache; 66 blocks in 8 levels (the most)
    (69, 2, 69, 1, 6, 3, (4, 0)),   # a sliding window covering the call: levels, the window masks old slots
    (61, 4, 6, 2, 3, 3, (0, 9)),    # a sliding layer: the band scan, unchanged
    (29, 4, 0, 2, 3, 3, (0, 2)),    # 8 blocks: one level (the whole call, masked)
])
def test_levels_equal_the_eager_loop(n, block, sliding, h, g, held, left_pads):
    """In float64 the traced levels give the eager loop's output and every signal (the same sums of the same
    probabilities; only the order of additions of exact zeros differs)."""
    kt, traced, eager = _traced_vs_eager(n, block, sliding, h, g, held, left_pads)
    for name, a, e in zip(("out", "totals", *SIGNAL_NAMES), traced, eager):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)
    # Pads ask nothing: their output rows are exactly zero.
    pads = torch.tensor(left_pads)
    for row, p in enumerate(pads.tolist()):
        assert torch.equal(traced[0][row, :, :p], torch.zeros_like(traced[0][row, :, :p]))


def _levels_of(gm) -> list[tuple[int, int]]:
    """Each scan of a traced measure phase: (blocks scanned, new tokens a block attends over): the key extent of a
    level (its new-token keys, additional input 3), or a sliding layer's band (the offsets, additional input 6)."""
    found = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.scan:
            xs, extra = node.args[2], node.args[3]
            keys = extra[6].meta["val"].shape[0] if len(extra) == 7 else extra[3].meta["val"].shape[2]
            found.append((xs[0].meta["val"].shape[0], keys))
    return found


def test_traced_levels_snapshot():
    """The graph's scans for calls of growing length (block 4), as blocks x new tokens each block attends over: at
    most `SCAN_LEVELS` scans and, from 64 blocks on, the same graph (node count) whatever `n`; the work over the new
    tokens approaches (L + 1) / (2 L) of the square a single masked scan did (0.5625 at L = 8). A sliding layer
    keeps one band scan. None of these graphs reads anything back to the host."""
    rows = {}
    for n, sliding in ((9, 0), (61, 0), (125, 0), (253, 0), (1021, 0), (61, 6), (1021, 6)):
        inputs = {k: v.float() if v.is_floating_point() else v for k, v in _call(n=n, left_pads=(0, 3)).items()}
        kt = trace(inputs, rules.get("h2o"), budget=7, keep=7, sliding=sliding, window=4, scale=None, block=4)
        assert graph_host_syncs(kt.measure) == []
        rows[n, sliding] = _levels_of(kt.measure), _count(kt.measure)
    lines = []
    for (n, sliding), (levels, nodes) in rows.items():
        square = -(-n // 4) * 4 * n  # every (padded) query over every new token
        work = sum(4 * blocks * keys for blocks, keys in levels) / square
        lines.append(f"n={n} sliding={sliding}: {' '.join(f'{b}x{k}' for b, k in levels)} (work {work:.3f} of the "
                     f"square, nodes {nodes - rows[1021, sliding][1]:+d} vs n=1021)")
    assert_expected_inline("\n".join(lines), """\
n=9 sliding=0: 3x9 (work 1.000 of the square, nodes -778 vs n=1021)
n=61 sliding=0: 8x32 8x61 (work 0.762 of the square, nodes -666 vs n=1021)
n=125 sliding=0: 8x32 8x64 8x96 8x125 (work 0.634 of the square, nodes -444 vs n=1021)
n=253 sliding=0: 8x32 8x64 8x96 8x128 8x160 8x192 8x224 8x253 (work 0.568 of the square, nodes +0 vs n=1021)
n=1021 sliding=0: 32x128 32x256 32x384 32x512 32x640 32x768 32x896 32x1021 (work 0.564 of the square, nodes +0 vs n=1021)
n=61 sliding=6: 16x9 (work 0.148 of the square, nodes +0 vs n=1021)
n=1021 sliding=6: 256x9 (work 0.009 of the square, nodes +0 vs n=1021)""")
