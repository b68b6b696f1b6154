"""Kernel fingerprints kept on disk: traced once per model, rule, code, dtype, device and versions, then read back.

A fingerprint (`fingerprint.kernel_fingerprint` on its probe) takes seconds to a minute per rule on a CPU and is a
pure function of what it traces: fxbudget's kernel code, the model's architecture (class, config, module tree,
parameter dtypes and devices; not its weights' values), the rule (class, source and hyperparameters), the budget
and cache layout it is traced at, and the torch, transformers and Python that trace it. The key written here holds
all of them, so an entry cannot go stale: editing any of that code gives a new key, and the fingerprint is traced
again. The code is hashed from the files on disk (`source_digest`); a change made only in memory (a monkeypatched
function) is not seen, so `fxbudget.kernel_fingerprint` itself never reads this cache: `compare` rows do.

Entries live in `$FXBUDGET_CACHE/fingerprints/` (default `~/.cache/fxbudget/fingerprints/`), one small JSON file
per key, written atomically (a temporary file in the same folder, fsync, rename): a process killed mid-write leaves
no entry, and an entry that cannot be read or does not match its key is ignored and traced again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import __version__
from .fingerprint import PROBE_BLOCK, PROBE_TOKENS, kernel_fingerprint
from ..kernel.settings import ALL_SIGNALS, signals_label
from ..kernel.signal_set import run_signals
from ..models import default_cache_dir
from ..rules import Rule, get

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the key's layout or an entry's fields change
SUBDIR = "fingerprints"
PACKAGE = Path(__file__).resolve().parent.parent  # the fxbudget package
# Subpackages the traced kernel never imports (tested: a fingerprint traced in a fresh process loads none of them):
# editing them (the report, the CLI) keeps the cached fingerprints.
NOT_TRACED = ("harness", "cli", "lmeval")
_HEX = re.compile(r"[0-9a-f]{64}")


class Uncacheable(Exception):
    """Something the fingerprint depends on has no source file to hash (a class typed into a REPL): trace it."""


def cache_dir() -> Path:
    """Where the entries live: `$FXBUDGET_CACHE/fingerprints` (default `~/.cache/fxbudget/fingerprints`)."""
    return default_cache_dir().parent / SUBDIR


def source_digest(root: Path = PACKAGE) -> str:
    """sha256 of every `.py` file of the fxbudget package under `root` (paths and bytes), except `NOT_TRACED`."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in NOT_TRACED:
            continue
        h.update(rel.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# The package's source when this module was imported (after the kernel's modules, which it imports): a key made
# later must find the same, or the code that runs is not the code on disk (edited during the run) and nothing is
# cached, so an entry never pairs new source with the old code's value.
_IMPORTED_SOURCE = source_digest()


def _file_digest(files: set[str]) -> dict[str, str]:
    from ..rules import _LOADED  # a rule file's bytes as loaded: what runs, even if the file changed since

    out = {}
    for name in sorted(files):
        try:
            loaded = _LOADED.get(str(Path(name).resolve()))
            out[name] = hashlib.sha256(loaded[0] if loaded else Path(name).read_bytes()).hexdigest()
        except OSError:
            raise Uncacheable(f"no source file {name!r}") from None
    return out


def _class_files(cls: type, files: set[str], *, functions: bool = True) -> None:
    """The source files of `cls` and its bases: their modules and, with `functions`, the files of the functions in
    their bodies (a scoring function registered as a rule lives in another module than the class made for it; not
    for a model's modules, which Dynamo gives methods of its own while it traces)."""
    for c in cls.__mro__:
        if c is object:
            continue
        module = sys.modules.get(c.__module__)
        path = getattr(module, "__file__", None)
        if path is None:
            raise Uncacheable(f"class {c.__qualname__} has no source file")
        files.add(str(Path(path).resolve()))
        for attr in vars(c).values() if functions else ():
            for fn in (attr, getattr(attr, "__func__", None), getattr(attr, "fget", None)):
                code = getattr(fn, "__code__", None)
                # Code a class generates for itself (a dataclass's `__init__`, file "<string>") follows from its
                # hashed source; code from elsewhere with no file (a function typed into a REPL) is refused below.
                if code is not None and not (code.co_filename.startswith("<")
                                             and getattr(fn, "__module__", None) == c.__module__):
                    files.add(code.co_filename)


def _plain(value):
    """`value` as JSON the same in every process: sets sorted (their order follows the process's hash seed), dicts
    by key, anything else not JSON as its repr."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=_canonical)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _describe(value, files: set[str]):
    """A JSON-able description of a rule (class, name, hyperparameters; inner rules described alike), collecting
    the source files it depends on."""
    if isinstance(value, Rule):
        cls = type(value)
        _class_files(cls, files)
        fields = {k: _describe(v, files) for k, v in sorted(vars(value).items()) if not k.startswith("_")}
        return {"class": f"{cls.__module__}.{cls.__qualname__}", "name": value.name, "fields": fields}
    if isinstance(value, (list, tuple)):
        return [_describe(v, files) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v, files) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        return sorted((_describe(v, files) for v in value), key=_canonical)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):  # by content: a tensor's repr elides the middle of a long one
        data = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return f"tensor {value.dtype} {tuple(value.shape)} {hashlib.sha256(data).hexdigest()}"
    code = getattr(value, "__code__", None)
    if code is not None:
        files.add(code.co_filename)
        return f"function {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return repr(value)


def _describe_model(model: nn.Module, files: set[str]) -> dict:
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_dict", None)):
        raise Uncacheable("the model has no config (`config.to_dict()`)")
    settings = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "_commit_hash")}
    for cls in {type(m) for m in model.modules()}:
        _class_files(cls, files, functions=False)
    tensors = sorted({f"{t.dtype} {t.device}" for t in (*model.parameters(), *model.buffers())})
    cls = type(model)
    return {"class": f"{cls.__module__}.{cls.__qualname__}",
            "config": _plain(settings),
            "modules": hashlib.sha256(repr(model).encode()).hexdigest(), "tensors": tensors,
            "training": model.training,
            "device_map": {str(k): str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()}}


def fingerprint_key(model: nn.Module, rule: Rule, budget: int, head_pool: bool | None) -> dict:
    """Everything `kernel_fingerprint(model, rule=rule, budget=budget, head_pool=head_pool)` depends on.

    Raises:
        Uncacheable: the model has no config, a class or function it uses has no source file, or fxbudget's source
            changed since it was imported.
    """
    import torch._dynamo.config as dynamo_config
    import transformers

    source = source_digest()
    if source != _IMPORTED_SOURCE:
        raise Uncacheable("fxbudget's source files changed since it was imported")
    files: set[str] = set()
    key = {"format": FORMAT, "fxbudget": __version__, "fxbudget_source": source,
           "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version,
           "dynamo_config": hashlib.sha256(_canonical(_plain(dynamo_config.get_config_copy())).encode()).hexdigest(),
           "model": _describe_model(model, files), "rule": _describe(rule, files),
           "budget": budget, "head_pool": head_pool, "probe": [PROBE_TOKENS, PROBE_BLOCK]}
    # The package's own files are in fxbudget_source already; the others (transformers' modeling file, a rule
    # file) by content.
    key["files"] = _file_digest({f for f in files if not _in_package(f)})
    return key


def _in_package(name: str) -> bool:
    try:
        rel = Path(name).resolve().relative_to(PACKAGE)
    except ValueError:
        return False
    return rel.parts[0] not in NOT_TRACED


def _canonical(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def entry_path(key: dict) -> Path:
    """The file of `key`'s entry: its sha256, under `cache_dir()`."""
    return cache_dir() / f"{hashlib.sha256(_canonical(key).encode()).hexdigest()}.json"


def read_entry(path: Path, key: dict) -> str | None:
    """The fingerprint stored at `path` for `key`; None if absent, unreadable, truncated or for another key."""
    try:
        entry = json.loads(path.read_text())
        value = entry["fingerprint"]
        if _canonical(entry["key"]) == _canonical(key) and isinstance(value, str) and _HEX.fullmatch(value):
            return value
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def write_entry(path: Path, key: dict, value: str, traced_s: float) -> None:
    """Write the entry atomically: a temporary file in the same folder, flushed to disk, then renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": value, "traced_s": round(traced_s, 3),
                       "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "key": key}, f, indent=1,
                      sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_kernel_fingerprint(model: nn.Module, rule: str | Rule, *, budget: int, head_pool: bool | None = None,
                              compute: Callable[..., str] | None = None, signals=ALL_SIGNALS,
                              slot_dtype: str = "model") -> tuple[str, bool]:
    """`kernel_fingerprint(model, rule=rule, budget=budget, head_pool=head_pool)` on its probe, read from the disk
    cache when an entry for the same key exists, else traced and stored.

    Args:
        model: a transformers causal LM (a model without `config` is traced every time).
        rule: a rule name (no hyperparameters) or instance. budget, head_pool, signals: as for `kernel_fingerprint`
            (the signal set is part of the key), slot_dtype (part of the key when not "model").
        compute: what traces it (default `fingerprint.kernel_fingerprint`), called as it is.
    Returns:
        (the fingerprint, whether it was read from the cache).
    """
    compute = kernel_fingerprint if compute is None else compute
    rule = get(rule)
    chosen = run_signals([rule], signals)
    label = signals_label(chosen)
    extra = {} if label == ALL_SIGNALS else {"signals": chosen}  # "all": the key (and entries) of before the set
    if slot_dtype != "model":  # the model dtype: the key (and entries) of before quantized slots
        extra["slot_dtype"] = slot_dtype
    try:
        key = fingerprint_key(model, rule, budget, head_pool)
        if "signals" in extra:
            key["signals"] = label
        if "slot_dtype" in extra:
            key["slot_dtype"] = slot_dtype
    except Uncacheable as e:
        log.debug("kernel fingerprint not cached: %s", e)
        return compute(model, rule=rule, budget=budget, head_pool=head_pool, **extra), False
    path = entry_path(key)
    value = read_entry(path, key)
    if value is not None:
        return value, True
    t0 = time.perf_counter()
    value = compute(model, rule=rule, budget=budget, head_pool=head_pool, **extra)
    try:
        write_entry(path, key, value, time.perf_counter() - t0)
    except OSError as e:  # a read-only or full disk: the run goes on, traced
        log.warning("could not cache the kernel fingerprint in %s: %s", path.parent, e)
    return value, False
