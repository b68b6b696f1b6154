"""Eviction rules behind a registry: `available()`, `get(name_or_rule, **params)`, `register(name)`.

A rule is a dataclass (fields = hyperparameters) subclassing `Rule`, with a `score` over the kernel's `Signals`.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .base import Rule, Signals, recent

_REGISTRY: dict[str, type[Rule]] = {}


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


def available() -> list[str]:
    """Names of the registered rules, sorted."""
    return sorted(_REGISTRY)


def get(rule: str | Rule, **params) -> Rule:
    """A rule instance from a registered name (with hyperparameters) or an instance (returned as is).

    A name `adakv:<rule>` wraps the rule in `AdaKV`: `alpha` goes to AdaKV, every other parameter to `<rule>`.
    """
    if isinstance(rule, Rule):
        if params:
            raise TypeError(f"rule parameters {sorted(params)} given with a rule instance {rule}; set them on it")
        return rule
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a name or a fxbudget.rules.Rule instance, got {type(rule).__name__}")
    if rule.startswith(adakv.PREFIX):
        wrapper = {k: params.pop(k) for k in ("alpha",) if k in params}
        return adakv.AdaKV(get(rule[len(adakv.PREFIX):], **params), **wrapper)
    if rule not in _REGISTRY:
        raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(available())}")
    try:
        return _REGISTRY[rule](**params)
    except TypeError as e:
        raise TypeError(f"bad parameters for rule {rule!r}: {e}") from None


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


# Built-in rules register themselves on import.
from . import (  # noqa: E402,F401
    adakv, chunkkv, compactor, cur, defensivekv, expected_attention, full, h2o, keydiff, knorm, kvzip, lagkv,
    leverage, observed_attention, pyramidkv, random, snapkv, streamingllm, tova, weighted, window,
)
from .adakv import AdaKV  # noqa: E402
from .pyramidkv import Pyramid, pyramid_budgets  # noqa: E402

__all__ = ["AdaKV", "Pyramid", "Rule", "Signals", "available", "get", "load_file", "pyramid_budgets", "recent",
           "register"]
