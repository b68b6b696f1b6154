"""The report's "where the gain comes from" section: each decomposed rule (`fxbudget compare --decompose`) beside
`noprotect:<rule>` (its score, nothing force-kept), `protectonly:<rule>` (its protected tokens, the rest at random)
and `random`, by accuracy and answer likelihood, with the share of the rule's gain over `random` that
`protectonly:` alone recovers.

share = mean(protectonly - random) / mean(rule - random), over the samples all four ran (paired). Its interval is
the percentile bootstrap of that ratio: `stats.bootstrap_means` resamples the numerator's and the denominator's
per-sample differences with the same seed and length, so both are drawn on the same resampled samples. A share is
only meaningful when the rule does gain over random: where the paired interval of `rule - random` (`stats.paired_diff`)
includes 0 the share is printed without an interval and says so (a ratio over a gain that may be 0 has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .grouping import METRICS, budget_label, budgets, sample_id, setting, settings
from .stats import LEVEL, PairedDiff, bootstrap_means, paired_diff

NOPROTECT, PROTECTONLY, FLOOR = "noprotect:", "protectonly:", "random"


def decomposed_rules(rows: list[dict]) -> list[str]:
    """The rules whose decomposition the rows hold: the rule, `noprotect:` and `protectonly:` of it, and `random`."""
    names = {r["rule"] for r in rows}
    if FLOOR not in names:
        return []
    return sorted(n for n in names if not n.startswith((NOPROTECT, PROTECTONLY))
                  and NOPROTECT + n in names and PROTECTONLY + n in names)


@dataclass(frozen=True)
class Share:
    """The share of a rule's gain over random recovered by its protection alone, and its interval (None: why not
    in `reason`)."""

    value: float | None
    lo: float | None
    hi: float | None
    reason: str | None = None


def protection_share(rule, protectonly, random, level: float = LEVEL) -> Share:
    """`mean(protectonly - random) / mean(rule - random)` over paired samples, with its percentile bootstrap interval.

    Args:
        rule, protectonly, random: per-sample values, aligned (the same samples in the same order).
    Returns:
        A `Share`; without a value when the rule does not differ from random on average, without an interval when
        the paired interval of `rule - random` includes 0.
    """
    rule, protectonly, random = (np.asarray(x, dtype=np.float64) for x in (rule, protectonly, random))
    num, den = protectonly - random, rule - random
    if abs(den.mean()) < 1e-12:
        return Share(None, None, None, "the rule does not differ from random on these samples")
    value = float(num.mean() / den.mean())
    gain = paired_diff(rule, random, level)
    if not gain.bounded or gain.lo <= 0 <= gain.hi:
        return Share(value, None, None, "no interval: the rule's gain over random is not separated from 0")
    bn, bd = bootstrap_means(num), bootstrap_means(den)  # same seed and length: the same resampled samples
    ratios = bn[bd != 0] / bd[bd != 0]
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return Share(value, float(lo), float(hi))


@dataclass(frozen=True)
class Split:
    """One rule's decomposition at one setting, budget and metric: the four means over `n` paired samples, the gains
    over random (paired differences) and the share."""

    rule: str
    setting: str
    budget: object
    metric: str
    n: int
    means: dict  # "rule", "noprotect", "protectonly", "random" -> mean
    gain: PairedDiff  # rule - random
    protection: PairedDiff  # protectonly - random
    score: PairedDiff  # noprotect - random
    share: Share


def splits(rows: list[dict]) -> list[Split]:
    """Every decomposed rule's `Split` per setting, budget and metric (metrics the rows lack are left out)."""
    out = []
    for s in settings(rows):
        srs = [r for r in rows if setting(r) == s]
        for rule in decomposed_rules(srs):
            names = {"rule": rule, "noprotect": NOPROTECT + rule, "protectonly": PROTECTONLY + rule,
                     "random": FLOOR}
            for b in budgets(srs):
                for metric, field in METRICS.items():
                    values = {k: {sample_id(r): r[field] for r in srs if r["rule"] == n and budget_label(r) == b
                                  and r.get(field) is not None} for k, n in names.items()}
                    ids = sorted(set.intersection(*(set(v) for v in values.values())), key=str)
                    if not ids:
                        continue
                    v = {k: np.array([values[k][i] for i in ids]) for k in names}
                    out.append(Split(rule, s, b, metric, len(ids), {k: float(x.mean()) for k, x in v.items()},
                                     paired_diff(v["rule"], v["random"]), paired_diff(v["protectonly"], v["random"]),
                                     paired_diff(v["noprotect"], v["random"]),
                                     protection_share(v["rule"], v["protectonly"], v["random"])))
    return out


def _diff(d: PairedDiff, digits: int) -> str:
    from .tables import interval

    return interval(d, digits)


def _share(s: Share) -> str:
    if s.value is None:
        return f"- ({s.reason})"
    if s.lo is None:
        return f"{s.value:.2f} ({s.reason})"
    return f"{s.value:.2f} [{s.lo:.2f}, {s.hi:.2f}]"


INTRO = ("`noprotect:<rule>`: the rule's score, nothing force-kept; `protectonly:<rule>`: the rule's protected tokens "
         "(sinks, window), the rest at random (`random`'s own draw). **share from protection** = (protectonly − "
         "random) / (rule − random): the part of the rule's gain over random that its protected set alone recovers "
         "(1: all of it, 0: none; above 1: random plus the protection does better than the rule). Differences are "
         "paired on the samples all four ran, mean [95% interval]; the share's interval is a paired bootstrap. "
         "Accuracy: mean score; likelihood: mean answer log-prob per token (nats).")


def decomposition_section(rows: list[dict], heading: str = "##") -> list[str]:
    """The report's lines for the section (empty when no rule was decomposed)."""
    found = splits(rows)
    if not found:
        return []
    several = len({s.setting for s in found}) > 1
    parts = [f"{heading} where the gain comes from: score or protection", "", INTRO, "",
             "| rule | " + ("setting | " if several else "") + "budget | metric | samples | rule | noprotect: | "
             "protectonly: | random | rule − random | protectonly − random | noprotect − random | "
             "share from protection |", "|---" * (12 + several) + "|"]
    for s in found:
        digits = 2 if s.metric == "accuracy" else 3
        m = s.means
        parts.append(f"| {s.rule} | " + (f"{s.setting} | " if several else "") + f"{s.budget} | {s.metric} | {s.n} | "
                     + " | ".join(f"{m[k]:.{digits}f}" for k in ("rule", "noprotect", "protectonly", "random"))
                     + f" | {_diff(s.gain, digits)} | {_diff(s.protection, digits)} | {_diff(s.score, digits)} | "
                     f"{_share(s.share)} |")
    return parts + [""]
