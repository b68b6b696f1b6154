"""The rule registry: names to `Rule` classes, name prefixes to wrappers (`adakv:<rule>`), and rule files.

Its own module, imported by every rule file (`@register`) and by nothing that a rule file imports, so the package
has no import cycle. A wrapper registers its prefix here (`register_wrapper`), so the registry imports no rule.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..checks import nearest
from .base import Rule

_REGISTRY: dict[str, type[Rule]] = {}


@dataclass(frozen=True)
class WrapperForm:
    """A name prefix that wraps any registered rule: `prefix + name` builds `cls(get(name, ...), **own params)`."""

    prefix: str
    cls: type[Rule]
    params: tuple[str, ...]  # the wrapper's own hyperparameters (the rest go to the wrapped rule)


_WRAPPERS: dict[str, WrapperForm] = {}


def register(name: str):
    """Decorator: register a rule under `name`, for `get` and `fxbudget.compile(rule=name)`.

    Decorates a `Rule` subclass (a dataclass whose fields are hyperparameters), or a plain scoring function
    `score(signals) -> Tensor` (higher = keep), which becomes a parameterless rule.
    """

    def deco(obj):
        if isinstance(obj, type) and issubclass(obj, Rule):
            cls = obj
        elif callable(obj) and not isinstance(obj, type):
            cls = dataclass(type(obj.__name__, (Rule,), {"score": staticmethod(obj), "__doc__": obj.__doc__}))
        else:
            raise TypeError(f"@register({name!r}) expects a Rule subclass or a scoring function, got {obj!r}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def register_wrapper(prefix: str, cls: type[Rule], params: tuple[str, ...]) -> None:
    """Make `prefix + <rule>` a rule name: `cls` wrapping `<rule>`, with `params` its own hyperparameters."""
    _WRAPPERS[prefix] = WrapperForm(prefix, cls, tuple(params))


def available() -> list[str]:
    """Names of the registered rules, sorted (wrapper forms not included: `wrapper_prefixes`)."""
    return sorted(_REGISTRY)


def wrapper_prefixes() -> list[str]:
    """The registered wrapper prefixes (`adakv:`), each valid before any registered rule's name."""
    return sorted(_WRAPPERS)


def _split(name: str) -> tuple[WrapperForm | None, str]:
    for prefix, form in _WRAPPERS.items():
        if name.startswith(prefix):
            return form, name[len(prefix):]
    return None, name


def unknown_rule_message(name: str) -> str:
    """One line for a name that is no rule: the close matches (case-insensitive), the known rules and wrappers."""
    names = available() + [p + "<rule>" for p in wrapper_prefixes()]
    close = nearest(name, available())
    hint = f" (did you mean {close!r}?)" if close else ""
    return f"unknown rule {name!r}{hint}; known rules: {', '.join(names)}"


def canonical(name: str) -> str:
    """`name` as registered, matched case-insensitively (`SnapKV` -> `snapkv`, `AdaKV:SnapKV` -> `adakv:snapkv`);
    unchanged when nothing matches (then `get` refuses it)."""
    lower = {n.lower(): n for n in _REGISTRY}
    prefixes = {p.lower(): p for p in _WRAPPERS}
    for p_low, p in prefixes.items():
        if name.lower().startswith(p_low):
            return p + canonical(name[len(p):])
    return name if name in _REGISTRY else lower.get(name.lower(), name)


def rule_fields(name: str) -> list[str] | None:
    """The hyperparameter names of a rule name, None if it names no rule. A wrapper form has the wrapper's own and
    the wrapped rule's: `adakv:snapkv` takes `alpha` (AdaKV) and `window`, `kernel`, ... (snapkv)."""
    form, inner = _split(name)
    if form is None:
        cls = _REGISTRY.get(name)
        return None if cls is None else [f.name for f in dataclasses.fields(cls) if f.init
                                          and not f.name.startswith("_")]
    own = rule_fields(inner)
    return None if own is None else list(form.params) + [n for n in own if n not in form.params]


def get(rule: str | Rule, **params) -> Rule:
    """A rule instance from a registered name (with hyperparameters) or an instance (returned as is).

    A wrapper form (`adakv:<rule>`) wraps the rule: the wrapper's own parameters (`alpha`) go to the wrapper, every
    other parameter to `<rule>`.
    """
    if isinstance(rule, Rule):
        if params:
            raise TypeError(f"rule parameters {sorted(params)} given with a rule instance {rule}; set them on it")
        return rule
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a name or a fxbudget.rules.Rule instance, got {type(rule).__name__}")
    form, inner = _split(rule)
    if form is not None:
        own = {k: params.pop(k) for k in form.params if k in params}
        return form.cls(get(inner, **params), **own)
    if rule not in _REGISTRY:
        raise ValueError(unknown_rule_message(rule))
    try:
        return _REGISTRY[rule](**params)
    except TypeError as e:
        raise TypeError(f"bad parameters for rule {rule!r}: {e}") from None


def plain_generation_rules() -> list[str]:
    """The registered rules that evict in plain generation (every call that overflows the budget): all but `full`
    (never evicts) and the replay-only ones (kvzip: only in their own protocol)."""
    return [r for r in available() if not get(r).never_evicts and not get(r).replay_only]


_LOADED: dict[str, tuple[bytes, list[str]]] = {}  # resolved path of a rule file -> (its contents, names registered)
_MODULE_IDS = itertools.count()  # each loaded file is its own module


def load_file(path: str | os.PathLike, *, replace: bool = False) -> list[str]:
    """Import a Python file that registers rules (`@register`), e.g. one written by `fxbudget search`.

    Loading the same file again does nothing unless it changed: then its rules are registered anew. A file may not
    replace a rule registered by anything else, except, with `replace`, one registered by another rule file.

    Args:
        path: the `.py` file.
        replace: let it replace rules of other rule files (a search rewriting its found rule).
    Returns:
        The names the file registered.
    Raises:
        FileNotFoundError: no such file. ValueError: it registers no rule, or a name already taken.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"rule file {path} does not exist")
    text = path.read_bytes()
    if str(path) in _LOADED and _LOADED[str(path)][0] == text:
        return _LOADED[str(path)][1]
    before, earlier = dict(_REGISTRY), _LOADED.pop(str(path), None)
    for n in earlier[1] if earlier else []:  # an earlier version of this file: its rules make way
        _REGISTRY.pop(n, None)
    own = dict(_REGISTRY)
    name = f"fxbudget_rule_file_{next(_MODULE_IDS)}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        new = [n for n, cls in _REGISTRY.items() if own.get(n) is not cls]
        from_files = {n: f for f, (_, names) in _LOADED.items() for n in names} if replace else {}
        taken = [n for n in new if n in own and n not in from_files]
        if taken or not new:
            raise ValueError(f"rule file {path} " + (
                f"registers rule names already taken: {', '.join(taken)}" if taken
                else "registers no rule (decorate a Rule subclass with @register(name))"))
    except BaseException:
        sys.modules.pop(name, None)
        _REGISTRY.clear()
        _REGISTRY.update(before)
        if earlier:
            _LOADED[str(path)] = earlier
        raise
    for f in {from_files[n] for n in new if n in from_files}:  # replaced: loading that file again re-runs it
        del _LOADED[f]
    _LOADED[str(path)] = (text, new)
    return new

