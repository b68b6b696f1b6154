"""Reports from result rows: a summary CSV, a Markdown report and PNG plots, merged from one or more run folders."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from statistics import mean

from ..models import DEFAULT_MODEL_NAME, DEFAULT_MODEL_WEIGHTS
from .results import read_rows
from .runner import REFERENCE
from .tasks import NEEDLE_TASKS

# Columns a summary groups by: a protocol, chunk size or backend is never averaged with another.
GROUP = ("model", "protocol", "chunk_size", "backend", "task", "length", "rule", "budget")


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
    """One line per `GROUP`: samples, mean score, mean prefill/decode time, KV memory, kernel fingerprint."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(r.get(k) for k in GROUP)].append(r)
    out = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        out.append({**dict(zip(GROUP, key)), "samples": len(rs), "accuracy": mean(r["score"] for r in rs),
                    "prefill_s": mean(r["prefill_s"] for r in rs), "decode_s": mean(r["decode_s"] for r in rs),
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


def write_csv(summary: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)


def _rule_order(rows) -> list[str]:
    rules = sorted({r["rule"] for r in rows} - {REFERENCE})
    return ([REFERENCE] if any(r["rule"] == REFERENCE for r in rows) else []) + rules


def accuracy_table(rows: list[dict]) -> str:
    """Markdown: mean score per rule (rows) x budget (columns) over `rows`; the reference row spans all budgets."""
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    lines = ["| rule | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for rule in _rule_order(rows):
        cells = []
        for b in budgets:
            rs = [r for r in rows if r["rule"] == rule and (rule == REFERENCE or r["budget"] == b)]
            cells.append(f"{mean(r['score'] for r in rs):.2f} ({len(rs)})" if rs else "")
        name = "full (unmodified model)" if rule == REFERENCE else rule
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by(rows, *keys) -> dict:
    """Rows grouped by the value of `keys` (a tuple of values when several), in a stable order."""
    out = defaultdict(list)
    for r in rows:
        out[r.get(keys[0]) if len(keys) == 1 else tuple(r.get(k) for k in keys)].append(r)
    return dict(sorted(out.items(), key=lambda kv: (not isinstance(kv[0], (int, float)), kv[0] if
                                                     isinstance(kv[0], (int, float)) else str(kv[0]))))


def markdown(rows: list[dict], plots: list[str]) -> str:
    """The report: setup, the kernel fingerprint check, then per protocol an accuracy table overall and per task."""
    first = rows[0]
    models = sorted({r["model"] for r in rows})
    prints = {r["kernel_fingerprint"] for r in rows if r.get("kernel_fingerprint")}
    windows = sorted({r["window"] for r in rows if r.get("window") is not None})
    names = [f"{m} ({DEFAULT_MODEL_WEIGHTS}: 4-bit-quantized weights)" if m == DEFAULT_MODEL_NAME else m
             for m in models]
    parts = ["# fxbudget comparison", "",
             f"- model: {', '.join(names)}; dtype {first['dtype']}, device {first['device']}, "
             f"torch {first['torch']}, transformers {first['transformers']}, fxbudget {first['fxbudget']}, "
             f"{first['threads']} torch thread(s)",
             f"- {len(rows)} rows; cells are mean score (samples). Score = fraction of the expected answers found in "
             "the output.",
             "- kernel: " + (f"one shared kernel for every rule (fingerprint `{next(iter(prints))[:16]}`)"
                             if len(prints) == 1 else
                             f"**{len(prints)} different kernel fingerprints** — rules did not run the same kernel"
                             if prints else "no budgeted rows"),
             "- observation window (last queries of a call whose attention `window_attn` sums; one per comparison): "
             + (f"{windows[0]}" if len(windows) == 1 else
                f"**{len(windows)} different windows ({', '.join(map(str, windows))})**: rules did not see the same "
                "signals" if windows else "none")]
    for protocol, prs in _by(rows, "protocol").items():
        for (chunk, backend), crs in _by(prs, "chunk_size", "backend").items():
            parts += ["", f"## protocol: {protocol}, prefill chunk: {chunk or 'one call'}, backend: {backend}", "",
                      "### all tasks", "", accuracy_table(crs)]
            for task, trs in _by(crs, "task").items():
                lengths = sorted({r["n_tokens"] for r in trs})
                parts += ["", f"### {task} (context {lengths[0]}-{lengths[-1]} tokens)", "", accuracy_table(trs)]
            parts += ["", "### cost (mean per sample)", "", _cost_table(crs)]
    if plots:
        parts += ["", "## plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def _cost_table(rows) -> str:
    lines = ["| rule | budget | prefill s | decode s | output tokens | KV MiB held / allocated | compile s |",
             "|---" * 7 + "|"]
    for rule in _rule_order(rows):
        for budget, rs in _by([r for r in rows if r["rule"] == rule], "budget").items():
            prefill = f"{mean(r['prefill_s'] for r in rs):.2f}"
            if rs[0].get("shared_prefill"):  # the forward ran once per sample for all rules; this row branched
                prefill = f"{mean(r['prefill_s'] - r['branch_s'] for r in rs):.1f} shared + " \
                          f"{mean(r['branch_s'] for r in rs):.2f}"
            lines.append(f"| {rule} | {budget if budget is not None else '-'} | {prefill} | "
                         f"{mean(r['decode_s'] for r in rs):.2f} | {mean(r['output_tokens'] for r in rs):.1f} | "
                         f"{_fmt(_mean_mib(rs, 'kv_held_bytes'))} / {_fmt(_mean_mib(rs, 'kv_allocated_bytes'))} | "
                         f"{sum(r['compile_s'] for r in rs):.1f} |")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot(rows: list[dict], out_dir: Path) -> list[str]:
    """`accuracy_vs_budget.png` (one panel per task) and, for needle tasks, `heatmap_<rule>.png` (depth x length,
    one panel per budget). Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    budgeted = [r for r in rows if r["budget"] is not None]
    if not budgeted:
        return written
    tasks = _by(rows, "task")
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
    rules = [r for r in _rule_order(rows) if r != REFERENCE]
    for ax, (task, trs) in zip(axes[0], tasks.items()):
        for rule in _rule_order(trs):
            rs = [r for r in trs if r["rule"] == rule]
            if rule == REFERENCE:
                ax.axhline(mean(r["score"] for r in rs), color="k", ls="--", lw=1, label="full (unmodified)")
                continue
            i = rules.index(rule)
            # Rules often tie: distinct markers and a small horizontal offset keep every line visible.
            shift = 2 ** (0.04 * (i - (len(rules) - 1) / 2))
            points = sorted((b, mean(r["score"] for r in brs)) for b, brs in _by(rs, "budget").items())
            ax.plot([p[0] * shift for p in points], [p[1] for p in points], marker="os^Dv<>PX*"[i % 10],
                    ls=("-", "--", "-.", ":")[i % 4], label=rule)
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget"] for r in trs if r["budget"] is not None})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_title(task)
        ax.set_xlabel("budget (KV entries per layer and head)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy_vs_budget.png", dpi=110)
    plt.close(fig)
    written.append("accuracy_vs_budget.png")

    needle = [r for r in budgeted if r["task"] in NEEDLE_TASKS and r.get("depth") is not None]
    for rule, rs in _by(needle, "rule").items():
        budgets = sorted({r["budget"] for r in rs})
        lengths = sorted({r["length"] for r in rs})
        depths = sorted({round(r["depth"], 1) for r in rs})
        fig, axes = plt.subplots(1, len(budgets), figsize=(1.8 + 1.3 * len(lengths) * len(budgets), 3.2),
                                 squeeze=False, sharey=True, constrained_layout=True)
        for ax, b in zip(axes[0], budgets):
            grid = [[_cell([r for r in rs if r["budget"] == b and r["length"] == n and round(r["depth"], 1) == d])
                     for n in lengths] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for y, line in enumerate(grid):
                for x, v in enumerate(line):
                    ax.text(x, y, "" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.1f}" for d in depths])
            ax.set_xlabel("context tokens")
            ax.set_title(f"{rule}, B={b}", fontsize=9)
        axes[0][0].set_ylabel("needle depth")
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
        name = f"heatmap_{rule}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def _cell(rs) -> float:
    return mean(r["score"] for r in rs) if rs else float("nan")


def report(dirs: list[str | Path], out_dir: str | Path | None = None) -> Path:
    """Merge the rows of `dirs` and write `summary.csv`, `report.md` and the plots into `out_dir` (default: the
    first dir). Returns the report's path."""
    rows = load_rows(dirs)
    if not rows:
        raise ValueError(f"no result rows in {', '.join(map(str, dirs))}")
    out = Path(out_dir or dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    write_csv(summarize(rows), out / "summary.csv")
    plots = plot(rows, out)
    path = out / "report.md"
    path.write_text(markdown(rows, plots))
    return path
