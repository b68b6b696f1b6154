"""Before vs after: one benchmark's results file from the old kernel beside the same benchmark on the new one.

A kernel change must not make a benchmark worse by more than a tolerance (issue 20: 5%). Each benchmark writes its
own markdown table; this script reads the first table of both files, matches rows by their key columns and writes
after / before for every numeric column. Nothing is measured here: both sides are numbers their own scripts wrote
(run one after the other in one session on one machine, so the seconds compare), each file's header states its
machine, load and date.

    python benchmarks/studies/rerun_compare.py --out benchmarks/studies/results/kernel_before_after.md \
        --pair benchmarks/results/before/compile_time.md benchmarks/results/compile_time.md 2

Args (per `--pair BEFORE AFTER K`): the first K columns are the row key; the others are compared where both are
numbers (load-average columns are context, not compared). BEFORE and AFTER may each list several runs,
comma-separated: each cell is then the median of the runs.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: benchlib
from benchlib.env import ROOT, command_line  # noqa: E402
from benchlib.output import md_table, write_md  # noqa: E402

_NUM = re.compile(r"^\s*\**(-?\d+(?:\.\d+)?)")


def first_table(text: str) -> tuple[list[str], list[list[str]]]:
    """Returns the header and rows of the first markdown table in `text`."""
    lines = [ln.strip() for ln in text.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|") and i + 1 < len(lines)
                 and set(lines[i + 1].replace("|", "").strip()) <= set("-: "))
    cells = lambda ln: [c.strip() for c in ln.strip("|").split("|")]  # noqa: E731
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append(cells(ln))
    return cells(lines[start]), rows


def number(cell: str) -> float | None:
    """The leading number of a cell ("181.6 [178.7-187.2]" -> 181.6), or None."""
    m = _NUM.match(cell)
    return float(m.group(1)) if m else None


def header_field(text: str, field: str) -> str:
    """A `- Field ...` line of a results header (e.g. the date and load), or '?'."""
    for ln in text.splitlines():
        if ln.startswith(f"- {field}"):
            return ln[2:]
    return "?"


def _cells(texts: list[str], keys: int) -> tuple[list[str], dict[tuple, dict[str, list[float]]], list[tuple]]:
    """The first run's header, {row key: {column: numbers across the files}} and the row keys in order, of several
    runs of one benchmark (their key columns must agree; a column some runs lack is compared where present)."""
    header, cells, order = None, {}, []
    for text in texts:
        h, rows = first_table(text)
        if header is None:
            header = h
        elif h[:keys] != header[:keys]:
            raise SystemExit(f"the tables' key columns differ:\n  {header[:keys]}\n  {h[:keys]}")
        for r in rows:
            key = tuple(r[:keys])
            if key not in cells:
                cells[key] = {}
                order.append(key)
            for col, c in zip(h[keys:], r[keys:]):
                x = number(c)
                if x is not None and not col.startswith("load"):  # load averages are context, not results
                    cells[key].setdefault(col, []).append(x)
    return header, cells, order


def compare(before: list[str], after: list[str], keys: int, tol: float) -> tuple[list[str], list[list], int]:
    """Rows of (key..., column, before, after, after / before, verdict) and the count of cells worse than `tol`.

    With several runs on a side, each cell is their median. Lower is better for every compared column of these
    benchmarks (seconds, MB, ratios to the unmodified model or to plain SDPA).
    """
    h_old, old, _ = _cells(before, keys)
    h_new, new, order = _cells(after, keys)
    if h_old[:keys] != h_new[:keys]:
        raise SystemExit(f"the tables' key columns differ:\n  {h_old[:keys]}\n  {h_new[:keys]}")
    out, worse = [], 0  # columns only one side has (an after-run's own "before" columns) are skipped
    for key in order:
        for col in h_new[keys:]:
            xs, ys = old.get(key, {}).get(col), new[key].get(col)
            if not xs or not ys or statistics.median(xs) == 0:
                continue
            x, y = statistics.median(xs), statistics.median(ys)
            bad = y / x > 1 + tol
            worse += bad
            out.append([*key, col, _fmt(xs), _fmt(ys), f"{y / x:.2f}", "**worse**" if bad else "ok"])
    return [*h_new[:keys], "column", "before", "after", "after / before", f"within {tol:.0%}"], out, worse


def _fmt(xs: list[float]) -> str:
    m = statistics.median(xs)
    return f"{m:g}" if len(xs) == 1 else f"{m:g} (median of {len(xs)}: {', '.join(f'{x:g}' for x in xs)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", nargs=3, action="append", required=True, metavar=("BEFORE", "AFTER", "K"),
                   help="results files of one benchmark before and after (comma-separated for several runs: the "
                        "median is compared) and the number of key columns")
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    lines = ["# Before vs after a kernel change: the same benchmarks, one machine, one session", "",
             f"- Command: `{command_line('')}`", "",
             f"Lower is better in every compared column; a cell is **worse** when after / before > 1 + {a.tol}."]
    for before, after, keys in a.pair:
        olds, news = before.split(","), after.split(",")
        old, new = [Path(f).read_text() for f in olds], [Path(f).read_text() for f in news]
        head, rows, worse = compare(old, new, int(keys), a.tol)
        lines += ["", f"## {Path(news[0]).name}", ""]
        lines += [f"- before: `{_rel(f)}`, {header_field(t, 'Date')}" for f, t in zip(olds, old)]
        lines += [f"- after: `{_rel(f)}`, {header_field(t, 'Date')}" for f, t in zip(news, new)]
        lines += ["",
                  *md_table(head, rows), "", f"{worse} of {len(rows)} cells worse than {a.tol:.0%}."]
    write_md(a.out, lines)


def _rel(path: str) -> str:
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path


if __name__ == "__main__":
    main()
