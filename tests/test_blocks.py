"""The measure phase in query blocks (issue 9): the same results as one block, bounded temporaries, one graph."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxbudget
from fxbudget import rules
from fxbudget.kernel import budget_attention
from fxbudget.kernel import MARKER_TENSORS, TOTALED, LayerConstants, LayerSlots, NewTokens, auto_block, measure
from fxbudget.kernel.attention import Block
from fxbudget.kernel.signals import out_projection_factors, value_out_norms
from fxbudget.kernel.state import SIGNAL_NAMES, SLOT_FIELDS, marker_tensors
from fxbudget.passes.sdpa import trace_kernel
from torch.utils import _pytree as pytree
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import COMMON, fresh, greedy, tiny_model
from host_sync import HostSyncError, NoHostSync, graph_host_syncs

F64 = dict(dtype=torch.float64)


def kernel_args(inputs):
    """A `_call`'s loose tensors as the kernel's named state: `(q, LayerSlots, NewTokens, LayerConstants)`."""
    owner = torch.arange(inputs["k_slots"].shape[1], dtype=torch.int32).view(1, -1, 1).expand(
        inputs["pos_slots"].shape).contiguous()
    return (inputs["q"], LayerSlots(inputs["k_slots"], inputs["v_slots"], inputs["pos_slots"], inputs["state"],
                                    inputs["norms"], inputs["totals"], owner),
            NewTokens(inputs["k_new"], inputs["v_new"], inputs["new_pos"]),
            LayerConstants(inputs["inv_freq"], inputs["wo"]))


def run_measure(inputs, **kw):
    """Eager `measure` of a `_call`: `[out, totals, *signals]` (signals in `SIGNAL_NAMES` order)."""
    out, totals, signals = measure(*kernel_args(inputs), **kw)
    return [out, totals, *signals.values()]


def trace(inputs, rule, **kw):
    """`trace_kernel` of a `_call` (the marker's tensor names, as the pass sees them)."""
    q, slots, new, const = kernel_args(inputs)
    return trace_kernel({**dict(zip(MARKER_TENSORS, marker_tensors(slots, new, const))), "q": q}, rule, **kw)


def run_traced_measure(kt, inputs):
    """The traced measure phase run on a `_call`'s tensors: `[out, totals, *signals]`, as `run_measure`."""
    out, totals, signals = kt.measure(*pytree.tree_flatten(kernel_args(inputs))[0])
    return [out, totals, *signals.values()]



def _call(b=2, h=2, g=3, S=7, held=3, n=23, d=8, left_pads=(0, 4), seed=0):
    """Random kernel inputs: `held` filled slots of `S`, then a call of `n` tokens, row i left-padded by
    `left_pads[i]` (positions -1; valid positions continue from `held`)."""
    gen = torch.Generator().manual_seed(seed)
    k_slots, v_slots = torch.randn(b, h, S, d, generator=gen, **F64), torch.randn(b, h, S, d, generator=gen, **F64)
    pos_slots = torch.full((b, h, S), -1, dtype=torch.long)
    pos_slots[..., :held] = torch.arange(held)
    state = torch.rand(b, h, S, generator=gen, **F64) * (pos_slots >= 0)
    wo = wo_weight(h, g, d)
    norms = torch.stack([k_slots.norm(dim=-1), v_slots.norm(dim=-1), wov_reference(v_slots, wo, g)], dim=-1) \
        * (pos_slots >= 0).unsqueeze(-1)
    new_pos = torch.stack([torch.cat([torch.full((p,), -1), torch.arange(held, held + n - p)]) for p in left_pads])
    return dict(q=torch.randn(b, h * g, n, d, generator=gen, **F64), k_slots=k_slots, v_slots=v_slots,
                pos_slots=pos_slots, state=state, norms=norms, totals=torch.zeros(b, h, len(TOTALED), **F64),
                k_new=torch.randn(b, h, n, d, generator=gen, **F64), v_new=torch.randn(b, h, n, d, generator=gen, **F64),
                new_pos=new_pos, inv_freq=1.0 / 10000 ** (torch.arange(0, d, 2, **F64) / d),
                wo=out_projection_factors(wo, h, d))


def wo_weight(h, g, d, hidden=5, seed=99):
    """An output projection `[hidden, h * g * d]` (float64), by default to a hidden size below the head dim."""
    return torch.randn(hidden, h * g * d, generator=torch.Generator().manual_seed(seed), **F64)


def wov_reference(v, wo, g):
    """||W_o^(j) v||_2 averaged over the group's query heads j, from the weight itself, one head at a time."""
    b, h, n, d = v.shape
    per_head = wo.t().reshape(h * g, d, wo.shape[0])  # query head i*g+j: rows of W_o^T
    norms = torch.stack([(v[:, i // g] @ per_head[i]).norm(dim=-1) for i in range(h * g)], dim=1)
    return norms.view(b, h, g, n).mean(dim=2)


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


@pytest.mark.parametrize("sliding", [0, 3])  # 3: the window's band of new tokens (5) is shorter than the call (9)
def test_block_signals_match_direct_sums(sliding):
    """The weighted sums (all queries, the observation window, the last query) are the direct sums of the exact
    softmax probabilities, per candidate, and `window_max_attn` their max over the window; pads count nowhere."""
    inputs = _call(S=4, held=4, n=9, left_pads=(0, 2))
    w = 3
    sig = measure(*kernel_args(inputs), window=w, sliding=sliding, scale=None, block=2)[2]
    b, h, g, n = 2, 2, 3, 9
    keys = torch.cat([inputs["k_slots"], inputs["k_new"]], dim=2)
    pos = sig["pos"]
    q = inputs["q"].view(b, h, g, n, -1)
    logits = q @ keys.unsqueeze(2).transpose(-1, -2) / math.sqrt(8)
    qpos = inputs["new_pos"].view(b, 1, 1, n, 1)
    vis = (pos.view(b, h, 1, 1, -1) >= 0) & (pos.view(b, h, 1, 1, -1) <= qpos)
    if sliding:
        vis &= pos.view(b, h, 1, 1, -1) > qpos - sliding
    p = torch.softmax(logits.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0)  # pad rows: all masked
    valid = inputs["new_pos"] >= 0
    last = inputs["new_pos"].amax(-1, keepdim=True)
    for name, rows in (("attn", valid), ("window_attn", valid & (inputs["new_pos"] > last - w)),
                       ("last_attn", inputs["new_pos"] == last)):
        expect = (p * rows.view(b, 1, 1, n, 1)).sum(dim=(2, 3))
        torch.testing.assert_close(sig[name], expect, rtol=1e-12, atol=1e-12, msg=name)
    # The max over the window's queries and the group's query heads (pads count nowhere; empty slots get 0).
    rows = valid & (inputs["new_pos"] > last - w)
    expect = (p * rows.view(b, 1, 1, n, 1)).amax(dim=(2, 3))
    torch.testing.assert_close(sig["window_max_attn"], expect, rtol=1e-12, atol=1e-12)
    assert bool((sig["window_max_attn"] < sig["window_attn"] - 1e-9).any())  # a max, not the sum
    # |W_o v|_2: the stored norms for slots, measured for the new tokens.
    values = torch.cat([inputs["v_slots"], inputs["v_new"]], dim=2)
    torch.testing.assert_close(sig["wov_norm"], wov_reference(values, wo_weight(h, g, 8), g), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("sliding", [0, 3])
@pytest.mark.parametrize("w", [1, 3, 9])
def test_window_max_is_the_same_in_any_block(w, sliding):
    """window_max_attn is read off the blocks holding the window's rows: the same whatever the query block (one
    block, or a window split over blocks, some of which skip new tokens they cannot see)."""
    inputs = _call(S=4, held=4, n=9, left_pads=(0, 2))
    ref = measure(*kernel_args(inputs), window=w, sliding=sliding, scale=None, block=10_000)[2]
    assert bool((ref["window_max_attn"] > 0).any())
    for blk in (2, 4):
        got = measure(*kernel_args(inputs), window=w, sliding=sliding, scale=None, block=blk)[2]
        torch.testing.assert_close(got["window_max_attn"], ref["window_max_attn"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hidden", [5, 40])  # below and above the head dim (8)
def test_wov_from_the_factors_is_the_weight_norm(hidden):
    """`||R v||_2` with the factors laid out once equals `||W_o^(j) v||_2` computed from the weight (float64);
    the factors are computed once per weight and again after an in-place change of it."""
    h, g, d = 2, 3, 8
    w = wo_weight(h, g, d, hidden=hidden)
    v = torch.randn(2, h, 7, d, generator=torch.Generator().manual_seed(1), **F64)
    factors = out_projection_factors(w, h, d)
    assert factors.shape == (h, d, g * d)
    torch.testing.assert_close(value_out_norms(v, factors, torch.float64), wov_reference(v, w, g), rtol=1e-12,
                               atol=1e-12)
    assert out_projection_factors(w, h, d) is factors
    w.mul_(2)
    torch.testing.assert_close(value_out_norms(v, out_projection_factors(w, h, d), torch.float64),
                               2 * wov_reference(v, w / 2, g), rtol=1e-12, atol=1e-12)


def test_right_padded_call_is_refused():
    """The window is the call's last queries: pads after a row's tokens are refused (eager), not scored wrong."""
    inputs = _call(S=4, held=4, n=9, left_pads=(0, 2))
    inputs["new_pos"][1] = torch.cat([torch.arange(4, 11), torch.full((2,), -1)])
    with pytest.raises(ValueError, match=r"new_pos: pads \(-1\) must come before a row's tokens"):
        _run(inputs, rules.get("h2o"), window=3)


def test_compiled_norms_equal_eager():
    """On a model compiled by the graph pass (aot_eager), the stored norms (wov_norm's column included) and the
    outputs equal the eager kernel's. signals='all': h2o's own signal set does not read wov_norm, so its column would
    stay empty (tests/test_signal_set.py)."""
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(4))
    runs = []
    for backend in (None, "aot_eager"):
        m = fxbudget.compile(fresh(model), rule="h2o", budget=12, backend=backend, signals="all")
        cache = m.forward.new_cache(1)
        with torch.no_grad():
            logits = m(input_ids=ids, past_key_values=cache).logits
        runs.append((logits, [layer.norms.clone() for layer in cache.layers], cache.positions(0)))
    (l0, n0, p0), (l1, n1, p1) = runs
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert torch.equal(p0, p1)
    for a, b in zip(n0, n1):
        assert bool((a[..., 2] > 0).any())
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


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


def _trace_inputs(n, block, sliding=0, h=2, g=3):
    inputs = {k: v.float() if v.is_floating_point() else v
              for k, v in _call(h=h, g=g, n=n, left_pads=(0, 3)).items()}
    return inputs, trace(inputs, rules.get("h2o"), budget=7, keep=7, sliding=sliding, window=4, scale=None,
                         block=block)




@pytest.mark.parametrize("h, g", [(2, 3), (1, 6)])  # GQA, and one KV head (MQA)
@pytest.mark.parametrize("sliding", [0, 6])
def test_traced_scan_equals_eager_loop(sliding, h, g):
    """The graph pass traces measure's blocks as one scan; run on real tensors it equals the eager Python loop."""
    inputs, kt = _trace_inputs(29, 4, sliding, h, g)
    traced = run_traced_measure(kt, inputs)
    eager = run_measure(inputs, window=4, sliding=sliding, scale=None, block=4)
    for name, a, e in zip(("out", "totals", *SIGNAL_NAMES), traced, eager):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=name)


def _count(gm):
    return sum(1 for _ in gm.graph.nodes) + sum(_count(m) for m in gm.children() if isinstance(m, torch.fx.GraphModule))


@pytest.mark.parametrize("h, g", [(2, 3), (1, 6)])
@pytest.mark.parametrize("sliding", [0, 6])
def test_traced_graph_does_not_grow_with_the_call(sliding, h, g):
    """The compiled measure phase holds a bounded number of block bodies whatever n (scans), not an unrolled loop:
    the same graph once a full layer has its `SCAN_LEVELS` levels (from 64 blocks on), fewer levels below."""
    sizes = {n: _count(_trace_inputs(n, 4, sliding, h, g)[1].measure) for n in (9, 29, 253, 509, 1021)}
    assert len({sizes[n] for n in (253, 509, 1021)}) == 1, sizes
    assert sizes[9] <= sizes[29] <= sizes[253], sizes
    assert any(n.target is torch.ops.higher_order.scan for n in _trace_inputs(9, 4)[1].measure.graph.nodes)


@pytest.mark.parametrize("h, g", [(2, 3), (1, 6)])
@pytest.mark.parametrize("sliding", [0, 6, 40])  # 40: the band covers the whole call
def test_query_block_has_no_host_sync(sliding, h, g):
    """Nothing in a query block (the scan body) nor elsewhere in the traced kernel reads a tensor back to the host:
    no `.item()`/`.tolist()`, no data-dependent branch, no unbacked (data-dependent) size; run on real tensors, the
    traced measure phase syncs nothing either."""
    inputs, kt = _trace_inputs(29, 4, sliding, h, g)
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    scans = [n for n in kt.measure.graph.nodes if n.target is torch.ops.higher_order.scan]
    assert len(scans) == 1  # 8 blocks: a band scan, or one level (`test_block_scan` checks the levels' graphs)
    for phase in (kt.measure, kt.rule, kt.evict):
        assert graph_host_syncs(phase) == []
    b, n, d = 2, 29, 8
    qpos = inputs["new_pos"].to(torch.int32)
    blk = Block(inputs["k_slots"], inputs["v_slots"], inputs["pos_slots"].to(torch.int32), inputs["k_new"],
                 inputs["v_new"], qpos.unsqueeze(1), 0.3, sliding, torch.float32)
    queries = inputs["q"].reshape(b, h, g * n, d)
    with NoHostSync():
        blk(queries, qpos, torch.ones(b, 3, n), 0, n)


def test_host_sync_finder_sees_item():
    """The finder the test above relies on catches what the old scan body did (`.item()` block bounds)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxbudget.passes.sdpa import _trace

    def body(x, r):
        return x.narrow(0, r[0].item(), 2) * 2

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fakes = [torch.empty(8), torch.zeros(1, dtype=torch.long)]
    found = graph_host_syncs(_trace(body, fakes, mode))
    assert any("_local_scalar_dense" in f for f in found), found
    with pytest.raises(HostSyncError, match="tolist"), NoHostSync():
        torch.arange(3).tolist()


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


def _model(arch: str):
    """conftest's tiny models, plus "llama-mqa": tiny Llama with one KV head (a group of every query head)."""
    if arch != "llama-mqa":
        return tiny_model(arch)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **{**COMMON, "num_key_value_heads": 1})).eval()


@pytest.mark.inductor
# llama-mqa: 200 tokens run at the 224-token bucket, 28 blocks of 8 in 3 levels of the full-attention scan.
@pytest.mark.parametrize("arch, n, block", [("gemma3", 30, 7), ("llama-mqa", 200, 8)])
def test_inductor_blocks_equal_eager(arch, n, block):
    """Inductor compiles the scan over query blocks (several blocks; sliding and full layers; GQA and one KV head) to
    the eager loop's result: the prefill's logits and everything it leaves in the cache (a decode step after a
    compiled scan prefill: tests/test_exactness.py; here it would add a cold compile and check less)."""
    model = _model(arch)
    ids = torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, ref_cache = greedy(fxbudget.compile(fresh(model), rule="h2o", budget=12, backend=None, block=block),
                                ids, 0)
        got, cache = greedy(fxbudget.compile(fresh(model), rule="h2o", budget=12, backend="inductor", block=block),
                            ids, 0)
    assert (got - ref).abs().max().item() <= 1e-4
    # Every tensor of the layer state (`SLOT_FIELDS`; integer ones exactly) but `totals` (stored to keep every signal
    # live, read by no rule): the compiled call runs at its shape bucket, 2 pads longer, and its `pos` total counts
    # their -1s.
    for i, (a, b) in enumerate(zip(ref_cache.layers, cache.layers)):
        for name in (f for f in SLOT_FIELDS if f != "totals"):
            got_t, ref_t = getattr(b, name), getattr(a, name)
            if ref_t.is_floating_point():
                torch.testing.assert_close(got_t, ref_t, rtol=1e-4, atol=1e-5, msg=f"layer {i} {name}")
            else:
                assert torch.equal(got_t, ref_t), f"layer {i} {name}"


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
