"""The report's opening paragraph: the answer first. Per setting and budget, which rule(s) lead by the report's
sort metric, whether the paired test separates the leader from the others at this sample size (`stats.rank`), and,
where it does not, how many paired samples would separate the leader from the lowest rule not yet separated from it
(`stats.samples_for_power`, a projection from the observed differences; more than the samples at hand, since
these did not separate it). The statistical terms are in the report's glossary, not here."""

from __future__ import annotations

from .grouping import budgets, setting, settings
from .stats import ALPHA, leaders, samples_for_power, samples_to_separate, smallest_p
from .tables import paired, paired_values


def _names(rules: list[str]) -> str:
    return ", ".join(rules[:-1]) + f" and {rules[-1]}" if len(rules) > 1 else rules[0]


def _budget_clause(rows, metric: str, b) -> tuple[str, bool, tuple[int, str, str] | None, float] | None:
    """One clause on budget `b`, whether the leader is separated from every other rule, `(samples, leader,
    rule)`: the projected paired samples that would separate the leader from the lowest rule not separated from it
    (None: settled, or no difference to project from), and the leader's mean. None when budget `b` has nothing to
    compare."""
    got = paired(rows, metric).get(b)
    if got is None:
        return None
    n, ranked = got
    digits = 2 if metric == "accuracy" else 3
    lead, top = leaders(ranked), ranked[0]
    others = len(ranked) - 1
    same = [r.rule for r in ranked[1:] if r.tier == 1]
    if len({r.mean for r in ranked}) == 1:
        who = f"all {len(ranked)} rules tie ({metric} {top.mean:.{digits}f})"
    elif len(lead) > 1:
        who = f"{_names(lead)} share the lead ({metric} {top.mean:.{digits}f})"
    else:
        who = f"**{top.rule}** leads ({metric} {top.mean:.{digits}f})"
    if len({r.mean for r in ranked}) == 1:
        sure = f"on {n} paired samples"
    elif not same:
        sure = f"ahead of every other rule (separated; {n} paired samples)"
    elif len(same) == others and smallest_p(n, others) >= ALPHA:
        # Say why, or 0.00 against 1.00 not separated reads like a broken test.
        even = "even 0.00 from 1.00" if metric == "accuracy" else "any difference, however large"
        sure = (f"but not separated from any other rule: {n} paired sample{'s' if n != 1 else ''} cannot separate "
                f"{even} (the paired test's smallest possible p is 2/2^{n} = {2.0 ** (1 - n):.3g}; a pair needs at "
                f"least {samples_to_separate(others)} paired samples, every one won by the same rule)")
    elif len(same) == others:
        sure = f"but not separated from any other rule ({n} paired samples)"
    else:
        sure = f"separated from {others - len(same)} of the other {others} but not from {_names(same)} ({n} " \
               "paired samples)"
    need = None
    if same:  # the closest separation still open: the leader against the lowest rule not separated from it
        target = same[-1]
        values = paired_values(rows, metric, b)
        got = samples_for_power(values[top.rule] - values[target], others)
        need = None if got is None else (max(got, n + 1), top.rule, target)  # not separated at n: more than n
    return f"at B={b}, {who}{' ' if sure.startswith('on ') else ', '}{sure}", not same, need, top.mean


def _tie_advice(metric: str, means: list[float], protocols: set[str]) -> str:
    """What would separate rules that score the same on average, by where they tie: at accuracy 0 every rule lost
    the answer (an easier task, a larger budget, or asking the question before compressing would tell them apart);
    at 1 none did (a harder task or a smaller budget would)."""
    if metric != "accuracy":
        return "a different task or budget would"
    ways = []
    if any(m == 0.0 for m in means):
        more = " or a larger budget" if protocols <= {"query-aware"} else \
            ", a larger budget or `--protocol query-aware` (the question seen before compressing)"
        ways.append(f"where every rule scored 0.00, an easier task{more} would")
    if any(m == 1.0 for m in means):
        ways.append("where every rule scored 1.00, a harder task or a smaller budget would")
    if any(0.0 < m < 1.0 for m in means):
        ways.append("elsewhere, a different task or budget would")
    return "; ".join(ways)


def lead_paragraph(rows: list[dict], sort: str = "accuracy") -> str:
    """The paragraph (Markdown, one line) that opens a report; a sentence that nothing can be compared when no
    budget has two budgeted rules on common samples."""
    several = len(settings(rows)) > 1
    clauses, needs, open_, tied = [], [], 0, []
    for s in settings(rows):
        srs = [r for r in rows if setting(r) == s]
        for b in budgets(srs):
            got = _budget_clause(srs, sort, b)
            if got is None:
                continue
            text, settled, need, mean = got
            clauses.append(f"{s}, {text}" if several else text)
            open_ += not settled
            if need is not None:
                needs.append((f"{s}, B={b}" if several else f"B={b}", *need))
            elif not settled:
                tied.append(mean)
    if not clauses:
        return ("**Answer:** nothing to compare: no budget has two budgeted rules on the same samples (add rules or "
                "budgets).")
    text = "**Answer** (by " + sort + "): " + "; ".join(clauses) + "."
    if needs:
        text += (" To settle it: about " + "; ".join(f"{n} paired samples at {where} ({top} against {other})"
                                                     for where, n, top, other in needs)
                 + " would separate the leader from the lowest rule not yet separated from it with 80% power "
                 "(projected from these samples' differences: a guide, not a promise).")
    if open_ > len(needs):
        text += (" Where the leader and the rules not separated from it score the same on average, no number of "
                 "such samples separates them: " + _tie_advice(sort, tied, {r.get("protocol", "") for r in rows}) + ".")
    if not open_:
        text += " Each leader is separated from every other rule at its budget."
    return text
