"""How result rows are grouped and paired, shared by the report's tables, its CSV files and its plots: budget labels,
settings (protocol, chunk, backend), the sample a row ran on, the reference's likelihood, the order of the rules."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

from ..checks import SLOT_DTYPES, UNITS, size_label
from .grid import BUDGET_KINDS
from .runner import PROTOCOLS, REFERENCE

METRICS = {"accuracy": "score", "likelihood": "answer_logprob_mean"}  # --sort name -> row field (higher = better)
PROTOCOL_ORDER = {p: i for i, p in enumerate(PROTOCOLS)}


def budget_label(row: dict) -> int | str | None:
    """What a report groups budgets by: the absolute budget, the size of a byte budget ("1 MiB": its tokens are the
    row's `budget`, which depends on the model and dtype), or the fraction of the context ("12.5%") for a relative
    budget (its absolute value varies with each sample's context); None for the reference row."""
    if row.get("budget") is None:
        return None
    if row.get("budget_bytes") is not None:
        return size_label(row["budget_bytes"])
    f = row.get("budget_fraction")
    return f"{f * 100:g}%" if f is not None else row["budget"]


def label_kind(label) -> str:
    """The `grid.BUDGET_KINDS` kind of a budget label."""
    return "tokens" if isinstance(label, int) else "percent" if label.endswith("%") else "bytes"


def label_value(label) -> float:
    """A budget label as a number: entries, bytes or percent."""
    kind = label_kind(label)
    if kind == "bytes":
        number, unit = label.split()
        return float(number) * UNITS[unit]
    return float(label) if kind == "tokens" else float(label[:-1])


def budget_order(label) -> tuple:
    """Sort key of a budget label: absolute budgets first, then byte budgets, then fractions, each increasing."""
    return BUDGET_KINDS.index(label_kind(label)), label_value(label)


def budgets(rows) -> list:
    """The budget labels of `rows` in `budget_order`."""
    return sorted({budget_label(r) for r in rows} - {None}, key=budget_order)


def sample_id(row: dict) -> tuple:
    """What pairs rows across rules: the same model, task, length, sample index and seed; for a request of a
    shared-context protocol also the protocol and its `turn` (the unmodified model's turn 2 of multi-turn is not its
    request 2 of multi-request)."""
    own = row["model"], row["task"], row.get("length"), row["sample"], row["seed"]
    return own + (row["protocol"], row["turn"]) if row.get("turn") is not None else own


def setting(row: dict) -> str:
    """The protocol, plus the decode interval (streaming), prefill chunk, backend and slot storage when they are not
    the defaults."""
    parts = [row["protocol"]] + ([f"interval {row['decode_interval']}"] if (row.get("decode_interval") or 1) > 1
                                 else []) + ([f"chunk {row['chunk_size']}"] if row.get("chunk_size") else []) + \
        ([row["backend"]] if row.get("backend") not in (None, "none") else []) + \
        ([f"{row['slot_dtype']} slots"] if row.get("slot_dtype") not in (None, "model") else [])
    return ", ".join(parts)


def settings(rows) -> list[str]:
    """The settings of `rows` in protocol order (then chunk size, backend and slot storage)."""
    return list(dict.fromkeys(setting(r) for r in sorted(rows, key=lambda r: (
        PROTOCOL_ORDER.get(r["protocol"], 9), r.get("decode_interval") or 1, str(r.get("chunk_size")),
        str(r.get("backend")), SLOT_DTYPES.index(r.get("slot_dtype") or "model")))))


def reference_logprobs(rows) -> dict[tuple, float]:
    """The unmodified model's mean answer log-prob per token, by `sample_id` (rows without it are skipped)."""
    return {sample_id(r): r["answer_logprob_mean"] for r in rows
            if r["rule"] == REFERENCE and r.get("answer_logprob_mean") is not None}


def logprob_delta(row: dict, refs: dict) -> float | None:
    """The row's mean answer log-prob per token minus the unmodified model's on the same sample (None if unknown)."""
    ref = refs.get(sample_id(row))
    own = row.get("answer_logprob_mean")
    return None if ref is None or own is None else own - ref


def metric_values(rows, metric: str) -> list[float]:
    """The values of `metric` ("accuracy" or "likelihood") in `rows`, rows without it left out."""
    return [r[METRICS[metric]] for r in rows if r.get(METRICS[metric]) is not None]


def mean_or_none(values) -> float | None:
    """The mean of the values that are not None (None if there are none)."""
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def by(rows, *keys) -> dict:
    """Rows grouped by the value of `keys` (a tuple of values when several), in a stable order."""
    out = defaultdict(list)
    for r in rows:
        out[r.get(keys[0]) if len(keys) == 1 else tuple(r.get(k) for k in keys)].append(r)
    return dict(sorted(out.items(), key=lambda kv: (not isinstance(kv[0], (int, float)), kv[0] if
                                                     isinstance(kv[0], (int, float)) else str(kv[0]))))


def rule_order(rows, sort: str = "accuracy") -> list[str]:
    """The reference first, then the rules by their mean `sort` metric over `rows` (best first; ties by name)."""
    if sort not in METRICS:
        raise ValueError(f"sort must be one of {tuple(METRICS)}, got {sort!r}")
    means = {}
    for rule, rs in by([r for r in rows if r["rule"] != REFERENCE], "rule").items():
        values = metric_values(rs, sort)
        means[rule] = mean(values) if values else float("-inf")
    rules = sorted(means, key=lambda r: (-means[r], r))
    return ([REFERENCE] if any(r["rule"] == REFERENCE for r in rows) else []) + rules


def sample_counts(rows) -> dict[str, dict]:
    """Per setting, per rule: budget label -> the set of `sample_id`s it ran (label None for the reference)."""
    out: dict[str, dict] = defaultdict(lambda: defaultdict(lambda: defaultdict(set)))
    for r in rows:
        out[setting(r)][r["rule"]][budget_label(r)].add(sample_id(r))
    return out


def unequal_samples(rows) -> list[str]:
    """One line per setting whose rules (and budgets) did not all run the same samples, e.g. merged runs of
    different grids: `"query-agnostic: full 3, snapkv 3, streamingllm 1"` (a rule whose budgets differ reads
    `snapkv 3 (B=128), 1 (B=256)`). Empty when every cell of every setting ran the same samples."""
    lines = []
    counts = sample_counts(rows)
    for s in settings(rows):
        cells = [ids for per_budget in counts[s].values() for ids in per_budget.values()]
        if all(ids == cells[0] for ids in cells):
            continue
        parts = []
        for rule in rule_order([r for r in rows if setting(r) == s]):
            per_budget = counts[s][rule]
            sizes = {b: len(per_budget[b]) for b in sorted(per_budget, key=lambda b: budget_order(b) if b is not None
                                                             else (False, -1))}
            if len(set(sizes.values())) == 1:
                parts.append(f"{rule} {next(iter(sizes.values()))}")
            else:
                parts.append(f"{rule} " + ", ".join(f"{n} (B={b})" for b, n in sizes.items()))
        lines.append(f"{s}: {', '.join(parts)}")
    return lines
