"""The kernel's ROCm code, generated without an AMD GPU (`-m cuda_codegen`, `make test-cuda-codegen`; docs/gpu-internals.md).

The CUDA codegen check's cases (`test_cuda_codegen.CASES`, traced once per process by its `traced`), lowered by
Inductor for a gfx942 (MI300X) device (`fake_hip.lower`): the Triton source for HIP, and where `RUNS` says so every
kernel compiled to an HSA code object by Triton's AMD backend. The calls Inductor leaves outside Triton are pinned
per case (`FALLBACKS`, per `(case, variant, arch)` where they differ), and a kernel's AMDGCN has matrix-core (MFMA)
instructions exactly where its Triton source has `tl.dot`: none of the rewritten graphs has one (their matmuls are
extern kernels), so a flex-attention graph, whose template has `tl.dot` on CUDA and HIP alike, shows that the check
sees one.

CI time: bfloat16 only (on CUDA neither the dtype nor the sm changed a choice; `CUDA_CODEGEN_ALL=1` lowers every
case in both dtypes for gfx942 and gfx90a with code objects everywhere), code objects for the kernel's own graphs
(the scans over query blocks and the band, the head pool).
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

import fake_cuda
import fake_hip
from test_cuda_codegen import CASES, VARIANTS, _cpu, traced

pytestmark = pytest.mark.cuda_codegen

# The calls outside Triton in each case's output code for HIP: the same as CUDA's (`test_cuda_codegen.FALLBACKS`:
# the top-k of `evict` and the rule region, the matmuls as extern kernels, rocBLAS/hipBLASLt here), measured the
# same for both dtypes and gfx942/gfx90a (torch 2.14.1). Pinned here on its own: a change on one backend only must
# show as such.
_TOPK, _MM = ["aten.topk.default"], ["extern_kernels.addmm", "extern_kernels.bmm", "extern_kernels.mm"]
FALLBACKS = {
    "full": _TOPK + _MM,
    "decode": _MM,
    "chunk": _TOPK + _MM,
    "scan": _TOPK + _MM,
    "band": _TOPK + ["extern_kernels.bmm", "extern_kernels.mm"],
    "mqa": _TOPK + ["extern_kernels.mm"],
    "pool": _TOPK + _MM,
}

HSACO = {"scan", "band", "pool"}
if os.environ.get("CUDA_CODEGEN_ALL") == "1":
    RUNS = [(c, v, a, True) for c in CASES for v in VARIANTS for a in ("gfx942", "gfx90a")]
else:
    RUNS = [(c, "bfloat16", "gfx942", c in HSACO) for c in CASES]


@pytest.mark.parametrize("case, variant, arch, hsaco", RUNS,
                         ids=[f"{c}-{v}-{a}{'-hsaco' if h else ''}" for c, v, a, h in RUNS])
def test_lowers_to_hip(case, variant, arch, hsaco, capsys):
    wall, cpu = time.perf_counter(), _cpu()
    gm, specs = traced(case, variant)
    low = fake_hip.lower(copy.deepcopy(gm), specs, arch=arch, hsaco=hsaco)
    with capsys.disabled():  # the cost of each case in CI's log (the trace is shared with the CUDA check's)
        print(f"\n[rocm_codegen] {case}/{variant}/{arch}: {len(low.kernels)} Triton kernels, {len(low.hsacos)} "
              f"hsacos, {time.perf_counter() - wall:.1f} s wall, {_cpu() - cpu:.1f} s CPU, outside "
              f"Triton: {', '.join(low.fallbacks + low.externs)}")
    assert low.kernels, "no Triton kernel was generated"
    code = "\n".join(low.source)
    # Inductor wrote HIP code: every kernel's device properties are the fake gfx device's (wavefronts of 64).
    cus = fake_hip.PROPS[arch].multi_processor_count
    assert f"DeviceProperties(type='hip', index=0, multi_processor_count={cus}, cc='{arch}'" in code
    assert "type='cuda'" not in code and "warp_size=64" in code
    if hsaco:
        _check_hsacos(low, arch, fake_hip.dot_kernels(code))
    got, want = sorted(low.fallbacks + low.externs), sorted(FALLBACKS.get((case, variant, arch), FALLBACKS[case]))
    new, gone = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not (new or gone), (f"{case}/{variant}/{arch}: calls outside Triton changed: new {new}, gone {gone} "
                               f"(pin them in FALLBACKS if intended: {got})")


def _check_hsacos(low: fake_hip.Lowered, arch: str, dots: set[str]) -> None:
    compiled = {h.kernel for h in low.hsacos}
    assert compiled == set(low.kernels), f"kernels without an hsaco: {sorted(set(low.kernels) - compiled)}"
    assert {h.target for h in low.hsacos} == {f"hip:{arch}"}
    assert all(h.size > 0 for h in low.hsacos)
    mfma = {h.kernel for h in low.hsacos if h.mfma}
    assert mfma == dots, f"MFMA in {sorted(mfma)}, tl.dot in {sorted(dots)}"
    # Every config of a dot kernel uses the matrix cores, not only one.
    assert all(h.mfma for h in low.hsacos if h.kernel in dots)


def _flex_graph():
    """A causal flex-attention call's Dynamo graph (traced on CPU) and its inputs: Inductor's flex template has
    `tl.dot`, the positive control of the MFMA check."""
    from torch.nn.attention.flex_attention import flex_attention

    got = []

    def capture(gm, inputs):
        got.append((gm, inputs))
        return gm

    def causal(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.where(i >= j, s, -float("inf")))

    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    torch.compile(causal, backend=capture, fullgraph=True)(q, q, q)
    return got[0]


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_flex_template_dot_uses_mfma(arch):
    gm, inputs = _flex_graph()
    cuda = fake_cuda.lower(copy.deepcopy(gm), inputs, sm=90, cubins=False)
    low = fake_hip.lower(gm, inputs, arch=arch)
    dots = fake_hip.dot_kernels("\n".join(low.source))
    assert dots and dots == fake_hip.dot_kernels("\n".join(cuda.source)), "tl.dot kernels differ from CUDA's"
    _check_hsacos(low, arch, dots)


def test_fake_hip_fails_loudly_on_another_pair(monkeypatch):
    monkeypatch.setattr(fake_cuda, "PINNED", ("2.99.0", "9.9.9"))
    with pytest.raises(fake_cuda.FakeCudaError, match=r"pinned to torch 2\.99\.0 / Triton 9\.9\.9, found torch "):
        fake_hip.check_pinned()


def test_fake_hip_names_a_moved_target(monkeypatch):
    monkeypatch.setattr(fake_hip, "TARGETS", (*fake_hip.TARGETS, "triton.backends.amd.driver:gone_attr"))
    moved = r"fake HIP patch target triton\.backends\.amd\.driver:gone_attr is gone"
    with pytest.raises(fake_cuda.FakeCudaError, match=moved):
        fake_hip.check_pinned()
    with pytest.raises(fake_cuda.FakeCudaError, match=moved):
        with fake_hip.fake_gpu("gfx942"):  # checked before anything is patched
            pass
    assert torch.version.hip is None
