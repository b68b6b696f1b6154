"""The held-out verdict: does the searched rule beat every built-in rule (the report's paired test)?"""

from __future__ import annotations

import math
from statistics import mean


def verdict(rows: list[dict], name: str, metric: str) -> tuple[bool | None, str]:
    """Whether the searched rule `name` beats every other budgeted rule in `rows` by `metric` on held-out data:
    it has the best mean and is alone in tier 1 of the paired test (Holm-adjusted sign-flip p < 0.05 against each).

    Returns:
        `(beats, sentence)`; `beats` is None when the metric is missing.
    """
    from ..report import paired
    from ..stats import leaders, no_interval_reason

    def span(lo: float, hi: float, n: int) -> str:  # never [-inf, inf]: the reason instead
        if math.isfinite(lo) and math.isfinite(hi):
            return f"[{lo:.{digits}f}, {hi:.{digits}f}]"
        return f"({no_interval_reason(n)})"

    ranked_by_budget = paired(rows, metric)
    if not ranked_by_budget:
        return None, f"by {metric}: no paired values"
    (n, ranked), = ranked_by_budget.values()
    by_rule = {r.rule: r for r in ranked}
    if name not in by_rule:
        return None, f"by {metric}: {name} has no values"
    digits = 2 if metric == "accuracy" else 3
    if len({r.mean for r in ranked}) == 1:
        return False, f"by {metric} ({n} paired samples): no difference, every rule has the mean {ranked[0].mean:.3g}"
    best = ranked[0]
    shared = leaders(ranked)
    if name in shared and len(shared) > 1:
        others = [r for r in shared if r != name]
        return False, (f"by {metric} ({n} paired samples): {name} **does not beat** every built-in rule: it shares the "
                       f"best mean ({best.mean:.{digits}f}) with {', '.join(others)}")
    if best.rule == name:
        rival, ties = ranked[1], [r.rule for r in ranked[1:] if r.tier == 1]
        d = rival.vs_best  # rival minus the searched rule
        lead = (f"ahead of {rival.rule}, the best built-in rule, by {-d.mean:.{digits}f} {span(-d.hi, -d.lo, d.n)}, "
                f"Holm p = {rival.p_holm:.3f}")
        if not ties:
            return True, f"by {metric} ({n} paired samples): **{name} beats every built-in rule**: {lead}"
        return False, (f"by {metric} ({n} paired samples): {name} has the best mean but is **not separated** from "
                       f"{', '.join(ties)} at this sample size: {lead}")
    own = by_rule[name]
    d = own.vs_best
    where = "not separated from it (tier 1)" if own.tier == 1 else f"worse (tier {own.tier})"
    top = f"the best built-in rule {best.rule}" if len(shared) == 1 else \
        f"{best.rule}, one of the built-in rules sharing the best mean ({', '.join(shared)})"
    return False, (f"by {metric} ({n} paired samples): {name} **does not beat** {top}: {d.mean:+.{digits}f} "
                   f"{span(d.lo, d.hi, d.n)}, Holm p = {own.p_holm:.3f}, {where}")


def holdout_means(rows: list[dict]) -> dict[str, dict]:
    """Per rule: held-out samples, mean answer log-prob per token (absolute, as the objective) and accuracy."""
    out = {}
    for rule in dict.fromkeys(r["rule"] for r in rows):
        rs = [r for r in rows if r["rule"] == rule]
        lp = [r["answer_logprob_mean"] for r in rs if r.get("answer_logprob_mean") is not None]
        out[rule] = {"samples": len(rs), "likelihood": mean(lp) if lp else None,
                     "accuracy": mean(r["score"] for r in rs)}
    return out
