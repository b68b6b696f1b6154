"""The measure phase's flex form lowered for GPUs without one (`-m cuda_codegen`, issue 49 item 4).

A tiny model's rewritten graph with `measure="flex"` (traced on CPU through `fxbudget.compile(..., backend="eager")`,
as tests/test_cuda_codegen.py does) is lowered by Inductor for a fake sm_90 and sm_80 (`fake_cuda`) and gfx942
(`fake_hip`, where present): a full layer, a sliding layer, a prefill chunk over held slots and the head pool, in
bfloat16. Each lowering holds the form's two flex calls as Triton templates (`triton_tem_*`), and leaves outside
Triton only what the block form leaves there (`FALLBACKS`: top-k and the matmuls); a new call fails, named. A kernel
whose signal set holds neither `attn` nor `acc_attn` (issue 56: snapkv's own) lowers with the first call alone, for
every target, with no new fallback.

History: until this form read the candidates' positions from their two parts (`flex_measure.kpos_at`) and the
queries' through a gather, Inductor 2.14.1 failed to lower the mods ("BLOCK_N != XBLOCK", from a `cat` inlined into
the mask_mod) and 2.11 failed on the `masked` loads of a `cat` or a pad there (the H200 run): these cases were strict
xfails on that message.
"""

from __future__ import annotations

import copy
import functools
import importlib.util

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import fake_cuda
import fxbudget
from conftest import COMMON, tiny_model

pytestmark = pytest.mark.cuda_codegen


def _sliding():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(num_hidden_layers=1, head_dim=16, sliding_window=8, layer_types=["sliding_attention"],
                           query_pre_attn_scalar=16, **COMMON)
    return Gemma3ForCausalLM(cfg).eval()


# case -> (model, compile keywords, prompt length, which recorded graph). The kernel window is 8 (snapkv's
# `window`), so a call of 40 tokens runs the flex form (a call of at most 8 is its own window block).
CASES = {
    "full": (lambda: tiny_model("qwen2", layers=1), {}, 40, 0),
    "sliding": (_sliding, {}, 40, 0),
    "chunk": (lambda: tiny_model("qwen2", layers=1), {"chunk_size": 16}, 40, 0),  # chunks over held slots
    "pool": (lambda: tiny_model("qwen2", layers=1), {"adakv": True, "budget": 40}, 48, 0),  # the head pool
}
# What each lowering leaves outside Triton (the block form's own: test_cuda_codegen.FALLBACKS).
FALLBACKS = {"sliding": ["aten.topk.default", "extern_kernels.bmm", "extern_kernels.mm"]}
DEFAULT_FALLBACKS = ["aten.topk.default", "extern_kernels.addmm", "extern_kernels.bmm", "extern_kernels.mm"]
TARGETS = [("cuda", 90), ("cuda", 80)] + ([("hip", "gfx942")] if importlib.util.find_spec("fake_hip") else [])


@functools.cache
def traced(case: str, signals: str | frozenset = "all"):
    """The case's graph with the kernel measuring every signal (both flex calls), or `signals` (issue 56: snapkv's
    own set, `window_attn`, has no transposed call)."""
    build, kw, n, which = CASES[case]
    kw = dict(kw)
    rule = "adakv:snapkv" if kw.pop("adakv", False) else "snapkv"
    m = fxbudget.compile(build().to(torch.bfloat16), rule=rule, backend="eager", measure="flex", window=8,
                         signals=signals, **{"budget": 8, **kw})
    ids = torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(input_ids=ids)
    gm = m.forward.graphs[which]
    assert any(node.target is torch.ops.higher_order.flex_attention for node in gm.graph.nodes), "no flex form"
    return gm, [node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"]


# CI time (~7 s per lowering): every case for sm_90, every target for the full layer.
RUNS = [(c, *t) for c in sorted(CASES) for t in TARGETS if c == "full" or t == ("cuda", 90)]


def _lowered(gm, specs, kind: str, target):
    """The graph lowered for a fake CUDA (`sm_<target>`) or HIP (`gfx<target>`) device, and its flex templates."""
    if kind == "cuda":
        low = fake_cuda.lower(copy.deepcopy(gm), specs, sm=target, cubins=False)
    else:
        import fake_hip

        low = fake_hip.lower(copy.deepcopy(gm), specs, arch=target, hsaco=False)
    return low, [k for k in low.kernels if k.startswith("triton_tem_") and "flex_attention" in k]


@pytest.mark.parametrize("case, kind, target", RUNS, ids=[f"{c}-{k}-{t}" for c, k, t in RUNS])
def test_flex_form_lowers(case, kind, target):
    gm, specs = traced(case)
    low, templates = _lowered(gm, specs, kind, target)
    assert len(templates) == 2, f"{case}/{target}: the form's two flex calls as Triton templates, got {templates}"
    assert sorted(low.fallbacks + low.externs) == FALLBACKS.get(case, DEFAULT_FALLBACKS), (case, target)


# Without the transposed call (the run's signal set without attn/acc_attn): every target, the full layer and the
# head pool (sm_90).
RUNS_ONE = [("full", *t) for t in TARGETS] + [("pool", "cuda", 90)]


@pytest.mark.parametrize("case, kind, target", RUNS_ONE, ids=[f"{c}-{k}-{t}" for c, k, t in RUNS_ONE])
def test_flex_form_without_the_transposed_call_lowers(case, kind, target):
    gm, specs = traced(case, frozenset({"window_attn"}))
    assert sum(node.target is torch.ops.higher_order.flex_attention for node in gm.graph.nodes) == 1
    low, templates = _lowered(gm, specs, kind, target)
    assert len(templates) == 1, f"{case}/{target}: one flex call as a Triton template, got {templates}"
    assert set(low.fallbacks + low.externs) <= set(FALLBACKS.get(case, DEFAULT_FALLBACKS)), (case, target)
