"""Eviction rules behind a registry: `available()`, `get(name_or_rule, **params)`, `register(name)`.

A rule is a dataclass (fields = hyperparameters) subclassing `Rule`, with a `score` over the kernel's `Signals`.
"""

from __future__ import annotations

from .base import Rule, Signals, recent

_REGISTRY: dict[str, type[Rule]] = {}


def register(name: str):
    """Class decorator: register a `Rule` subclass under `name` (used by `get` and `fxbudget.compile(rule=name)`)."""

    def deco(cls: type[Rule]) -> type[Rule]:
        if not (isinstance(cls, type) and issubclass(cls, Rule)):
            raise TypeError(f"@register({name!r}) expects a subclass of fxbudget.rules.Rule, got {cls!r}")
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
from . import h2o, knorm, snapkv, streamingllm, window  # noqa: E402,F401

__all__ = ["Rule", "Signals", "available", "get", "recent", "register"]
