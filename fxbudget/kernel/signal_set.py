"""The signal set of a run, a kernel setting like the observation window: the union of what its rules read (each
rule's dry run, `probe.signals_read`: wrappers and hyperparameters included, e.g. `weighted` with a zero weight on
`attn` does not read it), or every signal on request ("all", to pool rows with other runs'). Every rule of a run
gets the same kernel; a rule that reads a signal the run's kernel does not measure is refused before the run.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

from ..rules.base import Rule
from .probe import RuleProbeError, signals_read
from .contract import rule_name
from .settings import ALL_SIGNALS, MEASURED_SIGNALS, signals_label


def rule_signals(rule: Rule) -> frozenset[str]:
    """The measured signals `rule` reads (`MEASURED_SIGNALS` among its dry run's reads). The dry run scores a copy
    of the rule: one that records its calls (a harness wrapper, a test's recorder) records nothing of it."""
    return signals_read(copy.deepcopy(rule)) & frozenset(MEASURED_SIGNALS)


def run_signals(rules: Iterable[Rule], signals: str | Iterable[str] | None = None) -> frozenset[str]:
    """The signal set of a run of `rules`: `signals` "all" (every measured signal), an explicit set (checked: every
    rule's reads in it), or None: the union of what the rules read (the `window` rule of sliding layers reads
    positions only: nothing measured).

    Raises:
        RuleProbeError: a rule reads a signal outside an explicit set (one line, naming both).
        ValueError: an unknown signal name or request.
    """
    rules = list(rules)
    if signals == ALL_SIGNALS:
        return frozenset(MEASURED_SIGNALS)
    if isinstance(signals, str):
        raise ValueError(f"signals must be {ALL_SIGNALS!r}, None (what the rules read) or a set of "
                         f"{', '.join(MEASURED_SIGNALS)}; got {signals!r}")
    if signals is None:
        return frozenset().union(*(rule_signals(r) for r in rules))
    chosen = frozenset(signals)
    unknown = chosen - set(MEASURED_SIGNALS)
    if unknown:
        raise ValueError(f"signals: {', '.join(sorted(unknown))} not measured by the kernel; the measured signals "
                         f"are {', '.join(MEASURED_SIGNALS)} (or {ALL_SIGNALS!r})")
    for r in rules:
        check_reads(r, chosen)
    return chosen


def check_reads(rule: Rule, signals: frozenset[str]) -> None:
    """Refuse `rule` on a kernel measuring `signals` if it reads a signal outside them (one line).

    Raises:
        RuleProbeError: naming the rule, the signals it reads that are not measured, and the set.
    """
    missing = rule_signals(rule) - signals
    if missing:
        raise RuleProbeError(f"rule {rule_name(rule)!r} reads {', '.join(sorted(missing))}, which this run's kernel "
                             f"does not measure (signals: {signals_label(signals)}); measure what the run's rules "
                             f"read (signals=None) or {ALL_SIGNALS!r}")
