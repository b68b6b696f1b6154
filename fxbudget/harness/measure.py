"""What the runner measures around a call: wall and compile seconds, peak GPU memory, KV bytes, greedy decoding,
and the environment every result row records (versions, device, dtype, threads, allocator)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time

import torch
import transformers
from torch import nn

from ..cache.keyword import cache_kwargs, output_cache
from . import interrupt
from .malloc import malloc_setting


def compile_seconds() -> float:
    """Total time Dynamo has spent compiling in this process (tracing and the backend, Inductor included)."""
    return sum(torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", []))


class Clock:
    """Wall time of a block, with the compile time spent inside it split out."""

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), compile_seconds()
        return self

    def __exit__(self, *exc):
        self.compile = compile_seconds() - self.c0
        self.run = time.perf_counter() - self.t0 - self.compile


def greedy(model: nn.Module, cache, logits: torch.Tensor, max_new: int, eos: set[int]) -> tuple[list[int], object]:
    """Greedy tokens from `logits` (the last prefill position) on; returns them and the cache."""
    out: list[int] = []
    for _ in range(max_new):
        interrupt.checkpoint("decode step")  # Ctrl-C during `compare` stops between steps (the row is not written)
        tok = int(logits[0].argmax())
        if tok in eos:
            break
        out.append(tok)
        if len(out) == max_new:
            break
        step = model(input_ids=torch.tensor([[tok]], device=logits.device), use_cache=True, logits_to_keep=1,
                     **cache_kwargs(model.forward, cache))
        logits, cache = step.logits[:, -1], output_cache(step)
    return out, cache


def kv_bytes(cache) -> dict:
    """KV bytes allocated (every slot, empty and head-room included) and held (slots holding a token)."""
    if hasattr(cache, "held_kv_bytes"):
        return {"kv_allocated_bytes": cache.kv_bytes(), "kv_held_bytes": cache.held_kv_bytes()}
    full = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)  # transformers' own cache grows to exactly the tokens it holds
    return {"kv_allocated_bytes": full, "kv_held_bytes": full}


class Peak:
    """Peak allocator memory on CUDA from construction (which resets the peak) to `read()`; None on other devices."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None


def eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in ids + [tokenizer.eos_token_id] if i is not None}


def environment(model: nn.Module) -> dict:
    """Versions and device: recorded in every row."""
    p = next(model.parameters())
    try:
        version = importlib.metadata.version("flexbudget")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "fxbudget": version,
            "python": platform.python_version(), "dtype": str(p.dtype).removeprefix("torch."), "device": str(p.device),
            "threads": torch.get_num_threads(), "malloc": malloc_setting(), "machine": platform.machine(),
            "platform": sys.platform}
