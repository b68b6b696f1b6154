"""What every command checks before it loads a model: rule files, rule parameters, the device and dtype, the model
named by `--model`, and (with the tokenizer alone) the samples. A bad input raises `UsageError`: `main` prints its
one line and exits with status 2, and nothing has been written yet."""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from .errors import UsageError  # noqa: F401  (raised here; importers take it from here too)


def params(items: list[str]) -> dict[str, dict]:
    """`rule.name=value` items (value parsed as JSON, else kept as a string) -> {rule: {name: value}}.

    Raises:
        UsageError: an item not of that form.
    """
    out: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        rule, dot, name = key.partition(".")
        if not (sep and dot and rule and name):
            raise UsageError(f"--param takes rule.name=value, e.g. snapkv.window=64; got {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(rule, {})[name] = parsed
    return out


def rule_files(paths: list[str]) -> None:
    """Import `--rule-file`s (they register rules).

    Raises:
        UsageError: a missing file, one that registers nothing or a taken name, or one whose code fails
            (`file:line: SyntaxError: ...`, or the exception with the file's line that raised it).
    """
    from ..rules import load_file

    for path in paths:
        try:
            load_file(path)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(str(e)) from None
        except SyntaxError as e:
            raise UsageError(f"{e.filename}:{e.lineno}: SyntaxError: {e.msg} (in --rule-file {path})") from None
        except Exception as e:  # the file's own code raised: point at its line, as a traceback's last frame would
            where = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == Path(path).resolve()]
            at = f"{where[-1].filename}:{where[-1].lineno}" if where else str(path)
            raise UsageError(f"{at}: {type(e).__name__}: {e} (in --rule-file {path})") from None


def task_files(paths: list[str]) -> None:
    """Refuse a task file line with a field fxbudget does not know (a misspelt `max_new_token` would otherwise be
    kept as data and silently ignored); fields of one's own go under `meta`. Other problems of the files are the
    grid's to say (`Grid.validate`, naming the file and line).

    Raises:
        UsageError: "FILE:LINE: unknown field 'anwser' (did you mean 'answer'?); the fields are ...".
    """
    from ..harness.tasks import TASK_FILE_FIELDS
    from .names import did_you_mean

    known = [*TASK_FILE_FIELDS, "meta"]
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue  # the grid says the file is missing or unreadable
        for lineno, line in enumerate(lines, 1):
            try:
                row = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError:
                continue
            unknown = [k for k in row if k not in known] if isinstance(row, dict) else []
            if unknown:
                raise UsageError(f"{path}:{lineno}: unknown field {unknown[0]!r}{did_you_mean(unknown[0], known)}; "
                                 f"the fields are {', '.join(TASK_FILE_FIELDS)}, and meta (an object of your own, "
                                 "kept with the sample)")


def rule_probes(grid) -> None:
    """The dry run of every rule of the grid (`fxbudget.kernel.probe`): a rule that reads a signal the kernel does not
    measure, returns the wrong shape or fails is refused before anything is written.

    Raises:
        UsageError: one line naming the rule, the field and the valid names.
    """
    from ..harness.grid import REFERENCE
    from ..kernel.probe import RuleProbeError, signals_read
    from ..rules import get

    for name in grid.rules:
        if name == REFERENCE:
            continue
        try:
            signals_read(get(name, **grid.rule_params.get(name, {})))
        except RuleProbeError as e:
            raise UsageError(f"--rules {name}: {e}") from None


def placement(args, *, ray: bool = False, names_only: bool = False):
    """The resolved `--device` and `--dtype` (`fxbudget.models.devices.Placement`); with `ray`, only the names are checked
    (the workers' devices are not this machine's) and the device follows `--gpus-per-worker`; with `names_only`
    (`--dry-run`), only the names too: the device as given (default cpu), the dtype its default on that device.

    Raises:
        UsageError: an unknown name, a GPU that is not here, a device that contradicts `--gpus-per-worker`.
    """
    from ..models import devices
    from .names import dtype_name

    args.dtype = dtype_name(args.dtype)  # bf16 -> bfloat16, ...; an unknown name refused with the nearest one
    try:
        if not ray:
            if names_only:
                devices.check_names(args.device, args.dtype)
                place = devices.choose(args.device or "cpu", args.dtype)
            else:
                place = devices.resolve(args.device, args.dtype)
            if place.warning:
                print(f"[fxbudget] warning: {place.warning}", file=sys.stderr)
            return place
        devices.check_names(args.device, args.dtype)
        gpus = (args.gpus_per_worker or 0) > 0
        if args.dtype == "auto" and not gpus:
            raise ValueError("--dtype auto with --ray on CPU workers: whether their CPUs have native bf16 is not "
                             "known here; give --dtype float32 or bfloat16")
        device = args.device or ("cuda" if gpus else "cpu")
        if device.startswith("cuda") != gpus:
            raise ValueError(f"--device {device} with --ray needs --gpus-per-worker "
                             f"{'> 0' if device != 'cpu' else '0 (the default)'}: the workers' devices are the GPUs "
                             "Ray gives them")
        if device.startswith("cuda:") and device != "cuda:0":
            raise ValueError(f"--device {device} with --ray: each worker sees its own GPUs as cuda:0...; use "
                             "--device cuda")
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        return devices.Placement("cuda:0" if gpus else "cpu", dtype or ("bfloat16" if gpus else "float32"))
    except ValueError as e:
        raise UsageError(str(e)) from None


def model_source(args):
    """The resolved `--model` (with `--revision`, `--trust-remote-code`), nothing loaded.

    Raises:
        UsageError: a path that is not there or not a model, an offline hub id missing from the cache, an
            embedded model (`--model gemma3-270m`) whose extra is not installed (the pip command).
    """
    from ..models.embedded import EMBEDDED
    from ..models.source import resolve_model

    try:
        source = resolve_model(args.model, revision=getattr(args, "revision", None),
                               trust_remote_code=getattr(args, "trust_remote_code", False))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if source.kind == "default" and source.location:
        from ..models import embedded_available

        entry = EMBEDDED[source.location]
        if not embedded_available(entry):
            raise UsageError(f"--model {entry.key}: the embedded {entry.name} is not installed; install it with: "
                             f"{entry.install_hint}")
    return source


def prepare_model(source) -> bool:
    """The embedded model's first-use conversion (assembly, dequantization, the safetensors cache), before its
    tokenizer is read; True when it ran (the closing line then names it as a stage of its own)."""
    if source.kind != "default":
        return False
    from ..models import prepare_default
    from ..models.embedded import DEFAULT, EMBEDDED

    return prepare_default(progress=True, model=EMBEDDED[source.location] if source.location else DEFAULT)


def tokenizer(source):
    """The model's tokenizer, without its weights.

    Raises:
        UsageError: a model whose tokenizer cannot be loaded (e.g. a hub id the hub does not know).
    """
    from ..models import load_tokenizer

    try:
        return load_tokenizer(source)
    except OSError as e:  # transformers says "... is not a local folder and is not a valid model identifier ..."
        raise UsageError(f"--model {args_model(source)}: its tokenizer could not be loaded: "
                         f"{str(e).strip().splitlines()[0]}") from None


def args_model(source) -> str:
    return source.location if source.kind not in ("default", "random") else source.name


def samples(grid, tok, plan=None) -> dict:
    """Build the samples with the tokenizer (`runner.build_samples`): the lengths checked against each task's
    minimum.

    Raises:
        UsageError: "--lengths N: TASK ...: use at least M tokens".
    """
    from ..harness.runner import build_samples

    try:
        return build_samples(grid, tok, plan)
    except ValueError as e:
        raise UsageError(f"--lengths: {e}") from None


class Stages:
    """Wall-clock seconds of a command's stages, which add up to its wall time: each stage ends where the next
    begins. When the command is the process (`fxbudget ...`, not `main()` called from Python), the first stage,
    `start-up`, runs from the process's start (Linux: /proc) to `Stages()`; else the first starts at `Stages()`.
    Python's exit after the closing line is the one thing outside them."""

    def __init__(self, from_process_start: bool = False):
        self.t0 = self.last = time.perf_counter()
        self.parts: list[tuple[str, float]] = []
        startup = _process_age() if from_process_start else None
        if startup is not None:
            self.parts.append(("start-up (Python, arguments)", startup))

    def mark(self, name: str) -> None:
        """End the stage `name` now."""
        now = time.perf_counter()
        self.parts.append((name, now - self.last))
        self.last = now

    def split(self, name: str, pieces: list[tuple[str, float]]) -> None:
        """End stage `name` now, told as `pieces` (measured inside it) and the rest of it as `name`."""
        now = time.perf_counter()
        total, inside = now - self.last, sum(s for _, s in pieces)
        self.parts += [p for p in pieces] + [(name, max(0.0, total - inside))]
        self.last = now

    def line(self) -> str:
        """`done in T s = a s name + ...`, rounded so that the printed terms add up to the printed total."""
        out, cumulative, shown = [], 0.0, 0.0
        for name, seconds in self.parts:
            cumulative += seconds
            rounded = round(cumulative, 1) - shown
            shown = round(cumulative, 1)
            out.append(f"{rounded:.1f} s {name}")
        return f"done in {shown:.1f} s = " + " + ".join(out)


def _process_age() -> float | None:
    """Seconds since this process started (Linux), None where /proc cannot tell."""
    import os

    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
