"""No host sync in a decode step's compiled region (issue 20 item 3), and how many the whole step has.

A host sync is a read of a device value on the host (`.item()`, `bool()`, `int()`, `.tolist()`, `torch.equal`, a
data-dependent branch or output size): on an accelerator it waits for the queue to drain. Counted two ways:
- the compiled regions: their rewritten graphs (every node, scan bodies included) hold no op that reads back
  (`SYNC_OPS`), and Dynamo's `fullgraph=True` refuses a data-dependent branch; checked, and shown to catch
  `.item()`, `.tolist()` and a branch injected into the decode step;
- the whole step, compiled regions included: every Python entry point that reads back (`SYNC_METHODS`) counted while
  the step runs (compiled code calls none of them), and for the eager path (no regions) also every aten op that
  reads back, at the dispatcher.
(tests/host_sync.py, the kernel engineer's helper for query blocks, did not exist when this was written.)
"""

import contextlib

import pytest
import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

import fxbudget
from conftest import fresh, tiny_model
from fxbudget.cache import BudgetLayer

SYNC_OPS = {"aten._local_scalar_dense", "aten.item", "aten.equal", "aten.is_nonzero", "aten.nonzero",
            "aten.masked_select", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim", "aten.tolist"}
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


def _op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return f"aten.{t}" if node.op == "call_method" else t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"aten.{t.__name__.split('.')[0]}" if isinstance(t, torch._ops.OpOverload) else str(t)
    return f"aten.{getattr(t, '__name__', str(t))}"


def sync_nodes(gm: fx.GraphModule) -> list[str]:
    """The nodes of `gm` (and of its subgraphs: a scan's body) that read a device value back on the host."""
    found = [_op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method") and
             (_op_name(n) in SYNC_OPS or (n.op == "call_method" and n.target in SYNC_METHODS))]
    for n in gm.graph.nodes:
        sub = getattr(gm, n.target) if n.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            found += sync_nodes(sub)
    return found


def decode_graph_syncs(model, steps: int = 2) -> list[str]:
    """Compile `model` (aot_eager), prefill 12 tokens and decode `steps` tokens with the mask generate() passes;
    the host syncs of the decode graphs, or the graph break Dynamo refused as one."""
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=8, backend="aot_eager")
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            cache = m(input_ids=ids).past_key_values
            for i in range(steps):
                m(input_ids=ids[:, -1:], past_key_values=cache, attention_mask=torch.ones(1, 13 + i, dtype=torch.long))
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        return [f"graph break: {str(e).splitlines()[0]}"]
    decode = [gm for gm in m.forward.graphs
              if next(n for n in gm.graph.nodes if n.op == "placeholder").meta["example_value"].shape[1] == 1]
    assert decode, "no decode graph was compiled"
    return [s for gm in decode for s in sync_nodes(gm)]


def test_decode_graph_has_no_host_sync():
    assert decode_graph_syncs(tiny_model("qwen3")) == []


@pytest.mark.parametrize("kind", ["item", "tolist", "branch"])
def test_host_sync_in_the_decode_step_is_caught(kind, monkeypatch):
    # The check above can fail: a read-back injected into the decode step's region (the marker call of every layer).
    mark = BudgetLayer.mark

    def synced(self, k, v, layer):
        if k.shape[2] == 1:  # the decode step only (a static shape: no branch on data here)
            if kind == "item":
                k = k + 0 * k.sum().item()
            elif kind == "tolist":
                k = k + 0 * torch.tensor(k.sum().tolist())
            elif k.sum() > 0:  # a data-dependent branch
                k = k + 0
        return mark(self, k, v, layer)

    monkeypatch.setattr(BudgetLayer, "mark", synced)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # .item() may then enter the graph: still caught
        assert decode_graph_syncs(tiny_model("qwen3")) != []


class _DispatchSyncs(TorchDispatchMode):
    """Counts aten ops that read back (eager code only: Dynamo does not run compiled code under a dispatch mode)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if f"aten.{func.__name__.split('.')[0]}" in SYNC_OPS:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def python_syncs():
    """Counts calls of the Python entry points that read a tensor back (`SYNC_METHODS`, `torch.equal`)."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    equal = torch.equal

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, counting(name, fn))
        torch.equal = counting("equal", equal)
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.equal = equal


def step_syncs(backend, mask: bool, arch: str = "qwen3") -> tuple[list[str], list[str]]:
    """Host syncs of one warm decode step: (Python entry points, aten ops at the dispatcher; eager only)."""
    model = tiny_model(arch)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=8, backend=backend)
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = lambda i: {"attention_mask": torch.ones(1, 13 + i, dtype=torch.long)} if mask else {}  # noqa: E731
    with torch.no_grad():
        cache = m(input_ids=ids).past_key_values
        m(input_ids=ids[:, -1:], past_key_values=cache, **kw(0))  # warm: the decode graph is compiled
        graphs = len(m.forward.graphs)
        with python_syncs() as calls:
            m(input_ids=ids[:, -1:], past_key_values=cache, **kw(1))
        ops = []
        if backend is None:
            with _DispatchSyncs() as mode:
                m(input_ids=ids[:, -1:], past_key_values=cache, **kw(2))
            ops = mode.ops
    assert len(m.forward.graphs) == graphs  # nothing recompiled while counting
    return calls, ops


@pytest.mark.parametrize("mask", [False, True])
def test_compiled_decode_step_has_no_host_sync(mask):
    # The mask generate() passes every step is not read back in a decode step (fxbudget.compiler.positions).
    calls, _ = step_syncs("aot_eager", mask)
    assert calls == []


@pytest.mark.parametrize("mask", [False, True])
def test_eager_decode_step_syncs_once_per_layer_in_the_kernel_only(mask):
    # The eager kernel (backend=None) skips an empty cache's slots: one read-back per layer, in the kernel's measure
    # phase (kernel.py); nothing from the forward's own code (positions, admit), with or without a mask.
    calls, ops = step_syncs(None, mask)
    layers = tiny_model("qwen3").config.num_hidden_layers
    assert calls == ["__bool__"] * layers
    assert ops == ["_local_scalar_dense.default"] * layers


def test_a_prefill_without_a_cache_reads_the_rope_once(monkeypatch):
    # Each call without a cache builds one (model_cache), which takes the model's RoPE frequencies: read back from the
    # device (a copy to the CPU, a sync on a GPU) once per model and rotary state, not once per call.
    from fxbudget.cache import rope as model_rope

    reads = []
    real = model_rope._layer_rope
    monkeypatch.setattr(model_rope, "_layer_rope", lambda *a: reads.append(1) or real(*a))
    m = fxbudget.compile(fresh(tiny_model("qwen3")), rule="snapkv", budget=8, backend=None)
    ids = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(input_ids=ids)
        first = len(reads)
        m(input_ids=ids)
        assert first > 0 and len(reads) == first
        # A changed rotary buffer is read again, and the new cache holds the new frequencies.
        rot = model_rope.rotary_modules(m)[0][1]
        rot.inv_freq.mul_(0.5)
        cache = m(input_ids=ids).past_key_values
    assert len(reads) > first
    assert torch.equal(cache.layers[0].inv_freq, rot.inv_freq.float())
