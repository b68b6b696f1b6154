"""The report's answers table: per sample, the expected answers beside what each rule generated, so that a rule
answering `'1234567890.'` and one answering nothing are told apart (both score 0)."""

from __future__ import annotations

from .grouping import budget_label, budgets, rule_order, sample_id
from .runner import REFERENCE

MAX_CHARS = 40  # a prediction longer than this is cut (the whole text is in results.jsonl)


def quote(text: str | None, limit: int = MAX_CHARS) -> str:
    """A prediction as a Markdown table cell: a code span, newlines shown as `⏎`, cut after `limit` characters,
    `|` escaped; an empty output reads *(empty)* and a missing one `-`."""
    if text is None:
        return "-"
    if not text.strip():
        return "*(empty)*"
    text = text.replace("\r\n", "\n").replace("\n", "⏎")
    if len(text) > limit:
        text = text[:limit] + "…"
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"  # a double-backtick span may hold single backticks
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def mark(score: float | None) -> str:
    """✓ when every expected answer was found, ✗ when none was, else the score (a fraction of the answers)."""
    if score is None:
        return ""
    return "✓" if score == 1 else "✗" if score == 0 else f"{score:.2f}"


def _sample_label(row: dict) -> str:
    depth = f", depth {row['depth']:.2f}" if row.get("depth") is not None else ""
    turn = f" turn {row['turn']}" if row.get("turn") is not None else ""
    return f"{row['task']} {row.get('length')} #{row['sample']}{turn}{depth}"


def answers_tables(rows: list[dict], sort: str = "accuracy") -> str:
    """Markdown: for each budget, one line per sample (task, target length, index, needle depth) with the expected
    answers, the unmodified model's output and each rule's output, marked ✓ / ✗ (or the score). Rows of one
    setting only (the caller splits by protocol). Empty string when there are no rows."""
    if not rows:
        return ""
    rules = [r for r in rule_order(rows, sort) if r != REFERENCE]
    has_ref = any(r["rule"] == REFERENCE for r in rows)
    by_key = {(sample_id(r), r["rule"], budget_label(r)): r for r in rows}
    samples = sorted({sample_id(r): r for r in rows}.items(), key=lambda kv: (kv[0][1], str(kv[0][2]), kv[0][3],
                                                                               kv[0][4], str(kv[0][5:])))
    parts = []
    for b in budgets(rows) or [None]:
        header = ["sample", "expected"] + ([f"{REFERENCE} (unmodified)"] if has_ref else []) + rules
        lines = ([f"B={b}:", ""] if b is not None else []) + \
            ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        for sid, first in samples:
            expected = first.get("answers")
            cells = [_sample_label(first), quote(", ".join(map(str, expected)) if expected else None)]
            for rule in ([REFERENCE] if has_ref else []) + rules:
                r = by_key.get((sid, rule, None if rule == REFERENCE else b))
                cells.append("-" if r is None else f"{quote(r.get('prediction'))} {mark(r.get('score'))}".strip())
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
