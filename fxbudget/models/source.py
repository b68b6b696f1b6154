"""What `--model` names, resolved before anything is loaded: an embedded model (the default, or a key of
`embedded.EMBEDDED` such as `gemma3-270m`), a local directory, a `.gguf` file, a Hugging Face hub id (with
`--revision`), or `random:CONFIG[,layers=N][,seed=S]`: a config's architecture with seeded random weights
(`random_weights.load_random`) and a byte-level tokenizer (`byte_tokenizer`), for a machine without weights.

A hub id is resolved the way `from_pretrained` resolves it: through the HF cache (`HF_HOME`, `HF_HUB_CACHE`), and
with `HF_HUB_OFFLINE=1` from the cache only; offline, an id that is not in the cache is refused here, before a
model loads. Online, the hub is asked when the model loads. No torch or transformers import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .embedded import DEFAULT, EMBEDDED

DEFAULT_MODEL_NAME = DEFAULT.name


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model`.

    Args:
        kind: "default" (an embedded model), "dir", "gguf", "hub" or "random" (a config with seeded weights).
        location: what `from_pretrained` takes: a directory (a `.gguf` file's folder) or a hub id; for kind
            "default", None (the default model) or the key of another embedded model (`embedded.EMBEDDED`); for
            kind "random", the config file.
        gguf_file: the `.gguf` file name inside `location`, for kind "gguf".
        revision: the hub revision (branch, tag or commit), for kind "hub".
        trust_remote_code: passed to `from_pretrained` (only with `--trust-remote-code`).
        name: what result rows record as the model.
        layers, seed: kind "random" only: `num_hidden_layers` if given, and the weights' seed.
    """

    kind: str
    location: str | None
    gguf_file: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    name: str = DEFAULT_MODEL_NAME
    layers: int | None = None
    seed: int = 0

    def pretrained_kwargs(self) -> dict:
        """Keyword arguments of `from_pretrained` (model and tokenizer) besides the location."""
        out: dict = {}
        if self.gguf_file:
            out["gguf_file"] = self.gguf_file
        if self.revision:
            out["revision"] = self.revision
        if self.trust_remote_code:
            out["trust_remote_code"] = True
        return out


def _looks_like_path(spec: str) -> bool:
    return (spec.startswith((".", "/", "~")) or os.path.isabs(spec) or spec.endswith(".gguf") or spec.count("/") > 1
            or os.sep != "/" and os.sep in spec)


def hub_offline() -> bool:
    """Whether the hub may not be asked (`HF_HUB_OFFLINE`, or transformers' `TRANSFORMERS_OFFLINE`)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode()) or os.environ.get("TRANSFORMERS_OFFLINE", "").upper() in {"1", "ON",
                                                                                                        "YES", "TRUE"}


def resolve_model(spec: str | os.PathLike | None, *, revision: str | None = None,
                  trust_remote_code: bool = False) -> ModelSource:
    """Resolve `--model` without loading anything.

    Args:
        spec: None (the default embedded model), an embedded model's key ("gemma3-270m"), a directory, a `.gguf`
            file or a hub id such as "Qwen/Qwen2.5-0.5B-Instruct".
        revision: a hub revision; only with a hub id.
        trust_remote_code: allow the model's own code (hub or directory models that ship it).
    Returns:
        A `ModelSource`.
    Raises:
        ValueError: a path that does not exist or is not a model, a malformed id, a revision without a hub id,
            or (offline) a hub id that is not in the HF cache; the message says what to do. (An embedded model
            whose extra is not installed: `models.embedded_available`; the CLI checks it, `load_model` says it.)
    """
    if spec is not None and str(spec).startswith(RANDOM):
        if revision is not None:
            raise ValueError(f"--revision is for hub ids; --model {spec} is a config with random weights")
        return _random_source(str(spec))
    if spec is None or str(spec) in EMBEDDED:
        if revision is not None:
            raise ValueError("--revision needs --model with a hub id (e.g. --model Qwen/Qwen2.5-0.5B-Instruct)")
        entry = DEFAULT if spec is None else EMBEDDED[str(spec)]
        return ModelSource("default", None if entry is DEFAULT else entry.key, trust_remote_code=trust_remote_code,
                           name=entry.name)
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists() or _looks_like_path(text):
        if revision is not None:
            raise ValueError(f"--revision is for hub ids; --model {text} is a local path")
        if path.is_dir():
            if not (path / "config.json").is_file() and not list(path.glob("*.gguf")):
                raise ValueError(f"--model {text}: the directory holds no config.json (not a Hugging Face model "
                                 "directory); give the folder save_pretrained wrote, a .gguf file or a hub id")
            return ModelSource("dir", str(path), trust_remote_code=trust_remote_code, name=Path(text).name or path.resolve().name)
        if path.is_file() and path.suffix == ".gguf":
            return ModelSource("gguf", str(path.parent), gguf_file=path.name, trust_remote_code=trust_remote_code,
                               name=path.name)
        what = "is not a model directory or a .gguf file" if path.exists() else "does not exist"
        raise ValueError(f"--model {text} {what}: give a model directory, a .gguf file or a hub id such as "
                         "Qwen/Qwen2.5-0.5B-Instruct")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        raise ValueError(f"--model {text}: not a local path and not a valid hub id (ORG/NAME, e.g. "
                         "Qwen/Qwen2.5-0.5B-Instruct)") from None
    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(text, "config.json", revision=revision)
        if not isinstance(found, str):
            at = f" at revision {revision}" if revision else ""
            raise ValueError(f"--model {text}{at} is not in the Hugging Face cache ({_cache_dir()}) and the hub is "
                             "offline (HF_HUB_OFFLINE): download it first (e.g. `hf download "
                             f"{text}`) with the network on, or set HF_HOME to the cache that holds it")
    name = text if revision is None else f"{text}@{revision}"
    return ModelSource("hub", text, revision=revision, trust_remote_code=trust_remote_code, name=name)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


RANDOM = "random:"


def _random_source(spec: str) -> ModelSource:
    """`random:CONFIG[,layers=N][,seed=S]`: CONFIG a `config.json`-style file or a folder holding one."""
    import json

    usage = "--model random:CONFIG[,layers=N][,seed=S] (CONFIG: a config.json-style file or a folder holding one)"
    path_text, *options = spec[len(RANDOM):].split(",")
    values: dict[str, int] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if key not in ("layers", "seed") or not eq or not value.isdigit() or key in values \
                or (key == "layers" and int(value) < 1):
            raise ValueError(f"--model {spec}: {option!r} is not layers=N (N >= 1) or seed=S; {usage}")
        values[key] = int(value)
    path = Path(path_text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path_text or not path.is_file():
        raise ValueError(f"--model {spec}: no config file at {path_text or '(empty)'!r}; {usage}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {spec}: {path} is not JSON ({e})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ValueError(f"--model {spec}: {path} has no model_type (not a transformers config)")
    layers, seed = values.get("layers"), values.get("seed", 0)
    # The spec itself, normalized: rows name the model by what reruns it.
    name = f"{RANDOM}{path_text}" + (f",layers={layers}" if layers else "") + f",seed={seed}"
    return ModelSource("random", str(path.resolve()), name=name, layers=layers, seed=seed)
