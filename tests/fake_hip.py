"""Inductor's ROCm lowering on a machine without an AMD GPU: the HIP variant of `fake_cuda` (docs/gpu-internals.md).

`lower(gm, example_inputs, arch="gfx942")` is `fake_cuda.lower` for an AMD device: inside `fake_gpu(arch)` torch
reports a HIP build (`torch.version.hip`) with one gfx942 (MI300X) or gfx90a (MI250) device (`PROPS`: its
`gcnArchName`, wavefronts of 64), Inductor writes Triton source for HIP, and Triton's AMD backend compiles every
kernel's every autotuning config to an HSA code object (hsaco) for `GPUTarget("hip", arch, 64)`, in-process (no
ROCm install: Triton assembles and links the AMDGCN itself). Only loading onto a device is skipped.

The patches every fake device shares live once, in `fake_cuda.patched`; this module adds only what is HIP's own
(`HIP_TARGETS`). All of `TARGETS` is checked before anything is patched, against the same pinned torch/Triton pair
(`fake_cuda.PINNED`): another pair or a moved target raises `FakeCudaError` naming it, never a skip. The torch is
the CUDA build (ROCm's would do as well, but CI has the CUDA one); only its version strings are swapped inside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types

import torch

import fake_cuda
from fake_cuda import FakeCudaError, check_pinned as _check_cuda_pinned

# A ROCm release torch 2.14.1 is built for: what `torch.version.hip` reads inside `fake_gpu`.
HIP_VERSION = "7.1.25424"

# arch -> the device properties Inductor reads, as a ROCm build of torch reports them (one GCD of an MI250 is one
# device). major/minor: what `torch.cuda.get_device_capability` answers on ROCm (the gfx number's digits).
_COMMON = dict(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
               warp_size=64, shared_memory_per_block=65536, shared_memory_per_block_optin=65536,
               shared_memory_per_multiprocessor=65536, is_integrated=False, memory_bus_width=8192)
PROPS = {
    "gfx942": types.SimpleNamespace(name="fake gfx942 (AMD Instinct MI300X)", major=9, minor=4,
                                    gcnArchName="gfx942:sramecc+:xnack-", multi_processor_count=304,
                                    L2_cache_size=4 * 2**20, clock_rate=2100000, memory_clock_rate=1300000,
                                    total_memory=192 * 2**30, uuid="fake-gfx942", **_COMMON),
    "gfx90a": types.SimpleNamespace(name="fake gfx90a (AMD Instinct MI250, one GCD)", major=9, minor=0,
                                    gcnArchName="gfx90a:sramecc+:xnack-", multi_processor_count=104,
                                    L2_cache_size=8 * 2**20, clock_rate=1700000, memory_clock_rate=1600000,
                                    total_memory=64 * 2**30, uuid="fake-gfx90a", **_COMMON),
}

# What only the HIP device patches or reads, as "module:object.attribute"; `fake_cuda.TARGETS` holds the rest.
HIP_TARGETS = (
    "torch.version:hip", "torch.version:cuda",  # a ROCm build: hip set, cuda None (read where Inductor branches)
    # Read, not patched: the fake driver and the hsaco check are built on them.
    "triton.backends.amd.driver:ty_to_cpp",
    "triton.backends.amd.compiler:HIPBackend",
)
TARGETS = fake_cuda.TARGETS + HIP_TARGETS


def check_pinned() -> None:
    """`fake_cuda.check_pinned` (the pair, the CUDA build, its targets), then every HIP target: `FakeCudaError`
    naming the first missing one."""
    _check_cuda_pinned()
    for target in (t for t in TARGETS if t not in fake_cuda.TARGETS):
        try:
            fake_cuda._resolve(target)
        except FakeCudaError as e:
            msg = str(e).replace("fake CUDA", "fake HIP").replace("fake_cuda.py", "fake_hip.py")
            raise FakeCudaError(msg) from None


@dataclasses.dataclass
class Hsaco:
    kernel: str
    target: str  # e.g. "hip:gfx942"
    size: int    # bytes of the HSA code object
    mfma: bool   # the AMDGCN has matrix-core (MFMA) instructions


@dataclasses.dataclass
class Lowered:
    """One graph lowered for one gfx arch: the output code, its Triton kernels, its calls outside Triton, the
    code objects (`fake_cuda.Lowered` with `arch` for `sm`, `hsacos` for `cubins`)."""

    arch: str
    source: list[str]
    kernels: list[str]
    externs: list[str]    # extern_kernels.* (rocBLAS/hipBLASLt matmuls and the like)
    fallbacks: list[str]  # aten / torch.ops calls: ops Inductor did not lower to Triton
    hsacos: list[Hsaco]


_MFMA = re.compile(r"\bv_mfma_\w+")


def _driver(arch: str):
    from triton.backends.amd.driver import ty_to_cpp
    from triton.backends.compiler import GPUTarget

    return fake_cuda.fake_driver("HIP", GPUTarget("hip", arch, 64), ty_to_cpp)


@contextlib.contextmanager
def fake_gpu(arch: str = "gfx942", *, hsaco: bool = True, cache_dir: str | None = None):
    """Inside: torch is a ROCm build with one `arch` device (`PROPS`) and Triton's active driver is HIP's. Yields
    `fake_cuda.patched`'s dict: the output code (`"source"`) and the code objects (`"cubins"`, `Hsaco` here).
    `hsaco=False` stops at the Triton source. Every patch is undone on exit."""
    if arch not in PROPS:
        raise ValueError(f"arch must be one of {sorted(PROPS)}, got {arch!r}")
    check_pinned()
    props = PROPS[arch]

    def record(self, seen):  # each compiled config's hsaco, instead of a launcher
        for r in self.compile_results:
            k = r.kernel
            asm = getattr(k, "asm", {})
            target = getattr(getattr(k, "metadata", None), "target", None)
            seen["cubins"].append(Hsaco(self.fn.__name__, f"{target.backend}:{target.arch}" if target else "?",
                                        len(asm.get("hsaco", b"")), bool(_MFMA.search(asm.get("amdgcn", "")))))

    extra = {"torch.version:hip": HIP_VERSION, "torch.version:cuda": None}
    with fake_cuda.patched(props, arch, _driver(arch), record, compiled=hsaco, cache_dir=cache_dir,
                           extra=extra) as seen:
        yield seen


def lower(gm: torch.fx.GraphModule, example_inputs, *, arch: str = "gfx942", hsaco: bool = True) -> Lowered:
    """`fake_cuda.lower` for a HIP device: `gm` (traced on CPU; `example_inputs` its placeholders' example tensors)
    retargeted to `cuda:0` (ROCm's torch calls its devices cuda too), lowered by `backend.inductor` on fake tensors
    for `arch`; `hsaco=True` compiles every kernel to a code object."""
    seen = fake_cuda.run_inductor(gm, example_inputs, fake_gpu(arch, hsaco=hsaco))
    code = "\n".join(seen["source"])
    externs = sorted(set(fake_cuda._EXTERN.findall(code)))
    return Lowered(arch, seen["source"], fake_cuda._KERNEL.findall(code), externs, fake_cuda.fallbacks_of(code),
                   seen["cubins"])


def dot_kernels(source: str) -> set[str]:
    """The Triton kernels of an output code whose source calls `tl.dot` (where a matrix core is expected)."""
    kernels = re.split(r"^(?=(?:triton_\w+) = async_compile\.triton)", source, flags=re.M)
    return {m.group(1) for k in kernels if (m := fake_cuda._KERNEL.match(k)) and "tl.dot(" in k}
