"""The measure phase's flex form (`kernel.flex_measure`, issue 49) against today's block form, on a CPU (flex's eager
math path, and aot_eager): every signal and the output within fp32 rounding, every rule's kept set identical, both
layouts, full and sliding layers, left padding, chunked prefill, decode; bf16 against float64; the block masks
that only a GPU reads (flex's CPU path applies `mask_mod` everywhere) checked against the dense mask here.

The bound: float32 inputs, `|flex - blocks| <= 1e-5 * max|blocks|` per tensor (relative to the tensor's scale: both
forms sum the same products in another order, fp32 unit roundoff 6e-8 times a few hundred terms).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fxbudget
from fxbudget.kernel import HEAD_POOL, PER_HEAD, measure_phase, select
from fxbudget.kernel.flex_measure import FLEX_BLOCK, _visibility
from fxbudget.kernel.settings import measure_form
from fxbudget.passes.sdpa import trace_kernel
from fxbudget.kernel.state import MARKER_TENSORS, marker_tensors

from conftest import tiny_model
from test_blocks import _call, kernel_args

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
RTOL = 1e-5
F32 = torch.float32


def _inputs(dtype=F32, pooled=False, **kw):
    """`test_blocks._call`'s kernel inputs in `dtype`; pooled: the slots spread over the heads by a random owner
    (some free), as the head pool holds them."""
    inp = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in _call(**kw).items()}
    q, slots, new, const = kernel_args(inp)
    if pooled:
        owner = torch.randint(-1, slots.pos.shape[1], slots.owner.shape, generator=torch.Generator().manual_seed(1),
                              dtype=torch.int32)
        slots = replace(slots, owner=owner, pos=torch.where(owner >= 0, slots.pos, -1))
    return q, slots, new, const


def _measure(form, q, slots, new, const, pooled=False, **kw):
    kw = {"window": 4, "sliding": 0, "scale": None, "block": 4, **kw}
    return measure_phase(HEAD_POOL if pooled else PER_HEAD, q, slots, new, const, form=form, **kw)


def assert_same(ref, got, rtol=RTOL):
    """`measure`'s `(out, totals, signals)`: floats within `rtol` of each tensor's scale, the rest equal."""
    (o1, t1, s1), (o2, t2, s2) = ref, got
    assert list(s1) == list(s2)
    for name, a, b in [("out", o1, o2), ("totals", t1, t2), *((k, s1[k], s2[k]) for k in s1)]:
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.is_floating_point():
            ok = torch.isnan(a) == torch.isnan(b)
            assert bool(ok.all()), name
            a, b = a.nan_to_num(), b.nan_to_num()
            err, scale = (a - b).abs().max().item(), a.abs().max().item()
            assert err <= rtol * max(scale, 1e-30), f"{name}: {err:.3g} against scale {scale:.3g}"
        else:
            assert torch.equal(a, b), name


# (slots, held, call length, left pads): a prefill on an empty cache, a chunk over a partly filled cache with a
# left-padded row, a chunk over a full cache.
CALLS = {"prefill": dict(S=7, held=0, n=23, left_pads=(0, 4)), "chunk": dict(S=9, held=5, n=19, left_pads=(3, 0)),
         "full": dict(S=6, held=6, n=30, left_pads=(0, 0))}


@pytest.mark.parametrize("pooled", [False, True], ids=["per-head", "pool"])
@pytest.mark.parametrize("sliding", [0, 6])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_flex_signals_equal_blocks(call, sliding, pooled):
    args = _inputs(pooled=pooled, **CALLS[call])
    ref = _measure("blocks", *args, pooled=pooled, sliding=sliding)
    assert_same(ref, _measure("flex", *args, pooled=pooled, sliding=sliding))


def test_flex_is_not_the_block_form():
    """The test above could pass by running the block form twice: the flex form calls flex_attention."""
    from fxbudget.kernel import flex_measure

    calls = []
    real = flex_measure.flex_attention
    flex_measure.flex_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        _measure("flex", *_inputs(**CALLS["chunk"]))
        assert len(calls) == 2  # the attention and the transposed call
        _measure("blocks", *_inputs(**CALLS["chunk"]))
        assert len(calls) == 2
    finally:
        flex_measure.flex_attention = real


@pytest.mark.parametrize("n", [1, 4])
def test_calls_within_the_window_keep_the_block_form(n):
    """A decode step (and any call of at most `w` queries) is its own window block: both settings run the same
    code, bit for bit (flex_measure's docstring says why)."""
    args = _inputs(S=7, held=5, n=n, left_pads=(0, 0))
    a, b = _measure("blocks", *args, window=4), _measure("flex", *args, window=4)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_measure_form_resolves_by_device(monkeypatch):
    """"auto" is the block form on a CPU and the flex form on CUDA (ROCm's torch device too); "flex" runs where
    verified, elsewhere only on purpose."""
    assert measure_form("auto", torch.device("cpu")) == "blocks"
    assert measure_form("auto", torch.device("cuda", 0)) == "flex"
    assert measure_form("auto", torch.device("meta")) == "blocks"
    assert measure_form("flex", torch.device("cpu")) == "flex"
    assert measure_form("flex", torch.device("cuda", 0)) == "flex"
    # float64: flex's GPU kernels do not compile it (Triton), the CPU's path does
    assert measure_form("auto", torch.device("cuda", 0), torch.float64) == "blocks"
    assert measure_form("auto", torch.device("cuda", 0), torch.bfloat16) == "flex"
    assert measure_form("flex", torch.device("cpu"), torch.float64) == "flex"
    with pytest.raises(ValueError, match=r"measure='flex' on cuda takes .*got torch.float64; use measure='blocks'"):
        measure_form("flex", torch.device("cuda", 0), torch.float64)
    monkeypatch.delenv("FXBUDGET_UNVERIFIED_FLEX", raising=False)
    with pytest.raises(RuntimeError, match=r"measure='flex' is not verified on xpu .*FXBUDGET_UNVERIFIED_FLEX=1"):
        measure_form("flex", torch.device("xpu", 0))
    monkeypatch.setenv("FXBUDGET_UNVERIFIED_FLEX", "1")
    assert measure_form("flex", torch.device("xpu", 0)) == "flex"
    with pytest.raises(ValueError, match=r"measure must be one of \('auto', 'blocks', 'flex'\)"):
        measure_form("fused", torch.device("cpu"))
    with pytest.raises(ValueError, match="measure must be one of"):
        fxbudget.compile(tiny_model("llama", layers=1), rule="knorm", budget=8, measure="fused")


def _rules():
    names = [r for r in fxbudget.rules.available() if not fxbudget.rules.get(r).replay_only]
    return names + ["adakv:snapkv"]


@pytest.mark.parametrize("sliding", [0, 6])
def test_every_rule_keeps_the_same_set(sliding):
    """Every registered rule (and a head-adaptive one on the pool) keeps the same entries from either form's
    signals: the rule cannot tell (the rule region and eviction on each form's measured signals, as
    `harness.branch` runs them)."""
    measured = {}
    for pooled in (False, True):
        args = _inputs(pooled=pooled, **CALLS["chunk"])
        measured[pooled] = args, {f: _measure(f, *args, pooled=pooled, sliding=sliding, window=4)
                                  for f in ("blocks", "flex")}
    for name in _rules():
        rule = fxbudget.rules.get(name)
        pooled = rule.head_adaptive
        (q, slots, new, const), forms = measured[pooled]
        kept = {}
        for form, (out, totals, signals) in forms.items():
            s = replace(slots, **{f: getattr(slots, f).clone() for f in ("keys", "values", "pos", "state", "norms",
                                                                         "totals", "owner")})
            select(HEAD_POOL if pooled else PER_HEAD, rule, signals, totals, s, new, budget=4, keep=4, window=4)
            kept[form] = s
        a, b = kept["blocks"], kept["flex"]
        assert torch.equal(a.pos, b.pos) and torch.equal(a.owner, b.owner), name
        torch.testing.assert_close(b.state, a.state, rtol=RTOL, atol=RTOL, msg=name)


# The signals that read the attention: bf16's check bounds them against float64.
ATTN_SIGNALS = ("attn", "window_attn", "last_attn", "window_max_attn", "acc_attn")


def bf16_output_bound(ref_out, new, slots) -> float:
    """The bf16 output's bound against float64 (`flex_gpu_check.py` reads it too): rounded twice, the probabilities
    before the PV product (2^-8 of the largest value a query reads, new or held) and the result (2^-8 of its own)."""
    values = max(v.abs().max().item() for v in (new.values, slots.values) if v.numel())
    return 2**-8 * (ref_out.abs().max().item() + values)


def test_bf16_within_bf16_rounding_of_float64():
    """bf16 inputs: the flex form's signals are fp32 sums of exactly representable products (flex's math path works
    in fp32), so within fp32 rounding of the float64 measure of the same inputs. Its output is rounded to bf16
    twice, as flash attention's on a GPU: the probabilities before the PV product (at most 2^-8 of max|v|) and the
    result (2^-8 of its scale); the block form rounds only the result."""
    args16 = _inputs(torch.bfloat16, **CALLS["chunk"])
    q, slots, new, const = args16
    up = lambda x: x.to(torch.float64) if x.is_floating_point() else x  # noqa: E731
    args64 = (up(q), replace(slots, **{f: up(getattr(slots, f)) for f in ("keys", "values", "state", "norms",
                                                                          "totals")}),
              replace(new, keys=up(new.keys), values=up(new.values)), replace(const, inv_freq=up(const.inv_freq),
                                                                              wo=up(const.wo)))
    out, _, sig = _measure("flex", *args16)
    ref_out, _, ref = _measure("blocks", *args64)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref_out).abs().max().item()
    assert err <= bf16_output_bound(ref_out, new, slots), err
    for name in ATTN_SIGNALS:
        e, s = (sig[name].double() - ref[name]).abs().max().item(), ref[name].abs().max().item()
        assert e <= RTOL * s, f"{name}: {e:.3g} against {s:.3g}"


@pytest.mark.parametrize("sliding", [0, 5, 300])
def test_block_lists_cover_the_mask(sliding):
    """What a GPU reads and the CPU path ignores: every visible pair lies in a listed block, and a block listed as
    full has every pair visible (there `mask_mod` is skipped)."""
    gen = torch.Generator().manual_seed(3)
    b, h, n, S = 2, 2, 300, 200
    qpos = torch.arange(n).expand(b, n).clone()
    qpos[1, :70] = -1  # a left-padded row
    qpos[1, 70:] -= 70
    slot_pos = torch.randint(-1, 400, (b, h, S), generator=gen)
    kpos = torch.cat([slot_pos, qpos.view(b, 1, n).expand(b, h, n) + 400], dim=-1).int()
    qpos = torch.where(qpos >= 0, qpos + 400, -1).int()
    vis, full = _visibility(kpos, qpos, sliding)
    kp, qp = kpos.view(b, h, 1, -1), qpos.view(b, 1, n, 1)
    dense = (kp >= 0) & (kp <= qp) & ((kp > qp - sliding) if sliding else True)  # [b, h, n, C]
    C = kpos.shape[-1]
    nq, nk = -(-n // FLEX_BLOCK), -(-C // FLEX_BLOCK)
    padded = torch.nn.functional.pad(dense, (0, nk * FLEX_BLOCK - C, 0, nq * FLEX_BLOCK - n))
    blocks = padded.view(b, h, nq, FLEX_BLOCK, nk, FLEX_BLOCK)
    any_vis, all_vis = blocks.any(dim=(3, 5)), blocks.all(dim=(3, 5))
    assert bool((vis | ~any_vis).all()), "a visible pair outside every listed block"
    assert bool((~full | all_vis).all()), "a block listed full holds an invisible pair"
    assert bool((~vis).any()) and bool(full.any() or sliding), "the lists skip nothing, or none is full: not tested"


@pytest.mark.parametrize("pooled", [False, True], ids=["per-head", "pool"])
def test_block_lists_read_as_a_gpu_kernel_reads_them(monkeypatch, pooled):
    """Flex's GPU kernel reads a BlockMask's lists at row-major offsets, whatever the tensors' strides: the lists of
    both calls (the transposed one's built from transposed views) must mean the same read that way. On an H200 the
    strided lists of an argsort over a transposed view made `attn` 1.48x too large (gpu_lease.md, run 4)."""
    from torch.nn.attention import flex_attention as fa

    from fxbudget.kernel import flex_measure

    masks = []

    def recording(*args, block_mask, **kwargs):
        masks.append(block_mask)
        return fa.flex_attention(*args, block_mask=block_mask, **kwargs)

    monkeypatch.setattr(flex_measure, "fused_flex", lambda device: recording)
    _measure("flex", *_inputs(pooled=pooled, b=1, h=2, g=3, S=150, held=100, n=300, d=8, left_pads=(0,)),
             pooled=pooled, window=4)
    assert len(masks) == 2
    for m in masks:
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            t = getattr(m, name)
            raw = torch.as_strided(t, t.shape, torch.empty(t.shape).stride(), t.storage_offset())
            assert torch.equal(raw, t), f"{name} of a {m.shape} mask reads differently at row-major offsets"


def test_fingerprint_one_for_all_rules_per_form():
    """The traced measure phase is the same graph for every rule in the flex form, and holds flex_attention;
    "auto" on a CPU traces the block form."""
    q, slots, new, const = _inputs(**CALLS["chunk"])
    ev = {**dict(zip(MARKER_TENSORS, marker_tensors(slots, new, const))), "q": q}
    kw = dict(budget=4, keep=4, sliding=0, window=4, scale=None, block=4, budget_ints=False)
    codes = {r: trace_kernel(ev, fxbudget.rules.get(r), measure="flex", **kw).measure.code
             for r in ("snapkv", "h2o", "knorm")}
    assert len(set(codes.values())) == 1
    assert "flex_attention" in codes["snapkv"]
    assert "flex_attention" not in trace_kernel(ev, fxbudget.rules.get("snapkv"), **kw).measure.code


def _generate(m, ids, steps=3, chunk=None):
    with torch.no_grad():
        out = m(input_ids=ids)
        logits = [out.logits[:, -1]]
        for _ in range(steps):
            out = m(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=out.past_key_values)
            logits.append(out.logits[:, -1])
    return torch.stack(logits), out.past_key_values


def assert_model_flex_equals_blocks(backend):
    """A tiny GQA model, chunked prefill with eviction then decode, in both forms: the same logits (fp32 rounding)
    and the same cache."""
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    runs = {}
    for form in ("blocks", "flex"):
        m = fxbudget.compile(tiny_model("qwen2", layers=1), rule="snapkv", budget=12, chunk_size=16,
                             backend=backend, measure=form, window=4)
        runs[form] = _generate(m, ids)
    (la, ca), (lb, cb) = runs["blocks"], runs["flex"]
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-5)
    for x, y in zip(ca.layers, cb.layers):
        assert torch.equal(x.pos, y.pos)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_model_flex_equals_blocks(backend):
    assert_model_flex_equals_blocks(backend)


def test_cpu_inductor_flex_is_refused_by_name():
    """Refused when compiled (the model's device is known), and by the backend (which sees the graph's) before
    Inductor compiles anything: never a silent fallback to the block form."""
    model = tiny_model("llama", layers=1)
    with pytest.raises(NotImplementedError, match=r"measure='flex' cannot compile with Inductor on a CPU"):
        fxbudget.compile(model, rule="knorm", budget=8, measure="flex")
    from fxbudget.compiler.backend import make_backend

    m = fxbudget.compile(model, rule="snapkv", budget=8, backend="eager", measure="flex", window=4)
    with torch.no_grad():
        m(input_ids=torch.randint(1, 96, (1, 12)))
    gm = m.forward.graphs[0]
    with pytest.raises(NotImplementedError, match=r"measure='flex' cannot compile with Inductor on a CPU"):
        make_backend("snapkv", inner="inductor", measure="flex", window=4)(gm, [])


def test_eager_kernel_calls_flex_compiled(monkeypatch):
    """Eagerly on a GPU the flex form calls flex through its own `torch.compile` (called plain, flex writes the n x C
    scores). The same route on a CPU, with aot_eager standing in for Inductor (whose CPU flex returns no LSE): the
    compiled call runs inside the eager pass's TorchFunctionMode, is actually used, and gives the plain op's result."""
    from fxbudget.kernel import flex_measure

    monkeypatch.setitem(flex_measure.EAGER_FLEX_BACKEND, "cpu", "aot_eager")
    monkeypatch.setattr(flex_measure, "_COMPILED", {})
    assert_model_flex_equals_blocks(None)
    assert list(flex_measure._COMPILED) == ["aot_eager"]


def test_compiled_flex_fails_loudly_past_its_recompile_limit(monkeypatch):
    """Past the compiled flex's recompile limit a call raises instead of running flex's eager math path (the n x C
    scores the form exists to avoid); the default limit covers a model with sliding and full layers, chunked."""
    from fxbudget.kernel import flex_measure

    monkeypatch.setitem(flex_measure.EAGER_FLEX_BACKEND, "cpu", "aot_eager")
    monkeypatch.setattr(flex_measure, "_COMPILED", {})
    monkeypatch.setattr(flex_measure, "FLEX_RECOMPILE_LIMIT", 1)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        _measure("flex", *_inputs(**CALLS["prefill"]), window=4)
    torch._dynamo.reset()
