"""Eviction rules behind a registry: `available()`, `get(name_or_rule, **params)`, `register(name)`.

A rule is a dataclass (fields = hyperparameters) subclassing `Rule`, with a `score` over the kernel's `Signals`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """A rule instance from a registered name (with hyperparameters) or an instance (returned as is)."""
    if isinstance(rule, Rule):
        if params:
            raise TypeError(f"rule parameters {sorted(params)} given with a rule instance {rule}; set them on it")
        return rule
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a name or a fxbudget.rules.Rule instance, got {type(rule).__name__}")
    if rule not in _REGISTRY:
        raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(available())}")
    try:
        return _REGISTRY[rule](**params)
    except TypeError as e:
        raise TypeError(f"bad parameters for rule {rule!r}: {e}") from None


# Built-in rules register themselves on import.
from . import (  # noqa: E402,F401
    expected_attention, full, h2o, keydiff, knorm, pyramidkv, random, snapkv, streamingllm, tova, weighted, window,
)
from .pyramidkv import Pyramid, pyramid_budgets  # noqa: E402

__all__ = ["Pyramid", "Rule", "Signals", "available", "get", "pyramid_budgets", "recent", "register"]
