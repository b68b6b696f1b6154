"""`fxbudget compare --decompose RULES`: for each listed rule (one of `--rules`), also run `noprotect:<rule>` (its
score, nothing force-kept) and `protectonly:<rule>` (its protected set, the rest at random), and `random` if the run
lacks it; the report's "where the gain comes from" section reads them (`fxbudget.harness.decomposition`). The
rule's `--param` values go to both wrappers too, so the three run with the same window and hyperparameters."""

from __future__ import annotations

from .errors import UsageError
from .names import rule_names

WRAPPERS = ("noprotect:", "protectonly:")
FLOOR = "random"


def expand(rules: list[str], decompose: list[str] | None, params: list[str]) -> tuple[list[str], list[str]]:
    """The run's rules and `--param` items with the decomposition's added (each wrapper right after its rule,
    `random` last), unchanged without `--decompose`.

    Args:
        rules: `--rules`, as the registry spells them. decompose: `--decompose` (names as typed), or None.
        params: `--param` items, `rule.name=value`, as the registry spells the rule.
    Raises:
        UsageError: a listed rule that is not among `--rules`, or one the wrappers refuse (it protects nothing,
            or never evicts), in one line.
    """
    if not decompose:
        return rules, params
    from ..rules import get

    wanted = rule_names(decompose, option="--decompose")
    own = _params_of(params)
    out, extra = list(rules), list(params)
    for name in wanted:
        if name not in rules:
            raise UsageError(f"--decompose {name}: {name} is not among --rules ({', '.join(rules)}); the "
                             f"decomposition compares a rule with its parts, so add {name} to --rules")
        for prefix in WRAPPERS:
            try:
                get(prefix + name, **own.get(name, {}))
            except (ValueError, TypeError) as e:
                raise UsageError(f"--decompose {name}: {e}") from None
        at = out.index(name) + 1
        for prefix in WRAPPERS:
            if prefix + name not in out:
                out.insert(at, prefix + name)
                at += 1
                extra += [f"{prefix}{item}" for item in params if item.partition(".")[0] == name]
    if FLOOR not in out:
        out.append(FLOOR)
    return out, extra


def _params_of(items: list[str]) -> dict[str, dict]:
    from .preflight import params

    return params(items)
