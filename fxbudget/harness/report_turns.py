"""The report's tables for the shared-context protocols (`multi-request`, `multi-turn`): accuracy and answer
likelihood per request (`turn`), each rule's decay over the turns (its later turns against its first, paired over
samples), and the paired comparisons of the rules at each turn.

A rule that kept only what the first question needed scores on turn 1 and fails the later ones: the decay column says
so with an interval, where the table pooled over turns would only show a lower mean.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

from .grouping import logprob_delta, reference_logprobs
from .runner import REFERENCE
from .stats import ALPHA, holm, mean_interval, paired_diff, samples_to_separate, smallest_p
from .tables import _rule_budgets, cell, interval, paired_tables, rule_name


def has_turns(rows) -> bool:
    """Whether `rows` hold requests of a shared-context protocol (rows with a `turn`)."""
    return any(r.get("turn") is not None for r in rows)


def _base(row) -> tuple:
    """The sample a request belongs to (its `sample_id` without the protocol and turn)."""
    return row["model"], row["task"], row.get("length"), row["sample"], row["seed"]


def _turns(rows) -> list[int]:
    return sorted({r["turn"] for r in rows if r.get("turn") is not None})


def decay(rows) -> tuple | None:
    """`PairedDiff` of a rule's mean score over turns 2..k minus its turn-1 score, paired over the samples that ran
    every turn (one rule and budget's rows); None with fewer than two turns."""
    per: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in rows:
        per[_base(r)][r["turn"]] = r["score"]
    ts = _turns(rows)
    if len(ts) < 2:
        return None
    ids = sorted((i for i, s in per.items() if set(s) == set(ts)), key=str)
    if not ids:
        return None
    first = [per[i][ts[0]] for i in ids]
    later = [mean(per[i][t] for t in ts[1:]) for i in ids]
    return paired_diff(later, first)


def turn_table(rows, sort: str = "accuracy") -> str:
    """Markdown: per rule and budget, the mean score [95% interval] (samples) of each turn, then the decay (the later
    turns' mean minus turn 1, paired over samples) [95% interval] and its sign-flip p, Holm-adjusted over the rules
    of the budget; the verdict lines under it (`decay_verdict`)."""
    ts = _turns(rows)
    lines = ["| rule | budget | " + " | ".join(f"turn {t}" for t in ts) + " | later − turn 1 [95% CI] | p (Holm) |",
             "|---" * (len(ts) + 4) + "|"]
    groups = list(_rule_budgets(rows, sort))
    decays = {(rule, b): decay(rs) for rule, b, rs in groups}
    by_budget = defaultdict(list)
    for (rule, b), d in decays.items():
        if d is not None:
            by_budget[b].append(rule)
    adjusted = {}
    for b, rules in by_budget.items():
        for rule, p in zip(rules, holm([decays[(rule, b)].p for rule in rules])):
            adjusted[(rule, b)] = p
    for rule, b, rs in groups:
        cells = []
        for t in ts:
            scores = [r["score"] for r in rs if r["turn"] == t]
            cells.append(cell(mean_interval(scores)) if scores else "-")
        d = decays[(rule, b)]
        lines.append(f"| {rule_name(rule)} | {b if b is not None else '-'} | " + " | ".join(cells) + " | "
                     + (f"{interval(d)} | {adjusted[(rule, b)]:.3f} |" if d is not None else "- | - |"))
    depths = [[r["depth"] for r in rows if r["turn"] == t and r.get("depth") is not None] for t in ts]
    if all(depths):  # what each turn asked: a turn of deeper needles is not a decay
        lines.append("| *asked needle's depth (mean)* | | " + " | ".join(f"*{mean(d):.2f}*" for d in depths) + " | | |")
    verdict = decay_verdict({k: (decays[k], p) for k, p in adjusted.items()})
    return "\n".join(lines) + ("\n\n" + "\n".join(verdict) if verdict else "")


def decay_verdict(got: dict, alpha: float = ALPHA) -> list[str]:
    """The lines on the decays of a table: the rules whose later turns score lower than their first (Holm p <
    `alpha`), else that the sample size cannot tell (the smallest p it can give) or that none does."""
    if not got:
        return []
    down = [f"{rule} (B={b})" if b is not None else rule for (rule, b), (d, p) in got.items()
            if p < alpha and d.mean < 0]
    if down:
        return [f"- later turns score lower than the first (Holm p < {alpha:g}): " + ", ".join(f"**{x}**"
                                                                                            for x in down)]
    n = max(d.n for d, _ in got.values())
    m = max(sum(1 for (_, b2) in got if b2 == b) for (_, b) in got)
    if smallest_p(n, m) >= alpha:
        return [f"- {n} paired sample{'s' if n != 1 else ''} cannot tell whether a rule decays over the turns: the "
                f"paired test's smallest possible p is {smallest_p(n, m):.3g} (Holm over {m}), not below {alpha:g}; "
                f"that needs at least {samples_to_separate(m, alpha)} paired samples, every one lower on the later "
                "turns."]
    return [f"- no rule's later turns score lower than its first at this sample size (Holm p < {alpha:g})"]


def likelihood_turn_table(rows, sort: str = "accuracy") -> str | None:
    """Markdown: per rule and budget, the mean answer log-prob per token minus the unmodified model's on the same
    request, per turn [95% interval] (samples); None without the metric or reference rows."""
    refs = reference_logprobs(rows)
    if not refs:
        return None
    ts = _turns(rows)
    lines = ["| rule | budget | " + " | ".join(f"turn {t}: Δ vs full" for t in ts) + " |", "|---" * (len(ts) + 2) + "|"]
    found = False
    for rule, b, rs in _rule_budgets(rows, sort):
        if rule == REFERENCE:
            continue
        cells = []
        for t in ts:
            deltas = [d for d in (logprob_delta(r, refs) for r in rs if r["turn"] == t) if d is not None]
            found |= bool(deltas)
            cells.append(cell(mean_interval(deltas, paired=True), 3) if deltas else "-")
        lines.append(f"| {rule} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if found else None


def turn_sections(rows, sort: str, details: str) -> list[str]:
    """The report's lines for one protocol section's shared-context rows, per task (its number of turns is its
    own): the per-turn accuracy and decay, the per-turn likelihood, the paired comparisons at each turn (collapsed
    in `details`, a format string taking the summary)."""
    parts = []
    for task in sorted({r["task"] for r in rows}):
        trs = [r for r in rows if r["task"] == task and r.get("turn") is not None]
        if not trs:
            continue
        parts += [f"### per request: {task}", "", "accuracy of each request (turn), and each rule's decay: its later "
                  "turns' mean score minus its first turn's, paired over samples:", "", turn_table(trs, sort), ""]
        lik = likelihood_turn_table(trs, sort)
        if lik:
            parts += ["answer log-likelihood per token, the rule minus the unmodified model on the same request "
                      "(nats), per turn:", "", lik, ""]
        pairs = []
        for t in _turns(trs):
            text = paired_tables([r for r in trs if r["turn"] == t], sort, heading="####")
            if text:
                pairs += [f"turn {t}:", "", text, ""]
        if pairs:
            parts += [details.format(f"paired comparisons per turn ({task})"), ""] + pairs + ["</details>", ""]
    return parts


__all__ = ["decay", "decay_verdict", "has_turns", "likelihood_turn_table", "turn_sections", "turn_table"]
