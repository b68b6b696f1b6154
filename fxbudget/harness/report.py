"""Reports from result rows: a summary CSV, the paired comparisons (CSV), a Markdown report and PNG plots, merged
from one or more run folders. The statistics are in `stats.py`, the figures in `plots.py`."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from statistics import mean

import numpy as np

from ..models import DEFAULT_MODEL_NAME, DEFAULT_MODEL_WEIGHTS
from .results import read_rows
from .runner import PROTOCOLS, REFERENCE
from .stats import mean_interval, rank

# Columns a summary groups by: a protocol, chunk size or backend is never averaged with another.
GROUP = ("model", "protocol", "chunk_size", "backend", "task", "length", "rule", "budget")
PROTOCOL_ORDER = {p: i for i, p in enumerate(PROTOCOLS)}


def load_rows(dirs: list[str | Path]) -> list[dict]:
    """Every row of `results*.jsonl` in `dirs` (shards of one grid, or several runs), one per key (the last wins).
    A last line cut short by a killed run is left out with a warning (`results.read_rows`)."""
    rows: dict[str, dict] = {}
    for d in dirs:
        d = Path(d)
        files = sorted(d.glob("results*.jsonl"))
        if not files:
            raise FileNotFoundError(f"no results*.jsonl in {d}")
        for path in files:
            for row in read_rows(path):
                rows[row["key"]] = row
    return list(rows.values())


METRICS = {"accuracy": "score", "likelihood": "answer_logprob_mean"}  # --sort name -> row field (higher = better)


def budget_label(row: dict) -> int | str | None:
    """What a report groups budgets by: the absolute budget, or the fraction of the context ("12.5%") for a
    relative budget (its absolute value varies with each sample's context); None for the reference row."""
    if row.get("budget") is None:
        return None
    f = row.get("budget_fraction")
    return f"{f * 100:g}%" if f is not None else row["budget"]


def _budget_order(label) -> tuple:
    return (isinstance(label, str), float(label[:-1]) if isinstance(label, str) else label)


def budgets(rows) -> list:
    """The budget labels of `rows`, absolute ones first, each kind in increasing order."""
    return sorted({budget_label(r) for r in rows} - {None}, key=_budget_order)


def sample_id(row: dict) -> tuple:
    """What pairs rows across rules: the same model, task, length, sample index and seed."""
    return row["model"], row["task"], row.get("length"), row["sample"], row["seed"]


def setting(row: dict) -> str:
    """The protocol, plus the prefill chunk and backend when they are not the defaults."""
    parts = [row["protocol"]] + ([f"chunk {row['chunk_size']}"] if row.get("chunk_size") else []) + \
        ([row["backend"]] if row.get("backend") not in (None, "none") else [])
    return ", ".join(parts)


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
    return [r[METRICS[metric]] for r in rows if r.get(METRICS[metric]) is not None]


def summarize(rows: list[dict]) -> list[dict]:
    """One line per `GROUP` (budget = `budget_label`): samples, mean score and its 95% interval, the answer
    log-likelihood (mean per token, and relative to the unmodified model with its interval), mean times, KV memory,
    kernel fingerprint."""
    refs = reference_logprobs(rows)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(budget_label(r) if k == "budget" else r.get(k) for k in GROUP)].append(r)
    out = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        acc = mean_interval([r["score"] for r in rs])
        lp = metric_values(rs, "likelihood")
        deltas = [d for d in (logprob_delta(r, refs) for r in rs) if d is not None]
        dv = mean_interval(deltas, paired=True) if deltas and rs[0]["rule"] != REFERENCE else None
        out.append({**dict(zip(GROUP, key)), "budget_fraction": rs[0].get("budget_fraction"),
                    "budget_tokens": mean(r["budget"] for r in rs) if rs[0]["budget"] is not None else None,
                    "samples": len(rs), "accuracy": acc.mean, "accuracy_lo": acc.lo, "accuracy_hi": acc.hi,
                    "accuracy_interval": acc.method, "answer_logprob_mean": mean(lp) if lp else None,
                    "logprob_delta": dv.mean if dv else None, "logprob_delta_lo": dv.lo if dv else None,
                    "logprob_delta_hi": dv.hi if dv else None,
                    "prefill_s": mean(r["prefill_s"] for r in rs), "decode_s": mean(r["decode_s"] for r in rs),
                    "likelihood_s": _mean_or_none(r.get("likelihood_s") for r in rs),
                    "output_tokens": mean(r["output_tokens"] for r in rs),
                    "kv_held_mib": _mean_mib(rs, "kv_held_bytes"),
                    "kv_allocated_mib": _mean_mib(rs, "kv_allocated_bytes"),
                    "kernel_fingerprint": rs[0].get("kernel_fingerprint")})
    return out


def _mean_mib(rows, key) -> float | None:
    """Mean of `key` in MiB (None if a row lacks it: rows written before KV bytes were split into held/allocated had
    one `kv_bytes`, the allocated bytes)."""
    values = [r.get(key, r.get("kv_bytes") if key == "kv_allocated_bytes" else None) for r in rows]
    return None if any(v is None for v in values) else mean(values) / 2**20


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _mean_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def write_csv(summary: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)


def rule_order(rows, sort: str = "accuracy") -> list[str]:
    """The reference first, then the rules by their mean `sort` metric over `rows` (best first; ties by name)."""
    if sort not in METRICS:
        raise ValueError(f"sort must be one of {tuple(METRICS)}, got {sort!r}")
    means = {}
    for rule, rs in _by([r for r in rows if r["rule"] != REFERENCE], "rule").items():
        values = metric_values(rs, sort)
        means[rule] = mean(values) if values else float("-inf")
    rules = sorted(means, key=lambda r: (-means[r], r))
    return ([REFERENCE] if any(r["rule"] == REFERENCE for r in rows) else []) + rules


def _columns(rows, by_setting: bool) -> list[tuple[str, str | None, object]]:
    """Table columns `(header, setting or None, budget label)`: one per budget, or per setting and budget."""
    labels = budgets(rows)
    if not by_setting:
        return [(f"B={b}", None, b) for b in labels]
    present = {(setting(r), budget_label(r)) for r in rows if r["budget"] is not None}
    return [(f"{s}, B={b}", s, b) for s in settings(rows) for b in labels if (s, b) in present]


def settings(rows) -> list[str]:
    return list(dict.fromkeys(setting(r) for r in sorted(rows, key=lambda r: (
        PROTOCOL_ORDER.get(r["protocol"], 9), str(r.get("chunk_size")), str(r.get("backend"))))))


def _cells(rows, rule, column) -> list[dict]:
    _, s, b = column
    return [r for r in rows if r["rule"] == rule and (s is None or setting(r) == s)
            and (rule == REFERENCE or budget_label(r) == b)]


def _name(rule: str) -> str:
    return "full (unmodified model)" if rule == REFERENCE else rule


def _interval(iv, digits: int = 2) -> str:
    return f"{iv.mean:.{digits}f} [{iv.lo:.{digits}f}, {iv.hi:.{digits}f}]"


def accuracy_table(rows: list[dict], sort: str = "accuracy", *, by_setting: bool = False) -> str:
    """Markdown: mean score [95% interval] (samples) per rule (rows) x budget (columns) over `rows`; the reference
    row spans all budgets. `by_setting` puts the protocols (settings) side by side."""
    def cell(rule, rs) -> str:
        return f"{_interval(mean_interval([r['score'] for r in rs]))} ({len(rs)})" if rs else ""

    return _rule_table(rows, sort, by_setting, cell)


def _rule_table(rows: list[dict], sort: str, by_setting: bool, cell) -> str:
    """Markdown: one line per rule (in `sort` order), one column per budget (and setting); `cell(rule, rows)` writes
    the cell of that rule's rows in a column."""
    cols = _columns(rows, by_setting)
    lines = ["| rule | " + " | ".join(c[0] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for rule in rule_order(rows, sort):
        cells = [cell(rule, _cells(rows, rule, col)) for col in cols]
        lines.append(f"| {_name(rule)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def likelihood_table(rows: list[dict], sort: str = "accuracy", *, by_setting: bool = False) -> str | None:
    """Markdown: per rule x budget, the mean over samples of the answer's mean log-prob per token minus the
    unmodified model's on the same sample [95% bootstrap interval] (samples); the reference row shows its own mean
    log-prob per token. Without reference rows, every cell is the absolute value. None if no row has the metric."""
    if not metric_values(rows, "likelihood"):
        return None
    refs = reference_logprobs(rows)

    def cell(rule, rs) -> str:
        if rule == REFERENCE or not refs:
            values = metric_values(rs, "likelihood")
            own = "abs " if refs else ""  # the reference's (or, without one, every rule's) own value
            return f"{own}{mean(values):.3f} ({len(values)})" if values else ""
        values = [d for d in (logprob_delta(r, refs) for r in rs) if d is not None]
        return f"{_interval(mean_interval(values, paired=True), 3)} ({len(values)})" if values else ""

    return _rule_table(rows, sort, by_setting, cell)


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
    return [_interval(r.vs_best, digits), f"{r.p_holm:.3f}", str(r.tier)]


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
            acc_cell = _interval(mean_interval([r["score"] for r in rs])) if rs else "-"
            deltas = [d for d in (logprob_delta(r, refs) for r in rs) if d is not None]
            lik_cell = f"{mean(deltas):.3f}" if deltas else "-"
            parts.append(f"| {rule} | {acc_cell} | " + " | ".join(_diff_cells(ranks["accuracy"], rule, 2)) +
                         f" | {lik_cell} | " + " | ".join(_diff_cells(ranks["likelihood"], rule, 3)) + " |")
        parts.append("")
    return "\n".join(parts).rstrip()


def paired_rows(rows: list[dict]) -> list[dict]:
    """`paired.csv`: every rule-vs-best comparison, per setting, task (and "all") and budget, for both metrics."""
    out = []
    for (protocol, chunk, backend), srs in _by(rows, "protocol", "chunk_size", "backend").items():
        for task, trs in [("all", srs)] + list(_by(srs, "task").items()):
            for metric in METRICS:
                for b, (n, ranked) in paired(trs, metric).items():
                    best = ranked[0].rule
                    for r in ranked:
                        d = r.vs_best
                        out.append({"protocol": protocol, "chunk_size": chunk, "backend": backend, "task": task,
                                    "budget": b, "metric": metric, "rule": r.rule, "samples": n, "mean": r.mean,
                                    "best": best, "diff_vs_best": d.mean if d else 0.0, "diff_lo": d.lo if d else None,
                                    "diff_hi": d.hi if d else None, "p": d.p if d else None, "p_holm": r.p_holm,
                                    "tier": r.tier})
    return out


def _by(rows, *keys) -> dict:
    """Rows grouped by the value of `keys` (a tuple of values when several), in a stable order."""
    out = defaultdict(list)
    for r in rows:
        out[r.get(keys[0]) if len(keys) == 1 else tuple(r.get(k) for k in keys)].append(r)
    return dict(sorted(out.items(), key=lambda kv: (not isinstance(kv[0], (int, float)), kv[0] if
                                                     isinstance(kv[0], (int, float)) else str(kv[0]))))


READING = ("- cells: mean [95% interval] (samples). Accuracy: exact Clopper-Pearson where every score of the cell is "
           "0/1, else a percentile bootstrap over samples. Log-likelihood: the mean log-prob per gold-answer token "
           "minus the unmodified model's on the same sample (nats; 0 = no loss), interval by inverting the paired "
           "sign-flip test (unbounded at <= 5 samples). Paired comparisons: sign-flip permutation test on "
           "per-sample differences, Holm-adjusted over the comparisons with the best; tier 1 = cannot be told apart "
           "from the best at this sample size. See README, \"How to read this report\".")


def markdown(rows: list[dict], plots: list[str], sort: str = "accuracy") -> str:
    """The report: setup, the kernel fingerprint check, the settings side by side, then per protocol the accuracy
    and likelihood tables and the paired comparisons per budget, overall and per task, and the cost."""
    first = rows[0]
    models = sorted({r["model"] for r in rows})
    prints = {r["kernel_fingerprint"] for r in rows if r.get("kernel_fingerprint")}
    windows = sorted({r["window"] for r in rows if r.get("window") is not None})
    blocks = sorted({str(r.get("block") or "automatic") for r in rows if r["rule"] != REFERENCE})
    names = [f"{m} ({DEFAULT_MODEL_WEIGHTS}: 4-bit-quantized weights)" if m == DEFAULT_MODEL_NAME else m
             for m in models]
    parts = ["# fxbudget comparison", "",
             f"- model: {', '.join(names)}; dtype {first['dtype']}, device {first['device']}, "
             f"torch {first['torch']}, transformers {first['transformers']}, fxbudget {first['fxbudget']}, "
             f"{first['threads']} torch thread(s)",
             f"- {len(rows)} rows; cells are mean score [95% interval] (samples). Score = fraction of the expected "
             "answers found in the output.",
             "- kernel: " + (f"one shared kernel for every rule (fingerprint `{next(iter(prints))[:16]}`)"
                             if len(prints) == 1 else
                             f"**{len(prints)} different kernel fingerprints** — rules did not run the same kernel"
                             if prints else "no budgeted rows"),
             "- observation window (last queries of a call whose attention `window_attn` sums; one per comparison): "
             + (f"{windows[0]}" if len(windows) == 1 else
                f"**{len(windows)} different windows ({', '.join(map(str, windows))})**: rules did not see the same "
                "signals" if windows else "none"),
             f"- kernel query block: {', '.join(blocks) if blocks else '-'}",
             READING, f"- rules are ordered by {sort}."]
    if len(settings(rows)) > 1:
        parts += ["", "## settings side by side, all tasks", "", "### accuracy", "",
                  accuracy_table(rows, sort, by_setting=True)]
        lik = likelihood_table(rows, sort, by_setting=True)
        if lik:
            parts += ["", "### answer log-likelihood per token vs the unmodified model", "", lik]
    for protocol, prs in _by(rows, "protocol").items():
        for (chunk, backend), crs in _by(prs, "chunk_size", "backend").items():
            parts += ["", f"## protocol: {protocol}, prefill chunk: {chunk or 'one call'}, backend: {backend}", ""]
            parts += _section(crs, sort, "all tasks")
            for task, trs in _by(crs, "task").items():
                lengths = sorted({r["n_tokens"] for r in trs})
                parts += _section(trs, sort, f"{task} (context {lengths[0]}-{lengths[-1]} tokens)", details=True)
            parts += ["### cost (mean per sample)", "", _cost_table(crs, sort)]
    if plots:
        parts += ["", "## plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def _section(rows, sort, title, details=False) -> list[str]:
    parts = [f"### {title}", "", "accuracy:", "", accuracy_table(rows, sort), ""]
    lik = likelihood_table(rows, sort)
    if lik:
        parts += ["answer log-likelihood per token, rule minus the unmodified model (nats):", "", lik, ""]
    pairs = paired_tables(rows, sort)
    if pairs:
        if details:
            parts += ["<details><summary>paired comparisons per budget</summary>", "", pairs, "", "</details>", ""]
        else:
            parts += [f"paired comparisons per budget (ranked by {sort}):", "", pairs, ""]
    return parts


def _cost_table(rows, sort: str = "accuracy") -> str:
    lines = ["| rule | budget | prefill s | decode s | likelihood s | output tokens | KV MiB held / allocated | "
             "compile s |",
             "|---" * 8 + "|"]
    for rule in rule_order(rows, sort):
        groups = defaultdict(list)
        for r in rows:
            if r["rule"] == rule:
                groups[budget_label(r)].append(r)
        for budget in sorted(groups, key=lambda b: (b is not None, _budget_order(b) if b is not None else ())):
            rs = groups[budget]
            prefill = f"{mean(r['prefill_s'] for r in rs):.2f}"
            if rs[0].get("shared_prefill"):  # the forward ran once per sample for all rules; this row branched
                prefill = f"{mean(r['prefill_s'] - r['branch_s'] for r in rs):.1f} shared + " \
                          f"{mean(r['branch_s'] for r in rs):.2f}"
            likelihood = _mean_or_none(r.get("likelihood_s") for r in rs)
            lines.append(f"| {rule} | {budget if budget is not None else '-'} | {prefill} | "
                         f"{mean(r['decode_s'] for r in rs):.2f} | "
                         f"{'-' if likelihood is None else f'{likelihood:.2f}'} | "
                         f"{mean(r['output_tokens'] for r in rs):.1f} | "
                         f"{_fmt(_mean_mib(rs, 'kv_held_bytes'))} / {_fmt(_mean_mib(rs, 'kv_allocated_bytes'))} | "
                         f"{sum(r['compile_s'] for r in rs):.1f} |")
    return "\n".join(lines)


def report(dirs: list[str | Path], out_dir: str | Path | None = None, *, sort: str = "accuracy") -> Path:
    """Merge the rows of `dirs` and write `summary.csv`, `paired.csv`, `report.md` and the plots into `out_dir`
    (default: the first dir); `sort` ("accuracy" or "likelihood") orders the rules. Returns the report's path."""
    if sort not in METRICS:
        raise ValueError(f"sort must be one of {tuple(METRICS)}, got {sort!r}")
    rows = load_rows(dirs)
    if not rows:
        raise ValueError(f"no result rows in {', '.join(map(str, dirs))}")
    out = Path(out_dir or dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    write_csv(summarize(rows), out / "summary.csv")
    pairs = paired_rows(rows)
    if pairs:
        write_csv(pairs, out / "paired.csv")
    from .plots import plot  # matplotlib: only when writing a report

    plots = plot(rows, out, sort)
    path = out / "report.md"
    path.write_text(markdown(rows, plots, sort))
    return path
