"""The decode step's kernel count for a GPU, pinned (`-m cuda_codegen`, `make test-cuda-codegen`; issue 57).

One decode step of one Llama-3.1-8B layer (bf16, B = 1024), traced as the SDPA pass splices it (measure, rule
region and evict in one graph: `benchmarks/gpu/cost_inductor.py`'s `lower_decode_step`) and lowered for a fake sm_90
and a fake gfx942: its launches (every Triton kernel run, extern matmul and ATen call of the output code) and its
distinct Triton kernels must stay at or under the pins below, for the evicting step (interval 1, snapkv) and the
appending step (an interval's step into free head-room: the shared frozen runner, the `window` rule), batch 1 and
8. A change that adds kernels to decode fails here with the numbers; one that removes some should lower the pins.
`python benchmarks/gpu/cost.py decode-counts` writes the same counts for every budget into
`benchmarks/results/gpu_cost_inductor.json`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import cost_inductor  # noqa: E402

pytestmark = pytest.mark.cuda_codegen

SHAPES, WINDOW, RULE, BUDGET = dict(H=32, h=8, d=128), 32, "snapkv", 1024
# (step, batch) -> (launches, Triton kernels) at most, measured with torch 2.14.1 on both targets (issue 57's goal:
# <= 16 launches for an evicting step, <= 6 for an appending one; what each remaining kernel does: the report).
PINS = {
    ("evicting", 1): (42, 32),
    ("evicting", 8): (41, 31),
    ("appending", 1): (38, 29),
    ("appending", 8): (36, 27),
}
RUNS = [(step, batch, arch) for step, batch in PINS for arch in cost_inductor.DECODE_ARCHS]


@pytest.mark.parametrize("step, batch, arch", RUNS, ids=[f"{s}-b{b}-{a}" for s, b, a in RUNS])
def test_decode_step_launches(step, batch, arch, capsys):
    r = cost_inductor.lower_decode_step(step, BUDGET, batch, arch, SHAPES, WINDOW, RULE, phases=False)
    got = (r["launches"], r["kernels"])
    with capsys.disabled():
        print(f"\n[decode_codegen] {step} batch {batch} {arch}: {got[0]} launches, {got[1]} Triton kernels, outside "
              f"Triton: {', '.join(r['other_calls']) or 'none'}")
    launches, kernels = PINS[(step, batch)]
    assert got[0] <= launches and got[1] <= kernels, (
        f"decode {step} step, batch {batch}, {arch}: {got[0]} launches / {got[1]} Triton kernels, pinned at most "
        f"{launches} / {kernels} (outside Triton: {r['other_calls']})")


SLOT_RUNS = [(storage, arch) for storage in ("float8_e4m3fn", "int8") for arch in cost_inductor.DECODE_ARCHS]


@pytest.mark.parametrize("storage, arch", SLOT_RUNS, ids=[f"{s}-{a}" for s, a in SLOT_RUNS])
def test_quantized_slots_add_no_call_outside_triton(storage, arch):
    """Issue 58: the dequantizing measure phase and the quantizing evict lower into Triton kernels (the scale's
    bytes by shifts and same-size bitcasts: a bitcast between sizes would be an ATen call), and the step reads fewer
    bytes than with bf16 slots."""
    bf16 = cost_inductor.lower_decode_step("evicting", BUDGET, 1, arch, SHAPES, WINDOW, RULE, phases=False)
    r = cost_inductor.lower_decode_step("evicting", BUDGET, 1, arch, SHAPES, WINDOW, RULE, phases=False,
                                        slot_dtype=storage)
    assert sorted(r["other_calls"]) == sorted(bf16["other_calls"]), r["other_calls"]
    assert r["bytes"] < bf16["bytes"] and r["launches"] <= bf16["launches"] + 3, (r["launches"], r["bytes"])
