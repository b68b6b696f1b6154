"""Reports from result rows: a summary CSV, the paired comparisons (CSV), a Markdown report and PNG plots, merged
from one or more run folders. The tables are in `tables.py` and `answers.py`, the statistics in `stats.py`, the
figures in `plots.py`; how rows are grouped (budgets, settings, samples) is in `grouping.py`."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from statistics import mean

from ..checks import SLOT_DTYPES
from ..kernel.settings import ALL_SIGNALS
from ..models.embedded import by_name
from ..models.source import RANDOM
from .answers import answers_tables
from .decomposition import decomposed_rules, decomposition_section
from .grouping import (METRICS, budget_label, budget_order, budgets, by, logprob_delta, mean_or_none, metric_values,
                       reference_logprobs, rule_order, sample_id, setting, settings, unequal_samples)
from .lead import lead_paragraph
from .protocol_note import header_note, section_note
from .report_turns import has_turns, turn_sections
from .results import read_rows
from .runner import REFERENCE
from .stats import leaders, mean_interval, no_interval_reason
from .cost_note import cost_note
from .tables import (accuracy_table, cost_table, end_to_end_s, length_table, length_tables, likelihood_table, mean_mib,
                     paired, paired_tables)

# Names other modules import from here (cli, search, tests); they live in the modules above.
__all__ = ["GROUP", "METRICS", "PAIRED_FIELDS", "accuracy_table", "budget_label", "budgets", "length_table",
           "length_tables", "likelihood_table", "load_rows", "markdown", "paired", "paired_rows", "paired_tables",
           "report", "rule_order", "sample_id", "setting", "summarize", "write_csv"]

# Columns a summary groups by: a protocol, chunk size or backend is never averaged with another.
GROUP = ("model", "protocol", "chunk_size", "backend", "task", "length", "rule", "budget")
# `top`: the rule with the highest mean (ties by name; `top_tied` says when others share it), which every other rule
# is compared with; `diff_lo`/`diff_hi` are empty where the interval is unbounded, `diff_interval` says why.
PAIRED_FIELDS = ("protocol", "chunk_size", "backend", "task", "budget", "metric", "rule", "samples", "mean", "top",
                 "top_tied", "diff_vs_top", "diff_lo", "diff_hi", "diff_interval", "p", "p_holm", "tier")


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


def summarize(rows: list[dict]) -> list[dict]:
    """One line per `GROUP` (budget = `budget_label`): samples, mean score and its 95% interval, the answer
    log-likelihood (mean per token, and relative to the unmodified model with its interval), mean times (end to end:
    prefill + decode to the last token), output tokens, KV memory, kernel fingerprint."""
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
                    "logprob_delta": dv.mean if dv else None,
                    "logprob_delta_lo": dv.lo if dv and dv.bounded else None,
                    "logprob_delta_hi": dv.hi if dv and dv.bounded else None,
                    "logprob_delta_interval": _interval_name(dv),
                    "prefill_s": mean(r["prefill_s"] for r in rs), "decode_s": mean(r["decode_s"] for r in rs),
                    "end_to_end_s": mean(end_to_end_s(r) for r in rs),
                    "likelihood_s": mean_or_none(r.get("likelihood_s") for r in rs),
                    "output_tokens": mean(r["output_tokens"] for r in rs),
                    "kv_held_mib": mean_mib(rs, "kv_held_bytes"),
                    "kv_allocated_mib": mean_mib(rs, "kv_allocated_bytes"),
                    # rows written before AdaKV name neither: they ran uniform on slots
                    **({"allocation": None, "layout": None} if rs[0]["rule"] == REFERENCE else
                       {"allocation": rs[0].get("allocation") or "uniform",
                        "layout": _values([{"layout": r.get("layout") or "slots"} for r in rs], "layout")}),
                    "kernel_fingerprint": rs[0].get("kernel_fingerprint")})
    return out


def _interval_name(iv) -> str | None:
    """The interval's method, or why there is none (a CSV never holds an infinite bound)."""
    if iv is None:
        return None
    return iv.method if iv.bounded else no_interval_reason(iv.n)


def write_csv(lines: list[dict], path: Path, fields: tuple[str, ...] | None = None) -> None:
    """`lines` as CSV at `path`, columns `fields` (default: the first line's keys). With `fields` given, an empty
    `lines` writes the header alone."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields or lines[0]))
        w.writeheader()
        w.writerows(lines)


def paired_rows(rows: list[dict]) -> list[dict]:
    """`paired.csv`: every rule against the top one (highest mean), per setting, task (and "all") and budget, for both
    metrics."""
    out = []
    for (protocol, chunk, backend), srs in by(rows, "protocol", "chunk_size", "backend").items():
        for task, trs in [("all", srs)] + list(by(srs, "task").items()):
            for metric in METRICS:
                for b, (n, ranked) in paired(trs, metric).items():
                    top, tied = ranked[0].rule, len(leaders(ranked)) > 1
                    for r in ranked:
                        d = r.vs_best
                        bounded = d is not None and d.bounded
                        out.append(dict(zip(PAIRED_FIELDS, (
                            protocol, chunk, backend, task, b, metric, r.rule, n, r.mean, top, tied,
                            d.mean if d else 0.0, d.lo if bounded else None, d.hi if bounded else None,
                            _interval_name(d), d.p if d else None, r.p_holm, r.tier))))
    return out


GLOSSARY = [
    "- **cell**: mean [95% interval] (samples).",
    "- **accuracy interval**: exact Clopper-Pearson where every score of the cell is 0/1, else a percentile bootstrap "
    "over samples.",
    "- **log-likelihood**, two columns per budget: `log-prob/token`, the absolute mean log-prob per gold-answer token, "
    "and `Δ vs full`, that minus the unmodified model's on the same sample (nats; 0 = no loss), its interval by "
    "inverting the paired sign-flip test (none below 6 samples: the cell says so).",
    "- **paired comparison**: two rules on the same samples, a sign-flip permutation test on the per-sample "
    "differences; **Holm**: its p adjusted over the comparisons with the top rule (highest mean).",
    "- **separated**: Holm p < 0.05. **tier** k: the rules not separated from the best of those left after tiers "
    "1..k-1 (tier 1: not separated from the top). **undecided**: a rule separated neither from the top nor from the "
    "last rule (a tier number would read as a standing this sample size does not give); \"best\" only for a rule "
    "separated from every other one.",
    "- **output length**: tokens generated to the end of the answer, each rule against the unmodified model on the "
    "same samples (the same test, Holm over the budget's rules); a rule \"lengthens answers\" only when separated "
    "with longer ones.",
    "- **samples to settle** (opening paragraph): paired samples at which the leader and the lowest rule not yet "
    "separated from it would be separated with 80% power, by a normal approximation from the observed differences "
    "(Bonferroni over the comparisons with the top), and more than the samples at hand.",
    "- See the documentation, \"Reading a report\" (docs/compare.md).",
]


def _values(rows, key: str) -> str:
    """The values of `key` over `rows`: one, or **n different** ones listed (a merged run of several machines)."""
    values = sorted({str(r.get(key)) for r in rows})
    return values[0] if len(values) == 1 else f"**{len(values)} different ({', '.join(values)})**"


def _header(rows: list[dict], sort: str) -> list[str]:
    """The report's opening lines: model, device and dtype, versions, kernel, window, sample warnings."""
    first = rows[0]
    models = sorted({r["model"] for r in rows})
    prints = {r["kernel_fingerprint"] for r in rows if r.get("kernel_fingerprint")}
    # Whether the fingerprints were traced by the run or read from `fairness.fingerprint_store` (older rows say neither).
    cached = frozenset({r.get("fingerprint_cached") for r in rows if r.get("kernel_fingerprint")} - {None})
    source = {frozenset({True}): "; read from the fingerprint cache", frozenset({False}): "; traced by this run",
              frozenset({True, False}): "; some read from the fingerprint cache"}.get(cached, "")
    budgeted = [r for r in rows if r.get("kernel_fingerprint")]
    sets = signal_sets(budgeted)
    storages = sorted({r.get("slot_dtype") or "model" for r in budgeted}, key=SLOT_DTYPES.index)
    # Kernel settings that change the graphs: the signal set and the slot storage (one fingerprint per pair).
    def kernel(r):
        return r.get("signals") or ALL_SIGNALS, r.get("slot_dtype") or "model"

    kernels = {kernel(r) for r in budgeted}
    per_set = len(kernels) > 1 and len(prints) == len(kernels) and all(
        len({r["kernel_fingerprint"] for r in budgeted if kernel(r) == k}) == 1 for k in kernels)
    per_what = " and ".join(w for w, n in (("signal set", len(sets)), ("slot storage", len(storages))) if n > 1)
    windows = sorted({r["window"] for r in rows if r.get("window") is not None})
    blocks = sorted({str(r.get("block") or "automatic") for r in rows if r["rule"] != REFERENCE})
    names = [f"{m} ({by_name(m).weights}: 4-bit-quantized weights)" if by_name(m) else m for m in models]
    parts = [f"- model: {', '.join(names)}; device: {_values(rows, 'device')}; dtype: {_values(rows, 'dtype')}; "
             f"torch {first['torch']}, transformers {first['transformers']}, fxbudget {first['fxbudget']}, "
             f"{first['threads']} torch thread(s)",
             f"- {len(rows)} rows; cells are mean score [95% interval] (samples). Score = fraction of the expected "
             "answers found in the output" + ("; list_keys: fraction of the keys listed in order." if any(
                 r["task"] == "list_keys" for r in rows) else "."),
             "- kernel: " + (f"one shared kernel for every rule (fingerprint `{next(iter(prints))[:16]}`{source})"
                             if len(prints) == 1 else
                             f"**{len(prints)} different kernel fingerprints** — the rows are of {len(models)} models "
                             "(merged folders?), each model its own kernel: compare rules within one model"
                             if len(prints) > 1 and len(models) > 1 else
                             f"{len(prints)} kernel fingerprints, one per {per_what} (below)" if per_set else
                             f"**{len(prints)} different kernel fingerprints** — rules did not run the same kernel"
                             if prints else "no budgeted rows"),
             "- observation window (last queries of a call whose attention `window_attn` sums; one per comparison): "
             + (f"{windows[0]}" if len(windows) == 1 else
                f"**{len(windows)} different windows ({', '.join(map(str, windows))})**: rules did not see the same "
                "signals" if windows else "none"),
             signal_set_line(sets),
             f"- kernel query block: {', '.join(blocks) if blocks else '-'}",
             _allocation_line([r for r in rows if r["rule"] != REFERENCE])]
    if storages and storages != ["model"]:  # rows before quantized slots, and runs in the model's dtype, say nothing
        parts.append("- slot storage (how the caches stored keys and values, a kernel setting: a setting of the "
                     f"tables' columns): {', '.join(storages)}; quantized slots hold int codes or fp8 with a float32 "
                     "scale per entry and head (`fxbudget.kernel.slot_storage`)")
    sized = byte_budget_line(rows)
    if sized:
        parts.append(sized)
    random = [m for m in models if m.startswith(RANDOM)]
    if random:
        parts.append(f"- **seeded random weights** ({', '.join(f'`{m}`' for m in random)}): such a model answers "
                     "nothing, so its accuracy and answer likelihood are meaningless; its rows measure time, memory "
                     "and the kernel (one fingerprint), not which rule is better")
    unequal = unequal_samples(rows)
    if unequal:
        parts.append("- **warning: the rules did not all run the same samples** (merged runs of different grids?); "
                     "samples per rule: " + "; ".join(unequal) + ". A cell averages its own samples (the \"all "
                     "tasks\" cells pool them); the paired comparisons use only the samples every rule ran.")
    protocols = sorted({r["protocol"] for r in rows}, key=lambda p: (p != "query-agnostic", p))
    intervals = [r.get("decode_interval") or 1 for r in rows if r["protocol"] == "streaming"]
    return parts + [f"- {header_note(protocols, intervals)}", f"- rules are ordered by {sort}; statistical terms: the "
                    "glossary at the end."]


def by_slots(rows) -> dict:
    """`rows` by chunk size, backend and slot storage (rows before it: the model's dtype), in a stable order."""
    groups = defaultdict(list)
    for (chunk, backend), rs in by(rows, "chunk_size", "backend").items():
        for r in rs:
            groups[(chunk, backend, r.get("slot_dtype") or "model")].append(r)
    return dict(sorted(groups.items(), key=lambda kv: (str(kv[0][:2]), SLOT_DTYPES.index(kv[0][2]))))


def byte_budget_line(rows) -> str | None:
    """What each byte budget bought: its entries per layer and KV head, by model and dtype (`cache.byte_budget`: the
    most whose cache, keys, values and each entry's bookkeeping for one sequence, fits). None without byte budgets."""
    bought = defaultdict(set)
    for r in rows:
        if r.get("budget_bytes") is not None:
            storage = r.get("slot_dtype") or "model"
            where = r.get("dtype") if storage == "model" else f"{r.get('dtype')}, {storage} slots"
            bought[(budget_label(r), r["model"], where)].add(r["budget"])
    if not bought:
        return None
    cells = [f"{label} = {'/'.join(map(str, sorted(t)))} entries ({model}, {dtype})"
             for (label, model, dtype), t in sorted(bought.items(), key=lambda kv: (budget_order(kv[0][0]), kv[0][1:]))]
    return ("- byte budgets, as entries per full-attention layer and KV head (the most whose cache for one "
            "sequence fits: keys, values and each entry's position, carried attention and signals): "
            + "; ".join(cells))


def signal_sets(rows) -> list[str]:
    """The signal sets of budgeted `rows` (`kernel.settings.signals_label`; rows written before the set existed
    measured every signal: "all")."""
    return sorted({r.get("signals") or ALL_SIGNALS for r in rows})


def signal_set_line(sets: list[str]) -> str:
    """The report's line on the kernels' signal sets (a kernel setting of a run, like the window): one, or several
    (pooled runs), whose accuracy compares and whose cost does not."""
    if not sets:
        return "- signal set (what the kernel measured, one per run): none"
    if len(sets) == 1:
        return f"- signal set (what the kernel measured, one per run): {sets[0]}"
    return (f"- **{len(sets)} different signal sets ({'; '.join(sets)})**: pooled runs whose kernels measured different "
            "signals: accuracy columns comparable (a rule's outputs are the same under any set holding what it "
            "reads), cost columns (times, memory) not")


def _allocation_line(rows) -> str:
    """How each rule spread its budget over KV heads, and the cache layout the rows ran on (one per comparison: a
    head-adaptive rule puts every rule of its run on the pooled layout). Rows written before AdaKV say neither: they
    ran uniform on slots."""
    if not rows:
        return "- allocation / cache layout: no budgeted rows"
    alloc = defaultdict(set)
    for r in rows:
        alloc[r.get("allocation") or "uniform"].add(r["rule"])
    layouts = sorted({r.get("layout") or "slots" for r in rows})
    return ("- allocation over KV heads: " + "; ".join(f"{a} ({', '.join(sorted(rs))})" for a, rs in sorted(alloc.items()))
            + "; cache layout: " + (layouts[0] if len(layouts) == 1 else
                                    f"**{len(layouts)} different layouts ({', '.join(layouts)})**: rules did not all "
                                    "run on the same cache layout (merged runs?)"))


def _context(rows) -> str:
    """The context length as the rows record it: tokens before the question, chat template included (rows written
    before `context_tokens` existed give the task's own count, `n_tokens`)."""
    values = sorted(r.get("context_tokens", r.get("n_tokens")) for r in rows)
    span = f"{values[0]}" if values[0] == values[-1] else f"{values[0]}-{values[-1]}"
    return f"context {span} tokens" + (" before the question, chat template included"
                                       if "context_tokens" in rows[0] else "")


def markdown(rows: list[dict], plots: list[str], sort: str = "accuracy") -> str:
    """The report: setup, the kernel fingerprint check, the settings side by side, then per protocol the accuracy
    and likelihood tables, the paired comparisons per budget, overall and per task, the answers per sample and the
    cost."""
    parts = ["# fxbudget comparison", "", lead_paragraph(rows, sort), "", "## setup", ""] + _header(rows, sort)
    parts += [""] + decomposition_section(rows) if decomposed_rules(rows) else []
    if len(settings(rows)) > 1:
        parts += ["", "## settings side by side, all tasks", "", "### accuracy", "",
                  accuracy_table(rows, sort, by_setting=True)]
        lik = likelihood_table(rows, sort, by_setting=True)
        if lik:
            parts += ["", "### answer log-likelihood per token vs the unmodified model", "", lik]
    for protocol, prs in by(rows, "protocol").items():
        for (chunk, backend, storage), crs in by_slots(prs).items():
            slots = "" if storage == "model" else f", slots: {storage}"  # the model's dtype (and rows before): unsaid
            parts += ["", f"## protocol: {protocol}, prefill chunk: {chunk or 'one call'}, backend: {backend}{slots}",
                      ""]
            note = section_note(crs)
            if note:
                parts += [note, ""]
            if has_turns(crs):
                parts += [TURNS_NOTE, ""]
            tasks = by(crs, "task")
            # One task: its tables once, under its own name (the "all tasks" tables would be the same ones).
            parts += _section(crs, sort, "all tasks" if len(tasks) > 1 else
                              f"{next(iter(tasks))} ({_context(crs)})")
            if has_turns(crs):
                parts += turn_sections(crs, sort, DETAILS)
            for task, trs in tasks.items() if len(tasks) > 1 else ():
                parts += _section(trs, sort, f"{task} ({_context(trs)})", details=True)
            summary = ("expected vs each rule's output (✓ all expected answers found, ✗ none; the outputs in full are in "
                       "results.jsonl)")
            parts += ["### answers per sample", "", DETAILS.format(summary), "", answers_tables(crs, sort), "",
                      "</details>", ""]
            parts += ["### cost (mean per sample)", "", cost_note(crs), "", cost_table(crs, sort)]
    from .plots import needle_note  # no matplotlib at import: the plots module imports it where it draws

    note = needle_note(rows)
    if plots or note:
        parts += ["", "## plots", ""] + [f"![{p}]({p})" for p in plots] + ([""] + [note] if note else [])
    parts += ["", "## glossary", ""] + GLOSSARY
    return "\n".join(parts) + "\n"


TURNS_NOTE = ("Several requests over one context: one row per request (`turn`). The tables of all tasks and of each "
              "task pool the requests, each (sample, request) one paired unit (a sample's requests share its "
              "compressed context, so they are not independent); **per request** gives each turn's accuracy, each "
              "rule's decay over the turns (paired over samples) and the paired comparisons at each turn.")

# Collapsed in GitHub's view; `markdown="1"` lets the docs site (Python-Markdown's md_in_html) render its tables too.
DETAILS = '<details markdown="1"><summary>{}</summary>'


def _section(rows, sort, title, details=False) -> list[str]:
    # The sentence on what the sample size can separate is in the paired comparisons below, not under this table.
    parts = [f"### {title}", "", "accuracy:", "", accuracy_table(rows, sort, note=False), ""]
    lik = likelihood_table(rows, sort)
    if lik:
        parts += ["answer log-likelihood per token (nats): absolute, and the rule minus the unmodified model:", "",
                  lik, ""]
    parts += ["output length and end-to-end time (prefill + decode to the last token), mean per sample:", "",
              length_table(rows, sort), ""]
    pairs = paired_tables(rows, sort)
    if pairs:
        if details:
            parts += [DETAILS.format("paired comparisons per budget"), "", pairs, "", "</details>", ""]
        else:
            parts += [f"paired comparisons per budget (ranked by {sort}):", "", pairs, ""]
    elif not details:
        parts += ["paired comparisons: none (they need two budgeted rules on common samples at a budget).", ""]
    lengths = length_tables(rows)
    if lengths:
        if details:
            parts += [DETAILS.format("output length vs the unmodified model per budget"), "", lengths, "",
                      "</details>", ""]
        else:
            parts += ["output length vs the unmodified model per budget (paired, same samples):", "", lengths, ""]
    return parts


def report(dirs: list[str | Path], out_dir: str | Path | None = None, *, sort: str = "accuracy") -> Path:
    """Merge the rows of `dirs` and write `summary.csv`, `paired.csv` (its header alone when no budget has two
    budgeted rules to compare), `report.md` and the plots into `out_dir` (default: the first dir).

    Args:
        sort: "accuracy" or "likelihood", the order of the rules.
    Returns:
        The report's path.
    """
    if sort not in METRICS:
        raise ValueError(f"sort must be one of {tuple(METRICS)}, got {sort!r}")
    rows = load_rows(dirs)
    if not rows:
        raise ValueError(f"no result rows in {', '.join(map(str, dirs))}")
    out = Path(out_dir or dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    write_csv(summarize(rows), out / "summary.csv")
    write_csv(paired_rows(rows), out / "paired.csv", PAIRED_FIELDS)
    from .plots import plot  # matplotlib: only when writing a report

    plots = plot(rows, out, sort)
    path = out / "report.md"
    path.write_text(markdown(rows, plots, sort))
    return path
