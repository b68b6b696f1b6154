"""Eviction rules behind a registry (`fxbudget.rules.registry`): `available()`, `get(name_or_rule, **params)`,
`register(name)`, `load_file(path)`.

A rule is a dataclass (fields = hyperparameters) subclassing `Rule`, with a `score` over the kernel's `Signals`;
one file per rule. Wrappers (`AdaKV` as `adakv:<rule>`, `Pyramid`, `Chunk`) change how a rule's scores are spent and
delegate everything else to the rule they wrap (`fxbudget.rules.wrapper`); `noprotect:<rule>` and `protectonly:<rule>`
split a rule into its score and its protected set (the protection decomposition).

May import: `checks` only (the kernel imports the rule interface, not the other way).
"""

from __future__ import annotations

from .base import Rule, Signals, recent
from .registry import (  # noqa: F401  (_REGISTRY, _LOADED: tests and the search read them)
    _LOADED, _REGISTRY, available, canonical, get, load_file, plain_generation_rules, register, rule_fields,
    unknown_rule_message, wrapper_prefixes,
)

# Built-in rules register themselves on import.
from . import (  # noqa: E402,F401
    adakv, capkv, chunk, chunkkv, compactor, criticalkv, cur, defensivekv, expected_attention, finch, full, h2o,
    keydiff, knorm, kvzip, lagkv, leverage, non_causal_attention, noprotect, observed_attention, protectonly,
    pyramidkv, random, simlayerkv, snapkv, streamingllm, tova, weighted, window,
)
from .adakv import AdaKV  # noqa: E402
from .chunk import Chunk  # noqa: E402
from .noprotect import NoProtect, protects_tokens  # noqa: E402
from .protectonly import ProtectOnly  # noqa: E402
from .pyramidkv import Pyramid, pyramid_budgets  # noqa: E402

__all__ = ["AdaKV", "Chunk", "NoProtect", "ProtectOnly", "Pyramid", "Rule", "Signals", "available", "canonical", "get",
           "load_file", "plain_generation_rules", "protects_tokens", "pyramid_budgets", "recent", "register",
           "rule_fields", "wrapper_prefixes"]
