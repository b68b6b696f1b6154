"""benchmarks/results/gpu_lease.md is what benchmarks/gpu/report.py writes from the committed lease rows."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import report as gpu_lease_report  # noqa: E402


def test_page_is_the_generators_output():
    assert gpu_lease_report.main(["--check"]) == 0, "run `python benchmarks/gpu/report.py`"


def test_page_carries_the_measured_rows():
    """The page's prefill table has every measured prefill row of run 1 (a parse that dropped rows would pass the
    equality test above after a regeneration)."""
    text = gpu_lease_report.PAGE.read_text()
    rows = gpu_lease_report.load_rows("2026-12-04-run1", "rows.jsonl")
    pre = [r for r in rows if r["kind"] == "prefill"]
    assert len(pre) == 9
    for r in pre:
        assert f"| {r['form']} | {r['tokens'] // 1024}K | {r['seconds']:.3f}" in text
