"""The start estimate calibrated on this machine: each finished `fxbudget compare` appends what it measured to
`$FXBUDGET_CACHE/rates.jsonl` (default `~/.cache/fxbudget/rates.jsonl`; `FXBUDGET_RATES` names another file), and
the next run's estimate reads the entries of the same device, dtype, torch threads, backend and model.

An entry holds the run's token-based estimate at the committed quick start's rates (`sizes.formula_seconds`), the
seconds its rows took (compile and run, the runner's own timers) and the seconds around them from the estimate line
to the end (model load, kernel fingerprints, the report). The calibrated estimate is `fixed + factor x formula`:
`factor`, the median over the last `KEEP` entries of rows seconds / formula seconds (this machine's rate against
the quick start's), and `fixed`, the latest entry's (the fingerprint cache makes a rerun's smaller than a first
run's). A machine with no entry gets the uncalibrated estimate, which says so. Ray runs are not recorded (their
workers' time is not the driver's).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import median

KEEP = 5  # entries of a key the factor is the median of


def path() -> Path:
    """The rates file: `$FXBUDGET_RATES`, else `$FXBUDGET_CACHE/rates.jsonl` (default `~/.cache/fxbudget`)."""
    own = os.environ.get("FXBUDGET_RATES")
    if own:
        return Path(own)
    return Path(os.environ.get("FXBUDGET_CACHE") or Path.home() / ".cache" / "fxbudget") / "rates.jsonl"


def key(device: str, dtype: str, threads: int, backend: str | None, model: str) -> str:
    """What a rate depends on besides the grid: the machine's device, dtype, torch threads, backend and model."""
    return f"{model}|{device}|{dtype}|{threads} threads|{backend or 'eager'}"


@dataclass(frozen=True)
class Calibration:
    """This machine's rate against the quick start's (`factor`), the seconds outside the rows (`fixed`), and how
    many earlier runs they come from."""

    factor: float
    fixed: float
    runs: int

    def seconds(self, formula_s: float) -> float:
        return self.fixed + self.factor * formula_s


def calibration(run_key: str, file: Path | None = None) -> Calibration | None:
    """The calibration of `run_key` from the rates file, None without an entry (unreadable lines are skipped)."""
    file = file or path()
    if not file.is_file():
        return None
    entries = []
    for line in file.read_text().splitlines():
        try:
            e = json.loads(line)
            if e["key"] == run_key and e["formula_s"] > 0 and e["rows_s"] >= 0 and e["fixed_s"] >= 0:
                entries.append(e)
        except (ValueError, KeyError, TypeError):
            continue
    if not entries:
        return None
    last = entries[-KEEP:]
    return Calibration(median(e["rows_s"] / e["formula_s"] for e in last), last[-1]["fixed_s"], len(last))


def record(run_key: str, formula_s: float, rows_s: float, fixed_s: float, rows: int, file: Path | None = None) -> None:
    """Append a finished run's measurements; a file that cannot be written is said on stderr and the run goes on
    (the next estimate is then uncalibrated, and says so)."""
    file = file or path()
    entry = {"key": run_key, "formula_s": round(formula_s, 3), "rows_s": round(rows_s, 3),
             "fixed_s": round(fixed_s, 3), "rows": rows}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with file.open("a") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError as e:
        print(f"[fxbudget] warning: could not record this run's rate in {file} ({e}); the next estimate will not be "
              "calibrated on it", file=sys.stderr)
