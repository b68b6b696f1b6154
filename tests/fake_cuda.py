"""Inductor's CUDA lowering on a machine without a GPU: every patch that makes torch and Triton believe an sm_80 or
sm_90 device exists, in one place, pinned to one torch/Triton pair (`PINNED`).

`lower(gm, example_inputs, sm=...)` runs `compile_fx` on a graph whose inputs are fake CUDA tensors: Inductor writes
the Triton source (`Lowered.source`) and Triton with its bundled ptxas compiles every kernel's every autotuning
config to a cubin for that sm (`Lowered.cubins`); only loading onto a device (the launchers) is skipped. What it
proves and what not: docs/gpu-internals.md.

The patches reach private internals of torch and Triton. They are applied only inside `fake_gpu(...)` and undone on
exit, and they are checked before any is applied: another torch or Triton than `PINNED`, or a patch target that
moved, raises `FakeCudaError` naming it (never a skip). To move the pair: install the new torch, run
`make test-cuda-codegen`, fix each named target against the new sources, then move `PINNED` (docs/gpu-internals.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import tempfile
import types

import torch

# The one torch/Triton pair these patches were written against (torch's local version, "+cu130", is ignored).
PINNED = ("2.14.1", "3.8.0")

# sm -> the device properties Inductor reads (an H100 SXM and an A100 SXM 80 GB).
_COMMON = dict(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
               warp_size=32, shared_memory_per_block=49152, gcnArchName="", is_integrated=False,
               memory_bus_width=5120, total_memory=80 * 2**30)
PROPS = {
    90: types.SimpleNamespace(name="fake sm_90 (H100)", major=9, minor=0, multi_processor_count=132,
                              shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
                              L2_cache_size=50 * 2**20, clock_rate=1980000, memory_clock_rate=2619000,
                              uuid="fake-sm90", **_COMMON),
    80: types.SimpleNamespace(name="fake sm_80 (A100)", major=8, minor=0, multi_processor_count=108,
                              shared_memory_per_block_optin=166912, shared_memory_per_multiprocessor=167936,
                              L2_cache_size=40 * 2**20, clock_rate=1410000, memory_clock_rate=1593000,
                              uuid="fake-sm80", **_COMMON),
}

# Every attribute patched, as "module:object.attribute" (checked to exist before anything is patched).
TARGETS = (
    "torch.cuda:get_device_properties", "torch.cuda:get_device_capability", "torch.cuda:current_device",
    "torch.cuda:device_count",
    # torch 2.14.1's rule with `torch.cuda.is_available()` true (it stays false here: making it true makes Dynamo
    # and Inductor initialize the missing driver): bf16 scatter-adds fall back to ATen below sm_90.
    "torch._inductor.utils:needs_fallback_due_to_atomic_add_limitations",
    "torch._inductor.lowering:needs_fallback_due_to_atomic_add_limitations",
    "torch._inductor.decomposition:needs_fallback_due_to_atomic_add_limitations",
    "torch._dynamo.device_interface:CudaInterface.get_device_properties",
    "torch._dynamo.device_interface:CudaInterface.Worker.get_device_properties",
    "torch._dynamo.device_interface:CudaInterface.Worker.current_device",
    "torch._dynamo.device_interface:CudaInterface.current_device",
    "torch._dynamo.device_interface:CudaInterface.device_count",
    "torch._dynamo.device_interface:CudaInterface.is_available",
    "torch._dynamo.device_interface:CudaInterface.get_compute_capability",
    "torch._dynamo.device_interface:CudaInterface.is_triton_capable",
    "torch._dynamo.device_interface:CudaInterface.raise_if_triton_unavailable",
    "torch._dynamo.device_interface:CudaInterface.is_bf16_supported",
    "torch._inductor.runtime.triton_helpers:set_driver_to_gpu",
    "torch._inductor.graph:GraphLowering.save_output_code",
    "torch._inductor.runtime.triton_heuristics:CachingAutotuner._make_launchers",
    "torch._inductor.runtime.triton_heuristics:CachingAutotuner._dynamic_scale_rblock",
    "torch._inductor.runtime.triton_heuristics:CachingAutotuner.precompile",
    "triton.runtime.driver:driver._default", "triton.runtime.driver:driver._active",
    # Read, not patched: the fake driver is built on them.
    "triton.backends.compiler:GPUTarget", "triton.backends.driver:DriverBase",
    "triton.backends.nvidia.driver:ty_to_cpp",
    "torch._inductor.compile_fx:compile_fx",
    "torch._inductor.runtime.hints:DeviceProperties.create",
)
# Modules whose functools caches remember the device (has_triton, DeviceProperties.create, the SM count, ...):
# cleared on entering and leaving `fake_gpu`, so neither the real machine's answers nor another sm's leak in.
CACHED_MODULES = ("torch.utils._triton", "torch._inductor.utils")
# Inductor settings for a run without a device: nothing may run a kernel or benchmark one.
INDUCTOR_CONFIG = {
    "joint_graph_constant_folding": False,  # constant folding runs kernels on the device
    "shape_padding": False,                 # pad_mm benchmarks matmuls on device tensors
    "max_autotune": False,                  # autotuning benchmarks
    "compile_threads": 1,                   # no worker pool (it would not see the patches)
    "fx_graph_cache": False,                # every run lowers for real: nothing is read from an earlier one
    "autotune_local_cache": False,
    "reorder_for_locality": False,
    "use_static_cuda_launcher": False,      # every compiled kernel keeps its cubin and target (asm, metadata)
    "use_static_triton_launcher": False,
}


class FakeCudaError(RuntimeError):
    """The installed torch/Triton is not the pinned pair, or a patch target moved."""


def installed_pair() -> tuple[str, str]:
    import triton

    return torch.__version__.split("+")[0], triton.__version__


def check_pinned() -> None:
    """Raise `FakeCudaError` unless the installed torch is a CUDA build of the pinned pair and every patch target
    exists (the first missing one named)."""
    pair = installed_pair() if importlib.util.find_spec("triton") else (torch.__version__.split("+")[0], None)
    if pair != PINNED:
        raise FakeCudaError(f"tests/fake_cuda.py is pinned to torch {PINNED[0]} / Triton {PINNED[1]}, found torch "
                            f"{pair[0]} / Triton {pair[1]}: check every target in TARGETS against the new sources, "
                            f"then move PINNED (docs/gpu-internals.md)")
    if torch.version.cuda is None:
        raise FakeCudaError(f"torch {torch.__version__} is a CPU build: the CUDA lowering needs the CUDA build "
                            f"(pip install torch=={PINNED[0]})")
    for target in TARGETS:
        _resolve(target)


def _resolve(target: str):
    """`(owner, attribute)` of a "module:obj.attr" target; `FakeCudaError` naming it if any part is missing."""
    module, path = target.split(":")
    try:
        owner = importlib.import_module(module)
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name)
        if not hasattr(owner, attr) and attr not in vars(owner):
            raise AttributeError(attr)
    except (ImportError, AttributeError) as e:
        raise FakeCudaError(f"fake CUDA patch target {target} is gone in torch {torch.__version__} ({e!r}): "
                            f"tests/fake_cuda.py needs updating for this torch/Triton pair") from None
    return owner, attr


def _clear_device_caches() -> None:
    from torch._inductor.runtime.hints import DeviceProperties

    for name in CACHED_MODULES:
        for obj in vars(importlib.import_module(name)).values():
            if callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()
    DeviceProperties.create.__func__.cache_clear()


@dataclasses.dataclass
class Cubin:
    kernel: str
    target: str  # e.g. "cuda:90"
    size: int    # bytes of the cubin


@dataclasses.dataclass
class Lowered:
    """One graph lowered for one sm: the output code, its Triton kernels, its calls outside Triton, the cubins."""

    sm: int
    source: list[str]
    kernels: list[str]
    externs: list[str]    # extern_kernels.* (cuBLAS matmuls and the like)
    fallbacks: list[str]  # aten / torch.ops calls: ops Inductor did not lower to Triton
    cubins: list[Cubin]


def _driver(sm: int):
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import ty_to_cpp

    return fake_driver("CUDA", GPUTarget("cuda", sm, 32), ty_to_cpp,
                       get_device_capability=lambda device=None: divmod(sm, 10))


def fake_driver(name: str, target, ty_to_cpp, **extra):
    """A Triton driver that reports `target` and one device (0), runs nothing and benchmarks nothing: what Triton and
    Inductor ask of the active driver while compiling. `name` ("CUDA", "HIP") names it in errors; `extra` are more
    attributes (the CUDA driver's `get_device_capability`)."""
    from triton.backends.driver import DriverBase

    class FakeDriver(DriverBase):
        def __init__(self):
            self.get_current_device = lambda: 0
            self.set_current_device = lambda d: None
            self.get_current_stream = lambda d=None: 0
            vars(self).update(extra)

        @staticmethod
        def is_active():
            return True

        def map_python_to_cpp_type(self, ty):
            return ty_to_cpp(ty)

        def get_current_target(self):
            return target

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            raise FakeCudaError(f"fake {name} driver: nothing can be benchmarked")

        def get_empty_cache_for_benchmark(self):
            raise FakeCudaError(f"fake {name} driver: nothing can be benchmarked")

    return FakeDriver()


@functools.cache
def _process_cache() -> str:
    """One fresh Inductor/Triton cache folder per process: a kernel two graphs share is compiled once, and nothing
    comes from an earlier run."""
    return tempfile.mkdtemp(prefix="fake-cuda-")


@contextlib.contextmanager
def fake_gpu(sm: int, *, cubins: bool = True, cache_dir: str | None = None):
    """Inside: torch, Dynamo, Inductor and Triton see one sm_`sm` CUDA device (`PROPS`). Yields a dict that
    collects the output code (`"source"`) and the compiled cubins (`"cubins"`). `cubins=False` stops at the Triton
    source. Every patch is undone on exit."""
    if sm not in PROPS:
        raise ValueError(f"sm must be one of {sorted(PROPS)}, got {sm!r}")
    check_pinned()
    props = PROPS[sm]

    def record(self, seen):  # each compiled config's cubin, instead of a launcher
        for r in self.compile_results:
            k = r.kernel
            target = getattr(getattr(k, "metadata", None), "target", None)
            seen["cubins"].append(Cubin(self.fn.__name__, f"{target.backend}:{target.arch}" if target else "?",
                                        len(getattr(k, "asm", {}).get("cubin", b""))))

    with patched(props, sm, _driver(sm), record, compiled=cubins, cache_dir=cache_dir) as seen:
        yield seen


@contextlib.contextmanager
def patched(props, capability, driver, record, *, compiled: bool = True,
            cache_dir: str | None = None, extra: dict | None = None):
    """The patches every fake device shares (`fake_gpu` here, `fake_hip.fake_gpu`): `props` as the one device's
    properties, `capability` what Dynamo's `get_compute_capability` answers, `driver` as Triton's active driver,
    `record(autotuner, seen)` in place of building launchers; `extra` ("module:obj.attr" -> value) the caller's own.
    Yields `seen` ({"source": [...], "cubins": [...]}); `compiled=False` stops at the Triton source."""
    import torch._inductor.config as icfg

    def atomic_add_fallback(dtype: torch.dtype) -> bool:  # torch's rule, read with the fake device's capability
        if dtype == torch.bfloat16:
            return (props.major, props.minor) < (9, 0)
        return dtype in (torch.int64, torch.bool)

    seen = {"source": [], "cubins": []}
    values = {
        **{f"torch._inductor.{m}:needs_fallback_due_to_atomic_add_limitations": atomic_add_fallback
           for m in ("utils", "lowering", "decomposition")},
        "torch.cuda:get_device_properties": lambda device=None: props,
        "torch.cuda:get_device_capability": lambda device=None: (props.major, props.minor),
        "torch.cuda:current_device": lambda: 0,
        "torch.cuda:device_count": lambda: 1,
        "torch._dynamo.device_interface:CudaInterface.get_device_properties": staticmethod(lambda device=None: props),
        "torch._dynamo.device_interface:CudaInterface.Worker.get_device_properties":
            staticmethod(lambda device=None: props),
        "torch._dynamo.device_interface:CudaInterface.Worker.current_device": staticmethod(lambda: 0),
        "torch._dynamo.device_interface:CudaInterface.current_device": staticmethod(lambda: 0),
        "torch._dynamo.device_interface:CudaInterface.device_count": staticmethod(lambda: 1),
        "torch._dynamo.device_interface:CudaInterface.is_available": staticmethod(lambda: True),
        "torch._dynamo.device_interface:CudaInterface.get_compute_capability":
            staticmethod(lambda device=None: capability),
        "torch._dynamo.device_interface:CudaInterface.is_triton_capable": staticmethod(lambda device=None: True),
        "torch._dynamo.device_interface:CudaInterface.raise_if_triton_unavailable":
            staticmethod(lambda device=None: None),
        "torch._dynamo.device_interface:CudaInterface.is_bf16_supported": staticmethod(lambda *a, **k: True),
        "torch._inductor.runtime.triton_helpers:set_driver_to_gpu": lambda: None,
        "torch._inductor.graph:GraphLowering.save_output_code": staticmethod(lambda code: seen["source"].append(code)),
        "torch._inductor.runtime.triton_heuristics:CachingAutotuner._make_launchers": lambda self: record(self, seen),
        "torch._inductor.runtime.triton_heuristics:CachingAutotuner._dynamic_scale_rblock": lambda self: None,
        "triton.runtime.driver:driver._default": driver,
        "triton.runtime.driver:driver._active": driver,
        **(extra or {}),
    }
    if not compiled:
        values["torch._inductor.runtime.triton_heuristics:CachingAutotuner.precompile"] = lambda self, *a, **k: None

    saved = []
    cache = cache_dir or _process_cache()
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"), "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    old_env = {k: os.environ.get(k) for k in env}
    try:
        for target, value in values.items():
            owner, attr = _resolve(target)
            saved.append((owner, attr, vars(owner)[attr] if attr in vars(owner) else getattr(owner, attr)))
            setattr(owner, attr, value)
        os.environ.update(env)
        _clear_device_caches()
        with icfg.patch(INDUCTOR_CONFIG):
            yield seen
    finally:
        _clear_device_caches()
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_KERNEL = re.compile(r"^(triton_\w+) = async_compile\.triton", re.M)
_EXTERN = re.compile(r"\b(extern_kernels\.\w+)\(")
_FALLBACK = re.compile(r"\b((?:torch\.ops\.)?aten\.\w+(?:\.\w+)?|torch\.ops\.(?!aten\.)\w+\.\w+(?:\.\w+)?)\(")


def fallbacks_of(source: str) -> list[str]:
    """The aten (and other registered) ops the output code calls: what Inductor left to ATen, sorted, unique,
    written `aten.<op>.<overload>`."""
    names = {m.removeprefix("torch.ops.") for m in _FALLBACK.findall(source)}
    return sorted(n if n.count(".") == 2 or not n.startswith("aten.") else n + ".default" for n in names)


def retarget(gm: torch.fx.GraphModule, device: str = "cuda:0") -> torch.fx.GraphModule:
    """`gm` (and its sub-graphs: a scan's body) with every `cpu` device argument replaced by `device`, in place.
    Refuses a graph holding CPU tensor attributes (they would have to move too)."""
    dev = torch.device(device)
    swap = lambda a: dev if isinstance(a, torch.device) and a.type == "cpu" else a  # noqa: E731
    for sub in (m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)):
        for n in sub.graph.nodes:
            n.args = torch.fx.node.map_aggregate(n.args, swap)
            n.kwargs = torch.fx.node.map_aggregate(n.kwargs, swap)
            if n.op == "get_attr" and isinstance(getattr(sub, n.target, None), torch.Tensor):
                raise FakeCudaError(f"graph holds a tensor attribute {n.target}: retarget cannot move it")
        sub.recompile()
    return gm


def lower(gm: torch.fx.GraphModule, specs, *, sm: int, cubins: bool = True) -> Lowered:
    """Lower `gm` (traced on CPU; `specs` its placeholders' example tensors) for an sm_`sm` CUDA device: retargeted
    to `cuda:0`, its inputs fake CUDA tensors of the same shapes, strides and dtypes, then Inductor with the settings
    every fxbudget compile uses (`backend.inductor`)."""
    seen = run_inductor(gm, specs, fake_gpu(sm, cubins=cubins))
    code = "\n".join(seen["source"])
    return Lowered(sm, seen["source"], _KERNEL.findall(code), sorted(set(_EXTERN.findall(code))),
                   fallbacks_of(code), seen["cubins"])


def run_inductor(gm: torch.fx.GraphModule, specs, device) -> dict:
    """`gm` retargeted to `cuda:0` and lowered by `backend.inductor` inside `device` (a fake device's context) on
    fake CUDA tensors shaped like `specs`; what the context collected."""
    from fxbudget.compiler.backend import inductor
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    retarget(gm)
    with device as seen:
        # A ShapeEnv: the scan's while-loop reads its counter (`_local_scalar_dense`) while it is lowered.
        with FakeTensorMode(shape_env=ShapeEnv()):
            inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                      if isinstance(t, torch.Tensor) else t for t in specs]
        with torch.no_grad():
            inductor(gm, inputs)
    if not seen["source"]:
        raise FakeCudaError("compile_fx wrote no output code (was it read from a cache?)")
    return seen
