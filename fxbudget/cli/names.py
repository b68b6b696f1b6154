"""Names typed on the command line, matched the forgiving way: rules, tasks, protocols and dtypes are matched without
regard to case (`snapKV` is `snapkv`), dtypes also by their usual short names (`bf16` is `bfloat16`), and an unknown
name is refused in one line with the nearest known one ("did you mean ...?", `difflib`). No torch import."""

from __future__ import annotations

from ..checks import nearest
from .errors import UsageError

# Short names of the dtypes, as other tools spell them.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "f16": "float16", "fp32": "float32",
                 "f32": "float32", "float": "float32", "single": "float32"}


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 row`, `2 rows` (`many`: the plural when it is not `word + "s"`)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def did_you_mean(name: str, known) -> str:
    """`" (did you mean 'x'?)"` for the nearest known name (case-insensitive), or "" when none is near."""
    near = nearest(name, known)
    return f" (did you mean {near!r}?)" if near else ""


def match(name: str, known, what: str, *, option: str, listing: str | None = None) -> str:
    """The known name `name` means: itself, else the one equal to it but for case (and `_` for `-`).

    Args:
        name: as typed.
        known: the valid names.
        what: the kind of name ("rule", "task", ...), for the message.
        option: the option it came from ("--rules"), for the message.
        listing: how the message lists the valid names (default: all of them, comma-separated).
    Raises:
        UsageError: "--rules snapkvv: unknown rule 'snapkvv' (did you mean 'snapkv'?); known rules: ...".
    """
    known = list(known)
    if name in known:
        return name
    key = name.casefold().replace("_", "-")
    same = [k for k in known if k.casefold().replace("_", "-") == key]
    if len(same) == 1:
        return same[0]
    raise UsageError(f"{option} {name}: unknown {what} {name!r}{did_you_mean(name, known)}; known {what}s: "
                     f"{listing or ', '.join(known)}")


def rule_name(name: str, *, option: str = "--rules") -> str:
    """A registered rule name (a wrapper form such as `adakv:<rule>` matched inside too); imports the registry
    (torch)."""
    from ..rules import available, wrapper_prefixes

    known = available()
    listing = f"{', '.join(known)}, and " + ", ".join(f"{p}<rule>" for p in wrapper_prefixes()) + " for any of them"
    for prefix in wrapper_prefixes():
        if name.casefold().startswith(prefix.casefold()):
            return prefix + match(name[len(prefix):], known, "rule", option=option, listing=listing)
    return match(name, known, "rule", option=option, listing=listing)


def rule_names(names: list[str], *, option: str = "--rules") -> list[str]:
    """Each of `names` as `rule_name` gives it (`full` stays `full`)."""
    return [rule_name(n, option=option) for n in names]


def params(items: list[str]) -> list[str]:
    """`--param` items with their rule's name matched (`SnapKV.window=64` -> `snapkv.window=64`); items not of the
    form `rule.name=value`, or naming no rule, are left for the checks that explain them."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        rule, dot, field = key.rpartition(".")
        if sep and dot and rule:
            try:
                rule = rule_name(rule, option="--param")
            except UsageError:
                pass  # the grid's check says "unknown rule ..." with the list
            item = f"{rule}.{field}={value}"
        out.append(item)
    return out


def task_names(names: list[str] | None) -> list[str] | None:
    """The generated tasks `names` means (case-insensitive); a suite (`ruler`) stands for its tasks."""
    from ..harness.tasks import RULER_SUITE, TASKS, expand_tasks

    if names is None:
        return None
    matched = []
    try:
        for n in names:
            if n.casefold() == RULER_SUITE:
                matched.append(RULER_SUITE)
                continue
            try:
                matched.append(match(n, TASKS, "task", option="--tasks"))
            except UsageError:
                if n.casefold().startswith(RULER_SUITE + ":"):
                    expand_tasks([n])  # RULER's own message, listing its 13 tasks
                raise
        return expand_tasks(matched)
    except ValueError as e:
        raise UsageError(f"--tasks {','.join(names)}: {e}") from None


def protocol_names(names: list[str]) -> list[str]:
    """The protocols `names` means (case-insensitive, `_` for `-`)."""
    from ..harness.grid import PROTOCOLS

    return [match(n, PROTOCOLS, "protocol", option="--protocol") for n in names]


def dtype_name(name: str | None) -> str | None:
    """The dtype `name` means: `bfloat16`, `float16`, `float32`, or a short name of one (`bf16`, `fp16`, `half`,
    `fp32`), case-insensitive, `torch.` prefix allowed; or `auto` (`devices.resolve` picks one)."""
    from ..models.devices import CHOICES, DTYPES

    if name is None:
        return None
    key = name.casefold().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key in CHOICES:
        return key
    hint = did_you_mean(name, DTYPES) or did_you_mean(name, ("bf16", "fp16", "fp32"))
    raise UsageError(f"--dtype {name}: unknown dtype{hint}; use one of "
                     f"{', '.join(DTYPES)} (or bf16, fp16, fp32), or auto")
