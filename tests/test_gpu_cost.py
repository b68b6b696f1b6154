"""The predicted GPU cost (benchmarks/gpu/cost.py): its score count is the kernel's own schedule, and the committed
report and docs/gpu-internals.md's section are what the script writes from the committed Inductor counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import cost as gpu_cost  # noqa: E402

from fxbudget.kernel.key_scan import fold_pairs  # noqa: E402


@pytest.mark.parametrize("n", [2048, 8192, 32768, 131072])
def test_score_count_is_the_fold_schedule(n):
    """E (by hand, H N' (N' + c R) / 2) equals the score blocks `fold_scan` computes: every step's tiles, each a
    [group x R, c x R] block per KV head."""
    s = gpu_cost.shapes()
    R, c, nb2, steps = gpu_cost._blocking(n, s["H"])
    schedule = fold_pairs(nb2, c)
    assert len(schedule) == steps
    computed = sum(len(tiles) for _, tiles in schedule) * s["H"] * R * c * R
    assert gpu_cost.today_measure("prefill", n, 1024, s)["E"] == computed


def test_flash_is_the_fused_forward_on_an_empty_cache():
    """The fused form's forward call on an empty cache costs exactly the unmodified model's flash (FLOPs)."""
    s = gpu_cost.shapes()
    fwd = gpu_cost.fused_measure("prefill", 8192, 1024, s)["parts"]["forward"]
    assert fwd[0] == gpu_cost.flash("prefill", 8192, s)["flops"]


def test_report_and_docs_are_the_scripts_output():
    assert gpu_cost.INDUCTOR_JSON.exists(), "benchmarks/results/gpu_cost_inductor.json is committed"
    assert gpu_cost.main(["report", "--check"]) == 0, "run `python benchmarks/gpu/cost.py report`"


@pytest.mark.parametrize("n", [8192, 32768, 131072])
def test_without_the_transposed_call_is_the_forward_and_the_window_block(n):
    """Issue 56: a run reading neither attn nor acc_attn runs the fused forward call (no LSE) and the window block:
    its predicted measure phase is the fused form's less the transposed call, and its prefill
    lies between the unmodified attention's and the fused form's."""
    s = gpu_cost.shapes()
    full = gpu_cost.fused_measure("prefill", n, 1024, s)
    alone = gpu_cost.flex_without_transposed("prefill", n, 1024, s)
    assert alone["flops"] == full["flops"] - full["parts"]["transposed"][0]
    assert alone["bytes"] == full["bytes"] - full["parts"]["transposed"][1]
    [row] = [r for r in gpu_cost.signal_set_rows(s, None) if r["n"] == n]
    assert row["t_base"] < row["t_without"] < row["t_with"]
