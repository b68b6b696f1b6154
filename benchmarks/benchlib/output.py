"""Markdown tables and result files."""

from __future__ import annotations

from pathlib import Path

from .env import RESULTS
from typing import Iterable, Sequence


def analysis_link(name: str) -> list[str]:
    """Markdown lines pointing to the hand-written analysis beside a generated report (never written by a script)."""
    return ["", f"Analysis (hand-written, quotes this file's numbers): [{name}.analysis.md]({name}.analysis.md)."]


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table; floats are printed with 1 decimal unless pre-formatted as strings."""
    def cell(x):
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return lines


def emit(lines: Sequence[str], out: str | None, quick: bool, name: str, folder: Path = RESULTS) -> None:
    """Write a script's report to `out`, or to `folder`/<name>.md (benchmarks/results/ by default; a study's:
    `env.STUDY_RESULTS`) unless it is a `--quick` smoke run (then only print it)."""
    out = out or (None if quick else str(folder / f"{name}.md"))
    if out:
        write_md(out, lines)
    else:
        print("\n".join(lines))


def write_md(path: str | Path, lines: Sequence[str]) -> str:
    """Write `lines` as a markdown file (parents created), print it, and return the text."""
    text = "\n".join(lines).rstrip() + "\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return text
