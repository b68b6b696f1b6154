"""The measure phase in query blocks (issue 9): the same results as one block, bounded temporaries, one graph."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxbudget
from fxbudget import rules
from fxbudget.kernel import SIGNAL_NAMES, TOTALED, auto_block, budget_attention, measure
from fxbudget.passes.sdpa import trace_kernel
from conftest import fresh, greedy, tiny_model

F64 = dict(dtype=torch.float64)


def _call(b=2, h=2, g=3, S=7, held=3, n=23, d=8, left_pads=(0, 4), seed=0):
    """Random kernel inputs: `held` filled slots of `S`, then a call of `n` tokens, row i left-padded by
    `left_pads[i]` (positions -1; valid positions continue from `held`)."""
    gen = torch.Generator().manual_seed(seed)
    k_slots, v_slots = torch.randn(b, h, S, d, generator=gen, **F64), torch.randn(b, h, S, d, generator=gen, **F64)
    pos_slots = torch.full((b, h, S), -1, dtype=torch.long)
    pos_slots[..., :held] = torch.arange(held)
    state = torch.rand(b, h, S, generator=gen, **F64) * (pos_slots >= 0)
    norms = torch.stack([k_slots.norm(dim=-1), v_slots.norm(dim=-1)], dim=-1) * (pos_slots >= 0).unsqueeze(-1)
    new_pos = torch.stack([torch.cat([torch.full((p,), -1), torch.arange(held, held + n - p)]) for p in left_pads])
    return dict(q=torch.randn(b, h * g, n, d, generator=gen, **F64), k_slots=k_slots, v_slots=v_slots,
                pos_slots=pos_slots, state=state, norms=norms, totals=torch.zeros(b, h, len(TOTALED), **F64),
                k_new=torch.randn(b, h, n, d, generator=gen, **F64), v_new=torch.randn(b, h, n, d, generator=gen, **F64),
                new_pos=new_pos, inv_freq=1.0 / 10000 ** (torch.arange(0, d, 2, **F64) / d))


def _run(inputs, rule, **kw):
    t = {k: v.clone() for k, v in inputs.items()}
    out = budget_attention(**t, rule=rule, budget=7, **kw)
    return out, t


CASES = [("h2o", {}), ("snapkv", {"window": 5}), ("tova", {}), ("expected_attention", {"n_future_positions": 8}),
         ("streamingllm", {}), ("keydiff", {})]


@pytest.mark.parametrize("sliding", [0, 6])
@pytest.mark.parametrize("block", [2, 4, 7, 22])
@pytest.mark.parametrize("rule, params", CASES)
def test_blocks_equal_one_block(rule, params, block, sliding):
    """Any block size gives the one-block result: outputs, the kept set, and every slot tensor (float64)."""
    inputs = _call()
    r = rules.get(rule, **params)
    window = r.window or 32
    ref, ref_t = _run(inputs, r, window=window, sliding=sliding, block=10_000)
    out, t = _run(inputs, r, window=window, sliding=sliding, block=block)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(t["pos_slots"], ref_t["pos_slots"])
    for name in ("k_slots", "v_slots", "state", "norms", "totals"):
        torch.testing.assert_close(t[name], ref_t[name], rtol=1e-12, atol=1e-12, msg=name)
    # Pads ask nothing: their output rows are exactly zero, and they are never kept.
    assert torch.equal(out[1, :, :4], torch.zeros_like(out[1, :, :4]))
    assert not bool((t["pos_slots"] == -1).logical_and(ref_t["pos_slots"] != -1).any())


def test_block_signals_match_direct_sums():
    """The weighted sums (all queries, the observation window, the last query) are the direct sums of the exact
    softmax probabilities, per candidate; pads count nowhere."""
    inputs = _call(S=4, held=4, n=9, left_pads=(0, 2))
    w = 3
    res = measure(*(inputs[k] for k in ("q", "k_slots", "v_slots", "pos_slots", "state", "norms", "k_new", "v_new",
                                         "new_pos", "inv_freq")), window=w, sliding=0, scale=None, block=2)
    sig = dict(zip(SIGNAL_NAMES, res[2:]))
    b, h, g, n = 2, 2, 3, 9
    keys = torch.cat([inputs["k_slots"], inputs["k_new"]], dim=2)
    pos = sig["pos"]
    q = inputs["q"].view(b, h, g, n, -1)
    logits = q @ keys.unsqueeze(2).transpose(-1, -2) / math.sqrt(8)
    qpos = inputs["new_pos"].view(b, 1, 1, n, 1)
    vis = (pos.view(b, h, 1, 1, -1) >= 0) & (pos.view(b, h, 1, 1, -1) <= qpos)
    p = torch.softmax(logits.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0)  # pad rows: all masked
    valid = inputs["new_pos"] >= 0
    last = inputs["new_pos"].amax(-1, keepdim=True)
    for name, rows in (("attn", valid), ("window_attn", valid & (inputs["new_pos"] > last - w)),
                       ("last_attn", inputs["new_pos"] == last)):
        expect = (p * rows.view(b, 1, 1, n, 1)).sum(dim=(2, 3))
        torch.testing.assert_close(sig[name], expect, rtol=1e-12, atol=1e-12, msg=name)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("sliding", [0, 64])
def test_temporaries_are_bounded_by_the_block(sliding):
    """A one-call prefill of n tokens never materializes [queries x candidates]: the largest tensor the kernel creates
    is O(block x candidates) (and O(block x (slots + sliding + block)) on a sliding layer)."""
    b, h, g, S, n, d, block = 1, 2, 4, 16, 1024, 8, 32
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in _call(b, h, g, S, 0, n, d, (0,)).items()}
    sizes = {}
    for blk in (block, n):
        with _LargestTensor() as mode:
            _run(inputs, rules.get("snapkv"), sliding=sliding, block=blk)
        sizes[blk] = mode.largest
    visible = S + (sliding + block if sliding else n)
    io = max(b * h * g * n * d, b * h * 3 * (S + n) * 4)  # the call's own queries and per-candidate signals
    assert sizes[block] <= max(b * h * g * block * visible, io)
    assert sizes[n] >= b * h * g * n * n // 2  # one block: quadratic (the check above can fail)


def _trace_inputs(n, block, sliding=0):
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in _call(n=n, left_pads=(0, 3)).items()}
    return inputs, trace_kernel(inputs, rules.get("h2o"), budget=7, keep=7, sliding=sliding, window=4, scale=None,
                                block=block)


@pytest.mark.parametrize("sliding", [0, 6])
def test_traced_scan_equals_eager_loop(sliding):
    """The graph pass traces measure's blocks as one scan; run on real tensors it equals the eager Python loop."""
    inputs, kt = _trace_inputs(29, 4, sliding)
    args = [inputs[k] for k in ("q", "k_slots", "v_slots", "pos_slots", "state", "norms", "k_new", "v_new",
                                "new_pos", "inv_freq")]
    traced = kt.measure(*args)
    eager = measure(*args, window=4, sliding=sliding, scale=None, block=4)
    for name, a, e in zip(("out", "totals", *SIGNAL_NAMES), traced, eager):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=name)


def test_traced_graph_does_not_grow_with_the_call():
    """The compiled measure phase holds one block's ops whatever n (a scan), not an unrolled loop."""
    def count(gm):
        return sum(1 for _ in gm.graph.nodes) + sum(count(m) for m in gm.children() if isinstance(m, torch.fx.GraphModule))

    sizes = {n: count(_trace_inputs(n, 4)[1].measure) for n in (9, 29, 61)}
    assert len(set(sizes.values())) == 1, sizes
    assert any(n.target is torch.ops.higher_order.scan for n in _trace_inputs(9, 4)[1].measure.graph.nodes)


def test_bad_block():
    model = tiny_model("llama")
    for block in (0, 1, -2, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"block must be None \(automatic\) or an int >= 2"):
            fxbudget.compile(model, budget=8, block=block)
        assert "forward" not in vars(model)
    inputs = _call()
    before = {k: v.clone() for k, v in inputs.items()}
    with pytest.raises(ValueError, match=r"block must be None \(automatic\) or an int >= 2"):
        budget_attention(**inputs, rule=rules.get("h2o"), budget=7, block=0)
    assert all(torch.equal(inputs[k], before[k]) for k in inputs)  # a refused call changes nothing


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_model_in_blocks_equals_one_block(backend):
    """On a model with sliding layers, a one-call prefill in blocks of 5 equals one block: logits and kept tokens."""
    model = tiny_model("gemma3")
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, ref_cache = greedy(fxbudget.compile(fresh(model), rule="snapkv", budget=12, backend=None, window=4,
                                                 block=1024), ids, 4)
        got, cache = greedy(fxbudget.compile(fresh(model), rule="snapkv", budget=12, backend=backend, window=4,
                                             block=5), ids, 4)
    assert (got - ref).abs().max().item() <= 1e-5
    for i in range(len(cache.layers)):
        assert torch.equal(cache.positions(i), ref_cache.positions(i)), i


@pytest.mark.inductor
def test_inductor_blocks_equal_eager():
    """Inductor compiles the scan (a while_loop with data-dependent block bounds) to the eager loop's result."""
    model = tiny_model("gemma3")
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, ref_cache = greedy(fxbudget.compile(fresh(model), rule="h2o", budget=12, backend=None, block=7), ids, 2)
        got, cache = greedy(fxbudget.compile(fresh(model), rule="h2o", budget=12, backend="inductor", block=7), ids, 2)
    assert (got - ref).abs().max().item() <= 1e-4
    for i in range(len(cache.layers)):
        assert torch.equal(cache.positions(i), ref_cache.positions(i)), i


def test_auto_block():
    """The default block keeps a block's [queries x new tokens] buffer cache-sized on CPU (8 MB) and large on an
    accelerator; it is a power of two in [16, 1024] and depends on the call only (never on the slots or the rule)."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert [auto_block(14, n, cpu) for n in (1, 2048, 4096, 8192, 131072)] == [1024, 64, 32, 16, 16]
    assert [auto_block(14, n, gpu) for n in (2048, 32768, 131072)] == [1024, 512, 128]
    for n in (1, 100, 5000, 70000):
        blk = auto_block(14, n, cpu)
        assert 16 <= blk <= 1024 and blk & (blk - 1) == 0
        assert blk == 16 or 14 * blk * n * 4 <= 8 * 2**20
