"""The report's figures: accuracy and answer likelihood against the budget with 95% intervals (one panel per task,
one row of panels per protocol), and per rule the needle tasks' accuracy by depth and context length: a heatmap where
there are at least two depths and two lengths, else the same numbers as bars over the one that varies (one depth and
one length: no figure, `needle_note` says so in the report). Depths are labelled as the answers table prints the
measured depth (0.25, not round(depth, 1)'s 0.2).
Each figure is built by a function that returns it (tests read its axes) and saved by `plot`."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean

from .grid import BUDGET_KINDS
from .grouping import (budget_label, budgets, label_kind, label_value, logprob_delta, metric_values, reference_logprobs,
                       rule_order, setting, settings)
from .runner import REFERENCE
from .stats import mean_interval, no_interval_reason
from .tasks import NEEDLE_TASKS

UNBOUNDED_NOTE = "no bar"  # a panel's title then says why: `unbounded_note`
X_MARGIN = 2 ** 0.5  # half a doubling of budget on each side: a lone budget sits mid-panel, not on its edge
# Each budget kind's figure (merged runs of several kinds: the first kind's has no suffix) and its x axis.
SUFFIX = {"tokens": "", "bytes": "_bytes", "percent": "_relative"}
XLABEL = {"tokens": "budget (KV entries per layer and head)", "bytes": "budget (bytes of KV cache per sequence)",
          "percent": "budget (% of the context tokens)"}


def plot(rows: list[dict], out_dir: Path, sort: str = "accuracy") -> list[str]:
    """`accuracy_vs_budget.png`, `likelihood_vs_budget.png` (when rows have the metric; a panel per setting and
    task, all tasks pooled first) and, for needle tasks, `heatmap_<rule>.png`. Token, byte and relative budgets
    (merged runs) get separate figures, each after the first kind with its `SUFFIX` (`_bytes`, `_relative`).
    Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    budgeted = [r for r in rows if r["budget"] is not None]
    if not budgeted:
        return written
    kinds = [k for k in BUDGET_KINDS if any(label_kind(budget_label(r)) == k for r in budgeted)]
    for kind in kinds:
        rs = [r for r in rows if r["budget"] is None or label_kind(budget_label(r)) == kind]
        suffix = SUFFIX[kind] if kind != kinds[0] else ""
        metrics = ["accuracy"] + (["likelihood"] if metric_values(rs, "likelihood") else [])
        for metric in metrics:
            name = f"{metric}_vs_budget{suffix}.png"
            written.append(_save(metric_figure(rs, metric, kind, sort), out_dir / name))
    needle = needle_rows(budgeted)
    shape = needle_shape(needle)
    if shape != "none":
        for rule in rule_order(needle, sort):
            rs = [r for r in needle if r["rule"] == rule]
            # A wrapper's colon (`noprotect:h2o`) would read as a URL scheme in the report's image link.
            file = rule.replace(":", "_")
            if shape == "heatmap":
                written.append(_save(heatmap_figure(rs, rule), out_dir / f"heatmap_{file}.png"))
            else:
                written.append(_save(needle_bars_figure(rs, rule), out_dir / f"needle_{file}.png"))
    return written


def needle_rows(rows) -> list[dict]:
    """The budgeted rows of needle tasks that record a depth."""
    return [r for r in rows if r["budget"] is not None and r["task"] in NEEDLE_TASKS and r.get("depth") is not None]


def _depth(r) -> float:
    # The measured depth as the report's answers table prints it (`depth 0.25`): a needle placed at a sentence
    # boundary sits at 0.2497 for a requested 0.25; round(depth, 1) made that 0.2, and 0.75 made 0.8.
    return float(f"{float(r['depth']):.2f}")


def needle_shape(rows) -> str:
    """How the needle rows' accuracy by depth x length is drawn: "heatmap" (at least two of each), "bars" (one of
    them varies), or "none" (one depth and one length, or no needle rows: `needle_note` gives the sentence)."""
    rows = needle_rows(rows)
    depths, lengths = {_depth(r) for r in rows}, {r["length"] for r in rows}
    if len(depths) >= 2 and len(lengths) >= 2:
        return "heatmap"
    return "bars" if len(depths) >= 2 or len(lengths) >= 2 else "none"


def needle_note(rows) -> str | None:
    """The sentence that replaces a figure of one depth and one length (None when a figure is drawn, or without
    needle rows)."""
    rows = needle_rows(rows)
    if not rows or needle_shape(rows) != "none":
        return None
    return (f"Needle depth x context length: every needle sample sits at depth {_depth(rows[0]):.2f} in a "
            f"{rows[0]['length']}-token context, so there is no depth or length figure: the accuracy tables above "
            "hold the same numbers.")


def unbounded_note(ns) -> str:
    """A panel title's line for intervals that could not be drawn: `no bar: n=2: too few samples for an interval`."""
    return f"{UNBOUNDED_NOTE}: {no_interval_reason(min(ns))}"


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _x(label) -> float:
    return label_value(label)


def metric_figure(rows, metric: str, kind: str = "tokens", sort: str = "accuracy"):
    """Mean and 95% interval of `metric` ("accuracy" or "likelihood") per rule against the budget; rows of panels =
    settings, columns = all tasks pooled (when there are several: the most samples, so the tightest intervals) then
    each task. A panel whose intervals are unbounded says so in its title instead of drawing no bar silently.

    Returns:
        The matplotlib figure (not saved).
    """
    import matplotlib.pyplot as plt

    refs = reference_logprobs(rows)
    delta = metric == "likelihood" and bool(refs)
    panels, tasks = settings(rows), sorted({r["task"] for r in rows})
    tasks = (["all tasks"] if len(tasks) > 1 else []) + tasks
    fig, axes = plt.subplots(len(panels), len(tasks), figsize=(4.5 * len(tasks), 3.4 * len(panels)),
                             squeeze=False)
    rules = [r for r in rule_order(rows, sort) if r != REFERENCE]
    for row_axes, s in zip(axes, panels):
        for ax, task in zip(row_axes, tasks):
            trs = [r for r in rows if setting(r) == s and task in ("all tasks", r["task"])]
            unbounded = []
            for rule in rule_order(trs, sort):
                rs = [r for r in trs if r["rule"] == rule]
                if rule == REFERENCE:
                    values = metric_values(rs, metric)
                    if values:  # likelihood vs full: the reference is the zero line
                        ax.axhline(0.0 if delta else mean(values), color="k", ls="--", lw=1, label="full (unmodified)")
                    continue
                i = rules.index(rule)
                # Rules often tie: distinct markers and a small horizontal offset keep every line visible.
                shift = 2 ** (0.06 * (i - (len(rules) - 1) / 2))
                xs, ys, lo, hi = [], [], [], []
                for b in budgets(rs):
                    brs = [r for r in rs if budget_label(r) == b]
                    if metric == "accuracy":
                        iv = mean_interval([r["score"] for r in brs])
                    else:
                        values = [logprob_delta(r, refs) for r in brs] if delta else metric_values(brs, metric)
                        values = [v for v in values if v is not None]
                        if not values:
                            continue
                        iv = mean_interval(values, paired=delta)
                    if not iv.bounded:
                        unbounded.append(iv.n)
                    xs.append(_x(b) * shift), ys.append(iv.mean)
                    lo.append(_bar(iv.mean - iv.lo)), hi.append(_bar(iv.hi - iv.mean))
                bars = ax.errorbar(xs, ys, yerr=[lo, hi], color=f"C{i % 10}", marker="os^Dv<>PX*"[i % 10],
                                   ls=("-", "--", "-.", ":")[i % 4], capsize=2, lw=1.2, ms=4, elinewidth=0.8,
                                   label=rule)
                for line in bars[2]:  # faint intervals: the means stay readable where they overlap
                    line.set_alpha(0.35)
            labels = budgets(trs)
            ax.set_xscale("log", base=2)
            if labels:
                ax.set_xlim(min(map(_x, labels)) / X_MARGIN, max(map(_x, labels)) * X_MARGIN)
                ax.set_xticks([_x(b) for b in labels], [str(b) for b in labels])
            ax.minorticks_off()
            ax.set_title(f"{task} — {s}" + (f"\n{unbounded_note(unbounded)}" if unbounded else ""), fontsize=9)
            ax.set_xlabel(XLABEL[kind])
            if metric == "accuracy":
                ax.set_ylabel("accuracy (95% interval)")
                ax.set_ylim(-0.05, 1.05)
            else:
                ax.set_ylabel("log-prob/answer token" + (" vs full" if delta else "") + " (nats)")
    handles, names = axes[0][0].get_legend_handles_labels()
    for ax in axes.ravel()[1:]:  # every rule once, whichever panel drew it
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h), names.append(n)
    order = sorted(range(len(names)), key=lambda k: rules.index(names[k]) if names[k] in rules else -1)
    fig.legend([handles[k] for k in order], [names[k] for k in order], fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 1 - 1.3 / fig.get_figwidth(), 1))
    return fig


def _bar(length: float) -> float:
    # An unbounded interval (five samples or fewer) gets no bar rather than an infinite one; the title says so.
    return length if math.isfinite(length) else math.nan


def heatmap_figure(rs, rule: str):
    """Mean score per needle depth x context length, each cell labelled with its mean and samples; rows of panels =
    settings, columns = budgets, every title naming the rule, budget and setting (protocol). Depth labels are the
    depths the task set (0.25, 0.75), not rounded ones.

    Returns:
        The matplotlib figure (not saved).
    """
    import matplotlib.pyplot as plt

    panels, labels = settings(rs), budgets(rs)
    lengths = sorted({r["length"] for r in rs})
    depths = sorted({_depth(r) for r in rs})
    fig, axes = plt.subplots(len(panels), len(labels),
                             figsize=(1.8 + max(2.4, 1.3 * len(lengths)) * len(labels),
                                      1.2 + max(2.0, 0.5 * len(depths)) * len(panels)),
                             squeeze=False, sharey=True, constrained_layout=True)
    for row_axes, s in zip(axes, panels):
        for ax, b in zip(row_axes, labels):
            cell = [r for r in rs if setting(r) == s and budget_label(r) == b]
            groups = [[[r for r in cell if r["length"] == n and _depth(r) == d] for n in lengths] for d in depths]
            grid = [[_mean(g) for g in line] for line in groups]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for y, line in enumerate(groups):
                for x, g in enumerate(line):
                    ax.text(x, y, f"{_mean(g):.2f}\n(n={len(g)})" if g else "", ha="center", va="center",
                            fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
            ax.set_xlabel("context length (target tokens)")
            ax.set_title(f"{rule}, B={b}\n{s}", fontsize=9)
        row_axes[0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy")
    return fig


def needle_bars_figure(rs, rule: str):
    """The heatmap's numbers when only depth or only length varies: one bar per value of the one that varies
    (labelled with its mean and samples, the fixed one in the axis label); panels as `heatmap_figure`'s.

    Returns:
        The matplotlib figure (not saved).
    """
    import matplotlib.pyplot as plt

    panels, labels = settings(rs), budgets(rs)
    depths, lengths = sorted({_depth(r) for r in rs}), sorted({r["length"] for r in rs})
    by_depth = len(depths) >= 2
    values = depths if by_depth else lengths
    key = _depth if by_depth else (lambda r: r["length"])
    xlabel = (f"needle depth (context length {lengths[0]})" if by_depth and len(lengths) == 1 else
              "needle depth" if by_depth else f"context length (target tokens; needle depth {depths[0]:.2f})")
    fig, axes = plt.subplots(len(panels), len(labels), figsize=(1.0 + max(3.0, 0.8 * len(values)) * len(labels),
                                                                 1.0 + 2.6 * len(panels)),
                             squeeze=False, sharey=True, constrained_layout=True)
    for row_axes, s in zip(axes, panels):
        for ax, b in zip(row_axes, labels):
            cell = [r for r in rs if setting(r) == s and budget_label(r) == b]
            groups = [[r for r in cell if key(r) == v] for v in values]
            means = [_mean(g) if g else 0.0 for g in groups]
            ax.bar(range(len(values)), means, color="C0", width=0.6)
            for x, (m, g) in enumerate(zip(means, groups)):
                ax.text(x, m + 0.02, f"{m:.2f}\n(n={len(g)})" if g else "no samples", ha="center", va="bottom",
                        fontsize=8)
            ax.set_xticks(range(len(values)), [f"{v:.2f}" if by_depth else str(v) for v in values])
            ax.set_ylim(0, 1.25)
            ax.set_xlabel(xlabel)
            ax.set_title(f"{rule}, B={b}\n{s}", fontsize=9)
        row_axes[0].set_ylabel("accuracy")
    return fig


def _mean(rs) -> float:
    return mean(r["score"] for r in rs) if rs else float("nan")
