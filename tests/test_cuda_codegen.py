"""The kernel's CUDA code, generated without a GPU (`-m cuda_codegen`, `make test-cuda-codegen`; docs/gpu-internals.md).

Each case runs a tiny model once on CPU through `fxbudget.compile(..., backend="eager")` (the same rewrite as
Inductor's, the graphs recorded in `model.forward.graphs`), then lowers the rewritten graph it names with Inductor
for a CUDA device (`fake_cuda.lower`): the Triton source, and where `RUNS` says so every kernel compiled to cubins
by Triton's ptxas. The calls Inductor leaves outside Triton are pinned per case (`FALLBACKS`, per variant and sm
where they differ): a new one fails, named.

Every case is lowered in float32 with snapkv and in bfloat16 with knorm (the fingerprint tests prove the rest of
the kernel is the same for every rule), for sm_90, and in bfloat16 for sm_80 too (`RUNS`). Only the CUDA build of
the pinned torch runs them (`fake_cuda.PINNED`); the pinned suite's venv (a CPU build) deselects them by marker,
and elsewhere they fail rather than skip.
"""

from __future__ import annotations

import copy
import functools
import os
import time

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

import fake_cuda
import fxbudget
from conftest import COMMON, tiny_model

pytestmark = pytest.mark.cuda_codegen

VARIANTS = {"float32": (torch.float32, "snapkv"), "bfloat16": (torch.bfloat16, "knorm")}


def _mqa():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **{**COMMON, "num_key_value_heads": 1})).eval()


def _sliding():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(num_hidden_layers=1, head_dim=16, sliding_window=8, layer_types=["sliding_attention"],
                           query_pre_attn_scalar=16, **COMMON)
    return Gemma3ForCausalLM(cfg).eval()


def _ids(n):
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(0))


def _qwen2():
    return tiny_model("qwen2", layers=1)  # GQA 2:1


# case -> (model, compile keywords, prompt length, decode steps, which recorded graph). Budget 8 (the head pool:
# 40, above snapkv's window of 32 in every head); every prompt is longer than the budget, so the call evicts. A
# call is one query block unless `block` is set (`block=8` on 40 tokens: the scan over query blocks).
CASES = {
    "full": (_qwen2, {}, 12, 0, 0),
    "decode": (_qwen2, {}, 12, 1, 1),                   # the decode step after that prefill
    "chunk": (_qwen2, {"chunk_size": 8}, 20, 0, 0),      # one graph serves every chunk
    "scan": (_qwen2, {"block": 8}, 40, 0, 0),
    "band": (_sliding, {"block": 8}, 40, 0, 0),         # a sliding layer (window 8): the band scan
    "mqa": (_mqa, {}, 12, 0, 0),                        # one KV head
    "pool": (_qwen2, {"adakv": True, "budget": 40}, 48, 0, 0),  # adakv:<rule>, the head-pooled layout
}

# The calls outside Triton in each case's output code: ATen fallbacks (`aten.*`) and extern kernels (cuBLAS
# matmuls; addmm where the projections have a bias, Qwen2's). Measured the same for both variants and both sms
# (torch 2.14.1); a `(case, variant, sm)` key pins one that differs. The only ATen fallback is the top-k of `evict`
# and the rule region (a decode step keeps k = 1 through an arg-reduction). A change here is a change of the
# kernel's GPU code: look at it, then pin it.
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


@functools.cache
def traced(case: str, variant: str):
    """The rewritten graph of `case` (and its placeholders' example tensors), traced once per process on CPU."""
    build, kw, n, steps, which = CASES[case]
    dtype, rule = VARIANTS[variant]
    kw = dict(kw)
    if kw.pop("adakv", False):
        rule = f"adakv:{rule}"
    m = fxbudget.compile(build().to(dtype), rule=rule, budget=kw.pop("budget", 8), backend="eager", **kw)
    ids = _ids(n)
    with torch.no_grad():
        out = m(input_ids=ids)
        for _ in range(steps):
            out = m(input_ids=ids[:, -1:], past_key_values=out.past_key_values)
    gm = m.forward.graphs[which]
    return gm, [node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"]


def calls_outside_triton(low: fake_cuda.Lowered) -> list[str]:
    return sorted(low.fallbacks + low.externs)


def _cpu() -> float:
    """CPU seconds of this process and its finished children (ptxas)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# Which lowerings run (CI time: each is ~10 s of one core for the source, ~0.4 s more per cubin): every case in
# both variants for sm_90; the bfloat16 variant for sm_80 too (Inductor's choices differ by sm there: bf16
# scatter-adds fall back below sm_90); cubins for both sms where the kernels are the kernel's own (the scans over
# query blocks and the band, the head pool's gathers) and for the float32 decode step. CUDA_CODEGEN_ALL=1: the whole
# product, cubins everywhere.
CUBINS = {("scan", "bfloat16"), ("band", "bfloat16"), ("pool", "bfloat16"), ("decode", "float32")}
if os.environ.get("CUDA_CODEGEN_ALL") == "1":
    RUNS = [(c, v, sm, True) for c in CASES for v in VARIANTS for sm in (90, 80)]
else:
    RUNS = [(c, v, sm, (c, v) in CUBINS) for c in CASES for v, sms in (("float32", (90,)), ("bfloat16", (90, 80)))
            for sm in sms]


@pytest.mark.parametrize("case, variant, sm, cubins", RUNS,
                         ids=[f"{c}-{v}-sm{sm}{'-cubins' if cub else ''}" for c, v, sm, cub in RUNS])
def test_lowers_to_cuda(case, variant, sm, cubins, capsys):
    wall, cpu = time.perf_counter(), _cpu()
    gm, specs = traced(case, variant)
    low = fake_cuda.lower(copy.deepcopy(gm), specs, sm=sm, cubins=cubins)
    with capsys.disabled():  # the cost of each case in CI's log (the trace is shared by a case's lowerings)
        print(f"\n[cuda_codegen] {case}/{variant}/sm_{sm}: {len(low.kernels)} Triton kernels, {len(low.cubins)} "
              f"cubins, {time.perf_counter() - wall:.1f} s wall, {_cpu() - cpu:.1f} s CPU, outside "
              f"Triton: {', '.join(low.fallbacks + low.externs)}")
    assert low.kernels, "no Triton kernel was generated"
    if cubins:
        compiled = {c.kernel for c in low.cubins}
        assert compiled == set(low.kernels), f"kernels without a cubin: {sorted(set(low.kernels) - compiled)}"
        assert {c.target for c in low.cubins} == {f"cuda:{sm}"}
        assert all(c.size > 0 for c in low.cubins)
    got, want = calls_outside_triton(low), sorted(FALLBACKS.get((case, variant, sm), FALLBACKS[case]))
    new, gone = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not (new or gone), (f"{case}/{variant}/sm_{sm}: calls outside Triton changed: new {new}, gone {gone} "
                               f"(pin them in FALLBACKS if intended: {got})")


def test_fake_cuda_fails_loudly_on_another_pair(monkeypatch):
    monkeypatch.setattr(fake_cuda, "PINNED", ("2.99.0", "9.9.9"))
    with pytest.raises(fake_cuda.FakeCudaError, match=r"pinned to torch 2\.99\.0 / Triton 9\.9\.9, found torch "):
        fake_cuda.check_pinned()


def test_fake_cuda_names_a_moved_target(monkeypatch):
    monkeypatch.setattr(fake_cuda, "TARGETS", (*fake_cuda.TARGETS, "torch._inductor.graph:GraphLowering.gone_attr"))
    with pytest.raises(fake_cuda.FakeCudaError, match=r"GraphLowering\.gone_attr is gone"):
        fake_cuda.check_pinned()
