"""Result files (`results*.jsonl`): one JSON row per line, appended as each row completes.

A run killed at any point (SIGKILL, out of memory, power loss) leaves at most its last line cut short, since rows are
only ever appended. Readers leave such a line out and say so: that row never completed, so a rerun does it again.
The writer repairs the file before appending, so a new row is never glued to the cut one. Any other line that is not
a row is an error: the file was edited, or two runs wrote it at once.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO

log = logging.getLogger("fxbudget")


def _parse(path: Path) -> tuple[list[dict], int, int]:
    """(complete rows, byte length of the lines they end, byte length of the file); raises on a bad inner line."""
    data = path.read_bytes()
    rows, end = [], 0
    lines = data.split(b"\n")
    for n, line in enumerate(lines, 1):
        last = n == len(lines)  # the bytes after the last newline: empty, or a line whose write was cut
        row = _row(line)
        if row is None and line.strip():
            if last:
                log.warning("%s: line %d is cut short (a run was killed while writing it); left out, a rerun "
                            "does that row again", path, n)
                break
            raise ValueError(f"{path}:{n}: not a result row; the file was edited or written by two runs at once: "
                             "delete that line (its row runs again) and rerun")
        if row is not None:
            rows.append(row)
        if not last:
            end += len(line) + 1
        elif row is not None:
            end = len(data)  # a complete row whose newline was not written yet: kept
    return rows, end, len(data)


def _row(line: bytes) -> dict | None:
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return row if isinstance(row, dict) and "key" in row else None


def read_rows(path: str | Path) -> list[dict]:
    """The complete rows of one results file, in file order (a cut last line is left out, with a warning)."""
    return _parse(Path(path))[0]


def repair(path: str | Path) -> None:
    """Make `path` safe to append to: drop a cut last line, end a complete last row with its newline."""
    path = Path(path)
    if not path.is_file():
        return
    _, end, size = _parse(path)
    if end < size:  # `end` is 0 or just after a newline
        log.warning("%s: removed its cut last line before appending", path)
        with path.open("r+b") as f:
            f.truncate(end)
    elif size:
        with path.open("r+b") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a complete row whose newline was not written
                f.write(b"\n")


def append_row(f: IO[str], row: dict) -> None:
    """Write one row as one line, flushed and synced to disk: a killed run loses at most the row being written."""
    f.write(json.dumps(row, default=str) + "\n")
    f.flush()
    os.fsync(f.fileno())
