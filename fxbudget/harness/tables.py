"""The report's Markdown tables: accuracy and answer likelihood per rule x budget, the paired comparisons per budget
(`stats.rank`), output length and end-to-end time beside accuracy with each rule's answer length against the
unmodified model's (paired), and the cost per rule and budget."""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import mean

import numpy as np

from .grouping import (METRICS, budget_label, budget_order, budgets, logprob_delta, mean_or_none, metric_values,
                       reference_logprobs, rule_order, sample_id, setting, settings)
from .runner import REFERENCE
from .stats import (ALPHA, holm, leaders, mean_interval, no_interval_reason, paired_diff, rank, samples_to_separate,
                    separation_sentence, smallest_p, undecided)


def _columns(rows, by_setting: bool) -> list[tuple[str, str | None, object]]:
    """Table columns `(header, setting or None, budget label)`: one per budget, or per setting and budget."""
    labels = budgets(rows)
    if not by_setting:
        return [(f"B={b}", None, b) for b in labels]
    present = {(setting(r), budget_label(r)) for r in rows if r["budget"] is not None}
    return [(f"{s}, B={b}", s, b) for s in settings(rows) for b in labels if (s, b) in present]


def _cells(rows, rule, column) -> list[dict]:
    _, s, b = column
    return [r for r in rows if r["rule"] == rule and (s is None or setting(r) == s)
            and (rule == REFERENCE or budget_label(r) == b)]


def rule_name(rule: str) -> str:
    """A rule's name in a table's first column (the reference says what it is)."""
    return "full (unmodified model)" if rule == REFERENCE else rule


def interval(iv, digits: int = 2) -> str:
    """`mean [lo, hi]` of a `stats.Interval` or `stats.PairedDiff`; without finite ends `mean (n=2: too few samples
    for an interval)`: an unbounded interval is said in words, never printed as `[-inf, inf]`."""
    if not iv.bounded:
        return f"{iv.mean:.{digits}f} ({no_interval_reason(iv.n)})"
    return f"{iv.mean:.{digits}f} [{iv.lo:.{digits}f}, {iv.hi:.{digits}f}]"


def cell(iv, digits: int = 2) -> str:
    """A table cell: `mean [lo, hi] (samples)`, or `interval`'s sentence (which names the samples) when unbounded."""
    return interval(iv, digits) + (f" ({iv.n})" if iv.bounded else "")


def _rule_table(rows: list[dict], sort: str, by_setting: bool, cell_of, headers=("",)) -> str:
    """Markdown: one line per rule (in `sort` order), per budget (and setting) column one column per entry of
    `headers` (appended to the column's name); `cell_of(rule, rows)` writes that rule's cells of a column (one per
    header)."""
    cols = _columns(rows, by_setting)
    names = [c[0] + h for c in cols for h in headers]
    lines = ["| rule | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for rule in rule_order(rows, sort):
        cells = [x for col in cols for x in _as_list(cell_of(rule, _cells(rows, rule, col)), len(headers))]
        lines.append(f"| {rule_name(rule)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _as_list(value, n: int) -> list[str]:
    return list(value) if isinstance(value, (list, tuple)) else [value] + [""] * (n - 1)


def accuracy_table(rows: list[dict], sort: str = "accuracy", *, by_setting: bool = False,
                   note: bool = True) -> str:
    """Markdown: mean score [95% interval] (samples) per rule (rows) x budget (columns) over `rows`; the reference
    row spans all budgets. `by_setting` puts the protocols (settings) side by side.

    Args:
        note: add `separation_note` under the table (after a blank line) when some column's sample size cannot
            separate any two rules.
    """
    def cell_of(rule, rs) -> str:
        return cell(mean_interval([r["score"] for r in rs])) if rs else ""

    table = _rule_table(rows, sort, by_setting, cell_of)
    text = separation_note(rows, "accuracy", by_setting) if note else None
    return table + (f"\n\n{text}" if text else "")


def separation_note(rows: list[dict], metric: str = "accuracy", by_setting: bool = False) -> str | None:
    """One sentence (`stats.separation_sentence`) for the columns (budget, and setting when `by_setting`) whose
    paired samples cannot separate any two budgeted rules by `metric`; None when every column can."""
    found = {}
    for header, s, b in _columns(rows, by_setting):
        rs = [r for r in rows if s is None or setting(r) == s]
        got = paired(rs, metric).get(b)
        if got is not None:
            n, ranked = got
            text = separation_sentence(n, len(ranked))
            if text:
                found.setdefault(text, []).append(header)
    if not found:
        return None
    if len(found) == 1 and len(next(iter(found.values()))) == len(_columns(rows, by_setting)):
        return next(iter(found))
    return " ".join(f"{', '.join(headers)}: {text}" for text, headers in found.items())


def reference_note(rows: list[dict]) -> str | None:
    """What the two kinds of likelihood column hold, with the unmodified model's value over `rows` as the example
    (None without reference rows that have the metric)."""
    own = metric_values([r for r in rows if r["rule"] == REFERENCE], "likelihood")
    if not own:
        return None
    m = mean(own)
    return (f"`log-prob/token` is absolute: the mean log-prob per gold-answer token (the unmodified model's {m:.3f} "
            f"= a gold token has probability {math.exp(m):.2f} on average, geometric mean). `Δ vs full` is relative: "
            "the rule minus the unmodified model on the same sample (0 = no loss, -0.69 = each answer token half as "
            "likely); its interval inverts the paired sign-flip test, which bounds nothing below 6 samples.")


def likelihood_heading(rows: list[dict]) -> str:
    """The line above `likelihood_table(rows)`: what its columns hold (the `Δ vs full` column only with reference
    rows, as in the table)."""
    own = "`log-prob/token`: the rule's own mean log-prob per answer token, mean (samples)"
    if not reference_logprobs(rows):
        return f"answer log-likelihood per token (nats): {own}; no unmodified-model rows, so no `Δ vs full` column"
    return (f"answer log-likelihood per token (nats): {own}; `Δ vs full`: the rule minus the unmodified model on the "
            "same sample, mean [95% interval] (samples)")


def likelihood_table(rows: list[dict], sort: str = "accuracy", *, by_setting: bool = False,
                     note: bool = True) -> str | None:
    """Markdown: per rule x budget, two columns: `log-prob/token`, the mean over samples of the answer's mean
    log-prob per token (absolute), and `Δ vs full`, the mean of that minus the unmodified model's on the same sample
    [95% interval] (samples) (relative; the reference row's is `—`). Without reference rows, only the absolute
    columns.

    Args:
        note: add `reference_note` under the table (after a blank line).
    Returns:
        The table, or None if no row has the metric.
    """
    if not metric_values(rows, "likelihood"):
        return None
    refs = reference_logprobs(rows)

    def cell_of(rule, rs) -> list[str]:
        values = metric_values(rs, "likelihood")
        own = f"{mean(values):.3f} ({len(values)})" if values else ""
        if not refs:
            return [own]
        if rule == REFERENCE:
            return [own, "— (reference)" if values else ""]
        deltas = [d for d in (logprob_delta(r, refs) for r in rs) if d is not None]
        return [own, cell(mean_interval(deltas, paired=True), 3) if deltas else ""]

    headers = (": log-prob/token", ": Δ vs full") if refs else (": log-prob/token",)
    table = _rule_table(rows, sort, by_setting, cell_of, headers)
    text = reference_note(rows) if note else None
    return table + (f"\n\n{text}" if text else "")


def paired(rows: list[dict], metric: str) -> dict:
    """Per budget label: `(samples, ranking)` of the rules on the samples every one of them ran (`stats.rank`).

    Budgets where fewer than two rules have the metric on common samples are left out.
    """
    out = {}
    for b in budgets(rows):
        values = paired_values(rows, metric, b)
        if values:
            out[b] = (len(next(iter(values.values()))), rank(values))
    return out


def paired_values(rows: list[dict], metric: str, b) -> dict[str, np.ndarray] | None:
    """Per budgeted rule at budget label `b`: its `metric` values on the samples every one of them ran, aligned;
    None when fewer than two rules have the metric on common samples."""
    by_rule: dict[str, dict] = defaultdict(dict)
    for r in rows:
        if r["rule"] != REFERENCE and budget_label(r) == b and r.get(METRICS[metric]) is not None:
            by_rule[r["rule"]][sample_id(r)] = r[METRICS[metric]]
    common = set.intersection(*(set(v) for v in by_rule.values())) if by_rule else set()
    if len(by_rule) < 2 or not common:
        return None
    ids = sorted(common, key=str)
    return {rule: np.array([v[i] for i in ids]) for rule, v in by_rule.items()}


def _diff_cells(ranked: dict, rule: str, digits: int, tied: bool, open_: set) -> list[str]:
    r = ranked.get(rule)
    if r is None:
        return ["-", "-", "-"]
    tier = "undecided" if rule in open_ else str(r.tier)  # `stats.undecided`: no standing at this sample size
    if r.vs_best is None:
        return ["top (tied)" if tied else "top", "", tier]
    return [interval(r.vs_best, digits), f"{r.p_holm:.3f}", tier]


def verdict(metric: str, ranked: list) -> str:
    """One line on a ranking (`stats.rank`): "best" only for a rule ahead of every other one at this sample size;
    a lead that is not separated says "highest mean", a lead shared by several rules says "no single best"."""
    digits = 2 if metric == "accuracy" else 3
    if len({r.mean for r in ranked}) == 1:
        return f"- by {metric}: every rule has the same mean ({ranked[0].mean:.{digits}f}): no best"
    top, lead = ranked[0].rule, leaders(ranked)
    same = [r.rule for r in ranked[1:] if r.tier == 1]
    if len(lead) > 1:
        return (f"- by {metric}: no single best: {', '.join(lead)} share the highest mean ({ranked[0].mean:.{digits}f}); "
                f"not separated from {top} at this sample size: {', '.join(same) if same else 'none'}")
    if same:
        return f"- by {metric}: highest mean **{top}**; not separated from it at this sample size: {', '.join(same)}"
    return f"- by {metric}: best **{top}**, separated from every other rule (Holm p < 0.05)"


def paired_tables(rows: list[dict], sort: str = "accuracy", heading: str = "####") -> str:
    """Markdown: for each budget, the rules ranked by `sort`, each against the top one by accuracy and by answer
    log-likelihood: paired difference [95% interval], sign-flip permutation p (Holm-adjusted over the comparisons
    with the top), tier (1 = not separated from the top; "undecided" when separated neither from the top nor from
    the last rule); a line per metric on who leads (`verdict`) and, when the sample size cannot separate any pair, the sentence saying so."""
    acc, lik = paired(rows, "accuracy"), paired(rows, "likelihood")
    refs = reference_logprobs(rows)
    parts = []
    for b in budgets(rows):
        if b not in acc and b not in lik:
            continue
        ranks = {"accuracy": {r.rule: r for r in acc.get(b, (0, []))[1]},
                 "likelihood": {r.rule: r for r in lik.get(b, (0, []))[1]}}
        order = [r for r in (x.rule for x in (acc if sort == "accuracy" else lik).get(b, (0, []))[1])]
        order += sorted((set(ranks["accuracy"]) | set(ranks["likelihood"])) - set(order))
        n = max(acc.get(b, (0,))[0], lik.get(b, (0,))[0])
        parts += [f"{heading} B={b}: {n} paired samples", ""]
        notes = []
        for metric, got in (("accuracy", acc.get(b)), ("likelihood", lik.get(b))):
            if got:
                parts.append(verdict(metric, got[1]))
                text = separation_sentence(got[0], len(got[1]))
                if text and text not in notes:
                    notes.append(text)
        parts += [f"- {text}" for text in notes]
        tied = {m: len(leaders(list(ranks[m].values()))) > 1 for m in ranks}
        open_ = {m: undecided(paired_values(rows, m, b) or {}) for m in ranks}
        parts += ["", "| rule | accuracy [95% CI] | Δ vs top | p (Holm) | tier | log-lik/token vs full | Δ vs top "
                  "| p (Holm) | tier |", "|---" * 9 + "|"]
        for rule in order:
            rs = [r for r in rows if r["rule"] == rule and budget_label(r) == b]
            acc_cell = interval(mean_interval([r["score"] for r in rs])) if rs else "-"
            deltas = [d for d in (logprob_delta(r, refs) for r in rs) if d is not None]
            lik_cell = f"{mean(deltas):.3f}" if deltas else "-"
            parts.append(f"| {rule} | {acc_cell} | " + " | ".join(_diff_cells(ranks["accuracy"], rule, 2,
                                                                                tied["accuracy"], open_["accuracy"])) +
                         f" | {lik_cell} | " + " | ".join(_diff_cells(ranks["likelihood"], rule, 3,
                                                                       tied["likelihood"], open_["likelihood"])) + " |")
        parts.append("")
    return "\n".join(parts).rstrip()


def mean_mib(rows, key) -> float | None:
    """Mean of `key` in MiB (None if a row lacks it: rows written before KV bytes were split into held/allocated had
    one `kv_bytes`, the allocated bytes)."""
    values = [r.get(key, r.get("kv_bytes") if key == "kv_allocated_bytes" else None) for r in rows]
    return None if any(v is None for v in values) else mean(values) / 2**20


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def end_to_end_s(row: dict) -> float:
    """A row's end-to-end seconds: prefill (the shared forward included) plus decode to the last token (the question
    as the protocol appends it, then every generated token); the likelihood pass is not part of answering."""
    return row["prefill_s"] + row["decode_s"]


def _rule_budgets(rows, sort: str):
    """`(rule, budget label, rows)` in `sort` order, each rule's budgets increasing (the reference's is None)."""
    for rule in rule_order(rows, sort):
        groups = defaultdict(list)
        for r in rows:
            if r["rule"] == rule:
                groups[budget_label(r)].append(r)
        for budget in sorted(groups, key=lambda b: (b is not None, budget_order(b) if b is not None else ())):
            yield rule, budget, groups[budget]


def at_limit(rows) -> tuple[int, int] | None:
    """`(answers that stopped at their max_new_tokens, answers)` over `rows`; None when a row does not record its
    limit (`max_new_tokens`): there a length may be the limit's, not the model's, and the report cannot tell."""
    if not rows or any(r.get("max_new_tokens") is None for r in rows):
        return None
    return sum(r["output_tokens"] >= r["max_new_tokens"] for r in rows), len(rows)


def length_table(rows, sort: str = "accuracy") -> str:
    """Markdown: per rule and budget, the mean score [95% interval] (samples) beside the mean output tokens and the
    mean end-to-end seconds (`end_to_end_s`); with rows that record their limit, how many answers reached it."""
    limits = at_limit(rows) is not None
    lines = ["| rule | budget | accuracy | output tokens | end-to-end s |" + (" at max_new_tokens |" if limits else ""),
             "|---" * (5 + limits) + "|"]
    for rule, budget, rs in _rule_budgets(rows, sort):
        cut = at_limit(rs)
        lines.append(f"| {rule_name(rule)} | {budget if budget is not None else '-'} | "
                     f"{cell(mean_interval([r['score'] for r in rs]))} | "
                     f"{mean(r['output_tokens'] for r in rs):.1f} | {mean(end_to_end_s(r) for r in rs):.2f} |"
                     + (f" {cut[0]}/{cut[1]} |" if limits else ""))
    return "\n".join(lines)


def length_pairs(rows) -> dict:
    """Per budget label: `{rule: (PairedDiff of output tokens, rule minus the unmodified model, on the samples both
    ran; Holm-adjusted p over that budget's rules)}`. Empty without reference rows."""
    ref = {sample_id(r): r["output_tokens"] for r in rows if r["rule"] == REFERENCE}
    out = {}
    for b in budgets(rows):
        diffs = {}
        for rule in sorted({r["rule"] for r in rows if budget_label(r) == b}):
            own = {sample_id(r): r["output_tokens"] for r in rows if r["rule"] == rule and budget_label(r) == b}
            ids = sorted(set(own) & set(ref), key=str)
            if ids:
                diffs[rule] = paired_diff([own[i] for i in ids], [ref[i] for i in ids])
        if diffs:
            out[b] = dict(zip(diffs, zip(diffs.values(), holm([d.p for d in diffs.values()]))))
    return out


def length_verdict(pairs: dict, alpha: float = ALPHA) -> list[str]:
    """The lines on one budget's `length_pairs`: the rules that lengthen (or shorten) answers against the unmodified
    model (Holm p < `alpha`), else that none does at this sample size, or that the sample size cannot tell."""
    longer = [r for r, (d, p) in pairs.items() if p < alpha and d.mean > 0]
    shorter = [r for r, (d, p) in pairs.items() if p < alpha and d.mean < 0]
    lines = []
    if longer:
        lines.append(f"- lengthens answers against the unmodified model (Holm p < {alpha:g}): "
                     + ", ".join(f"**{r}**" for r in longer))
    if shorter:
        lines.append(f"- shortens answers against the unmodified model (Holm p < {alpha:g}): "
                     + ", ".join(f"**{r}**" for r in shorter))
    n, m = max(d.n for d, _ in pairs.values()), len(pairs)
    if not longer and smallest_p(n, m) >= alpha:
        holm_part = f"; Holm over the {m} comparisons with full: {smallest_p(n, m):.3g}" if m > 1 else ""
        lines.append(f"- {n} paired sample{'s' if n != 1 else ''} cannot tell whether a rule lengthens answers, "
                     f"whatever their lengths: the paired test's smallest possible p is 2/2^{n} = {2.0 ** (1 - n):.3g}"
                     f"{holm_part}, not below {alpha:g}; that needs at least {samples_to_separate(m, alpha)} paired "
                     "samples, every one longer than the unmodified model's.")
    elif not longer:
        lines.append("- no rule lengthens answers against the unmodified model at this sample size (none has longer "
                     f"answers with Holm p < {alpha:g})")
    return lines


def length_tables(rows, heading: str = "####") -> str | None:
    """Markdown: per budget, each rule's output tokens against the unmodified model's on the same samples: both
    means, the paired difference [95% interval], the sign-flip p (Holm-adjusted over the budget's rules), and
    `length_verdict`. None without reference rows or budgeted rules on their samples."""
    pairs = length_pairs(rows)
    if not pairs:
        return None
    ref = {sample_id(r): r["output_tokens"] for r in rows if r["rule"] == REFERENCE}
    parts = []
    for b, got in pairs.items():
        parts += [f"{heading} B={b}: output tokens vs the unmodified model", ""] + length_verdict(got)
        cut = at_limit([r for r in rows if (r["rule"] == REFERENCE and sample_id(r) in ref)
                        or (r["rule"] in got and budget_label(r) == b)])
        if cut and cut[0]:
            parts.append(f"- {cut[0]} of {cut[1]} answers compared here stopped at their max_new_tokens: there a "
                         "length is the limit's, not the model's (a longer --max-new-tokens shows how far it runs)")
        parts += ["", "| rule | samples | full tokens | rule tokens | Δ tokens [95% CI] | p (Holm) |",
                  "|---" * 6 + "|"]
        for rule, (d, p) in got.items():
            own = [r for r in rows if r["rule"] == rule and budget_label(r) == b and sample_id(r) in ref]
            full = mean(ref[sample_id(r)] for r in own)
            parts.append(f"| {rule} | {d.n} | {full:.1f} | {mean(r['output_tokens'] for r in own):.1f} | "
                         f"{interval(d, 1)} | {p:.3f} |")
        parts.append("")
    return "\n".join(parts).rstrip()


def cost_table(rows, sort: str = "accuracy") -> str:
    """Markdown: per rule and budget, the mean prefill (the shared forward apart from the row's branch), decode,
    end-to-end (`end_to_end_s`) and likelihood seconds, output tokens, KV memory held and allocated, and the compile
    seconds summed."""
    lines = ["| rule | budget | prefill s | decode s | end-to-end s | likelihood s | output tokens | "
             "KV MiB held / allocated | compile s |",
             "|---" * 9 + "|"]
    for rule, budget, rs in _rule_budgets(rows, sort):
        prefill = f"{mean(r['prefill_s'] for r in rs):.2f}"
        if rs[0].get("shared_prefill"):  # the forward ran once per sample for all rules; this row branched
            prefill = f"{mean(r['prefill_s'] - r['branch_s'] for r in rs):.1f} shared + " \
                      f"{mean(r['branch_s'] for r in rs):.2f}"
        likelihood = mean_or_none(r.get("likelihood_s") for r in rs)
        lines.append(f"| {rule} | {budget if budget is not None else '-'} | {prefill} | "
                     f"{mean(r['decode_s'] for r in rs):.2f} | {mean(end_to_end_s(r) for r in rs):.2f} | "
                     f"{'-' if likelihood is None else f'{likelihood:.2f}'} | "
                     f"{mean(r['output_tokens'] for r in rs):.1f} | "
                     f"{_fmt(mean_mib(rs, 'kv_held_bytes'))} / {_fmt(mean_mib(rs, 'kv_allocated_bytes'))} | "
                     f"{sum(r['compile_s'] for r in rs):.1f} |")
    return "\n".join(lines)
