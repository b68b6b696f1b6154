"""The report's Markdown tables: accuracy and answer likelihood per rule x budget, the paired comparisons per budget
(`stats.rank`), and the cost per rule and budget."""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import mean

import numpy as np

from .grouping import (METRICS, budget_label, budget_order, budgets, logprob_delta, mean_or_none, metric_values,
                       reference_logprobs, rule_order, sample_id, setting, settings)
from .runner import REFERENCE
from .stats import mean_interval, rank


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
    """`mean [lo, hi]` of a `stats.Interval` or `stats.PairedDiff`."""
    return f"{iv.mean:.{digits}f} [{iv.lo:.{digits}f}, {iv.hi:.{digits}f}]"


def _rule_table(rows: list[dict], sort: str, by_setting: bool, cell) -> str:
    """Markdown: one line per rule (in `sort` order), one column per budget (and setting); `cell(rule, rows)` writes
    the cell of that rule's rows in a column."""
    cols = _columns(rows, by_setting)
    lines = ["| rule | " + " | ".join(c[0] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for rule in rule_order(rows, sort):
        cells = [cell(rule, _cells(rows, rule, col)) for col in cols]
        lines.append(f"| {rule_name(rule)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_table(rows: list[dict], sort: str = "accuracy", *, by_setting: bool = False) -> str:
    """Markdown: mean score [95% interval] (samples) per rule (rows) x budget (columns) over `rows`; the reference
    row spans all budgets. `by_setting` puts the protocols (settings) side by side."""
    def cell(rule, rs) -> str:
        return f"{interval(mean_interval([r['score'] for r in rs]))} ({len(rs)})" if rs else ""

    return _rule_table(rows, sort, by_setting, cell)


def reference_note(rows: list[dict]) -> str | None:
    """One sentence saying what the reference row of a likelihood table holds, with its value over `rows` as the
    example (None without reference rows that have the metric)."""
    own = metric_values([r for r in rows if r["rule"] == REFERENCE], "likelihood")
    if not own:
        return None
    m = mean(own)
    return (f"The `full` row is not a difference: it is the unmodified model's own mean log-prob per answer token "
            f"(`abs {m:.3f}` = a gold token has probability {math.exp(m):.2f} on average, geometric mean); every "
            "other row is the rule minus that value on the same sample (0 = no loss, -0.69 = each answer token half "
            "as likely).")


def likelihood_table(rows: list[dict], sort: str = "accuracy", *, by_setting: bool = False,
                     note: bool = True) -> str | None:
    """Markdown: per rule x budget, the mean over samples of the answer's mean log-prob per token minus the
    unmodified model's on the same sample [95% interval] (samples); the reference row shows its own mean log-prob
    per token, marked `abs`. Without reference rows, every cell is the absolute value.

    Args:
        note: add `reference_note` under the table (after a blank line).
    Returns:
        The table, or None if no row has the metric.
    """
    if not metric_values(rows, "likelihood"):
        return None
    refs = reference_logprobs(rows)

    def cell(rule, rs) -> str:
        if rule == REFERENCE or not refs:
            values = metric_values(rs, "likelihood")
            own = "abs " if refs else ""  # the reference's (or, without one, every rule's) own value
            return f"{own}{mean(values):.3f} ({len(values)})" if values else ""
        values = [d for d in (logprob_delta(r, refs) for r in rs) if d is not None]
        return f"{interval(mean_interval(values, paired=True), 3)} ({len(values)})" if values else ""

    table = _rule_table(rows, sort, by_setting, cell)
    text = reference_note(rows) if note else None
    return table + (f"\n\n{text}" if text else "")


def paired(rows: list[dict], metric: str) -> dict:
    """Per budget label: `(samples, ranking)` of the rules on the samples every one of them ran (`stats.rank`).

    Budgets where fewer than two rules have the metric on common samples are left out.
    """
    out = {}
    for b in budgets(rows):
        by_rule: dict[str, dict] = defaultdict(dict)
        for r in rows:
            if r["rule"] != REFERENCE and budget_label(r) == b and r.get(METRICS[metric]) is not None:
                by_rule[r["rule"]][sample_id(r)] = r[METRICS[metric]]
        common = set.intersection(*(set(v) for v in by_rule.values())) if by_rule else set()
        if len(by_rule) < 2 or not common:
            continue
        ids = sorted(common, key=str)
        out[b] = (len(ids), rank({rule: np.array([v[i] for i in ids]) for rule, v in by_rule.items()}))
    return out


def _diff_cells(ranked: dict, rule: str, digits: int) -> list[str]:
    r = ranked.get(rule)
    if r is None:
        return ["-", "-", "-"]
    if r.vs_best is None:
        return ["best", "", str(r.tier)]
    return [interval(r.vs_best, digits), f"{r.p_holm:.3f}", str(r.tier)]


def paired_tables(rows: list[dict], sort: str = "accuracy", heading: str = "####") -> str:
    """Markdown: for each budget, the rules ranked by `sort`, each against the best one by accuracy and by answer
    log-likelihood: paired difference [95% bootstrap interval], sign-flip permutation p (Holm-adjusted over the
    comparisons with the best), tier (1 = cannot be told apart from the best at this sample size)."""
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
        for metric in ("accuracy", "likelihood"):
            ranked = list(ranks[metric].values())
            if ranked and len({r.mean for r in ranked}) == 1:
                parts.append(f"- by {metric}: every rule has the same mean ({ranked[0].mean:.3g})")
            elif ranked:
                ties = [r.rule for r in ranked[1:] if r.tier == 1]
                parts.append(f"- by {metric}: best **{ranked[0].rule}**; not separated from it at this sample size: "
                             f"{', '.join(ties) if ties else 'none'}")
        parts += ["", "| rule | accuracy [95% CI] | Δ vs best | p (Holm) | tier | log-lik/token vs full | Δ vs best "
                  "| p (Holm) | tier |", "|---" * 9 + "|"]
        for rule in order:
            rs = [r for r in rows if r["rule"] == rule and budget_label(r) == b]
            acc_cell = interval(mean_interval([r["score"] for r in rs])) if rs else "-"
            deltas = [d for d in (logprob_delta(r, refs) for r in rs) if d is not None]
            lik_cell = f"{mean(deltas):.3f}" if deltas else "-"
            parts.append(f"| {rule} | {acc_cell} | " + " | ".join(_diff_cells(ranks["accuracy"], rule, 2)) +
                         f" | {lik_cell} | " + " | ".join(_diff_cells(ranks["likelihood"], rule, 3)) + " |")
        parts.append("")
    return "\n".join(parts).rstrip()


def mean_mib(rows, key) -> float | None:
    """Mean of `key` in MiB (None if a row lacks it: rows written before KV bytes were split into held/allocated had
    one `kv_bytes`, the allocated bytes)."""
    values = [r.get(key, r.get("kv_bytes") if key == "kv_allocated_bytes" else None) for r in rows]
    return None if any(v is None for v in values) else mean(values) / 2**20


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def cost_table(rows, sort: str = "accuracy") -> str:
    """Markdown: per rule and budget, the mean prefill (the shared forward apart from the row's branch), decode and
    likelihood seconds, output tokens, KV memory held and allocated, and the compile seconds summed."""
    lines = ["| rule | budget | prefill s | decode s | likelihood s | output tokens | KV MiB held / allocated | "
             "compile s |",
             "|---" * 8 + "|"]
    for rule in rule_order(rows, sort):
        groups = defaultdict(list)
        for r in rows:
            if r["rule"] == rule:
                groups[budget_label(r)].append(r)
        for budget in sorted(groups, key=lambda b: (b is not None, budget_order(b) if b is not None else ())):
            rs = groups[budget]
            prefill = f"{mean(r['prefill_s'] for r in rs):.2f}"
            if rs[0].get("shared_prefill"):  # the forward ran once per sample for all rules; this row branched
                prefill = f"{mean(r['prefill_s'] - r['branch_s'] for r in rs):.1f} shared + " \
                          f"{mean(r['branch_s'] for r in rs):.2f}"
            likelihood = mean_or_none(r.get("likelihood_s") for r in rs)
            lines.append(f"| {rule} | {budget if budget is not None else '-'} | {prefill} | "
                         f"{mean(r['decode_s'] for r in rs):.2f} | "
                         f"{'-' if likelihood is None else f'{likelihood:.2f}'} | "
                         f"{mean(r['output_tokens'] for r in rs):.1f} | "
                         f"{_fmt(mean_mib(rs, 'kv_held_bytes'))} / {_fmt(mean_mib(rs, 'kv_allocated_bytes'))} | "
                         f"{sum(r['compile_s'] for r in rs):.1f} |")
    return "\n".join(lines)
