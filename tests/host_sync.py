"""Find host syncs in traced graphs and in eager code: reusable by any test (query blocks, decode steps).

A host sync is any value read back from a tensor to Python: `.item()`, `.tolist()`, `int()`/`bool()` of a tensor
(a data-dependent branch), `torch.equal`. In a traced graph (make_fx / aot) they show up as `_local_scalar_dense`
(each element of `.tolist()` is one), as unbacked symbols (`u0`, ...) in the shapes or values the graph computes, or as
the asserts a `torch._check` on them leaves; in Dynamo graphs as `item`/`tolist` methods. Eagerly every one of them
reaches the dispatcher as `aten._local_scalar_dense` (or `aten.equal`), which `NoHostSync` refuses.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {"_local_scalar_dense", "item", "tolist", "equal", "_assert_scalar", "sym_constrain_range",
             "sym_constrain_range_for_size", "nonzero", "is_nonzero"}
_SYNC_METHODS = {"item", "tolist", "__bool__", "__int__", "__float__", "nonzero"}


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _graphs(gm: fx.GraphModule, prefix: str = ""):
    """`gm` and every graph nested in it (a higher-order op's body: scan, while_loop, cond), with a path name."""
    yield prefix or "<root>", gm
    for name, sub in gm.named_children():
        if isinstance(sub, fx.GraphModule):
            yield from _graphs(sub, f"{prefix}.{name}" if prefix else name)


def graph_host_syncs(gm: fx.GraphModule) -> list[str]:
    """Every node of `gm` and its nested graphs that reads a tensor back to the host or computes an unbacked
    (data-dependent) size or value, as `"<graph>: <node> (<why>)"`; empty when there is none.

    Args:
        gm: a traced graph module (make_fx, aot or Dynamo).
    Returns:
        One line per offending node.
    """
    found = []
    for where, g in _graphs(gm):
        for node in g.graph.nodes:
            why = None
            if node.op == "call_function" and _op_name(node.target) in _SYNC_OPS:
                why = _op_name(node.target)
            elif node.op == "call_method" and node.target in _SYNC_METHODS:
                why = node.target
            else:
                val = node.meta.get("val", node.meta.get("example_value"))
                try:
                    unbacked = free_unbacked_symbols(val) if val is not None else set()
                except Exception:  # values free_unbacked_symbols cannot walk hold no symbols
                    unbacked = set()
                if unbacked:
                    why = f"unbacked {sorted(map(str, unbacked))}"
            if why:
                found.append(f"{where}: {node.name} ({why})")
    return found


class HostSyncError(RuntimeError):
    """A tensor value was read back to the host inside `NoHostSync`."""


class _SyncOps(TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _op_name(func) in ("_local_scalar_dense", "equal", "nonzero", "is_nonzero"):
            self.seen(f"aten.{_op_name(func)}")
        return func(*args, **(kwargs or {}))


class _ToList(TorchFunctionMode):  # `.tolist()` reads memory without dispatching an op
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.seen("Tensor.tolist")
        return func(*args, **(kwargs or {}))


class NoHostSync:
    """Inside `with NoHostSync():`, raise `HostSyncError` on the first tensor read back to the host (`.item()`,
    `.tolist()`, `bool(t)`, `int(t)`, `torch.equal`, `nonzero`). With `allowed=True` count them instead (`count`,
    `ops`: what each one was)."""

    def __init__(self, allowed: bool = False):
        self.allowed, self.ops = allowed, []
        self._modes = [_ToList(self._seen), _SyncOps(self._seen)]

    @property
    def count(self) -> int:
        return len(self.ops)

    def _seen(self, what: str) -> None:
        self.ops.append(what)
        if not self.allowed:
            raise HostSyncError(f"host sync: {what}")

    def __enter__(self):
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False
