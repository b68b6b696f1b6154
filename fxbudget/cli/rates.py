"""The start estimate calibrated on this machine: each finished `fxbudget compare` appends what it measured to
`$FXBUDGET_CACHE/rates.jsonl` (default `~/.cache/fxbudget/rates.jsonl`; `FXBUDGET_RATES` names another file), and
the next run's estimate reads the entries of the same device, dtype, torch threads, backend and model.

An entry holds the run's token-based estimate at the committed quick start's rates (`sizes.formula_seconds`), the
seconds its rows took (compile and run, the runner's own timers), the seconds spent tracing kernel fingerprints per
rule traced, the rules whose fingerprints it left in the fingerprint cache, and the other seconds from the estimate
line to the end (model load, the report). The calibrated estimate is `fixed + factor x formula + new x trace`:
`factor`, the median over the last `KEEP` entries of rows seconds / formula seconds (this machine's rate against
the quick start's); `fixed`, the latest entry's; `trace`, the latest measured seconds per fingerprint, for the
`new` rules no earlier run of the key has fingerprinted (the others are read from the fingerprint cache). A machine
with no entry gets the uncalibrated estimate, which says so. Ray runs are not recorded (their workers' time is not
the driver's).
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


def rule_ids(rules: list[str], params: dict[str, dict]) -> list[str]:
    """The budgeted rules of a grid as the fingerprint cache tells them apart: name and hyperparameters."""
    return [r + (json.dumps(params[r], sort_keys=True) if params.get(r) else "") for r in rules if r != "full"]


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
    trace: float = 0.0  # seconds per kernel fingerprint traced, as last measured
    traced: frozenset = frozenset()  # rules the earlier runs fingerprinted (now in the fingerprint cache)

    def seconds(self, formula_s: float, rules: list[str] = ()) -> float:
        """The estimate of a grid whose formula seconds are `formula_s` and whose budgeted rules are `rules`."""
        return self.fixed + self.factor * formula_s + self.trace * len(self.new(rules))

    def new(self, rules) -> list[str]:
        """The `rules` no earlier run has fingerprinted."""
        return [r for r in rules if r not in self.traced]


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
    traces = [e["trace_s"] for e in entries if e.get("trace_s")]
    return Calibration(median(e["rows_s"] / e["formula_s"] for e in last), last[-1]["fixed_s"], len(last),
                       traces[-1] if traces else 0.0, frozenset(r for e in entries for r in e.get("rules", [])))


def record(run_key: str, formula_s: float, rows_s: float, fixed_s: float, rows: int, file: Path | None = None, *,
           trace_s: float | None = None, rules: list[str] = ()) -> None:
    """Append a finished run's measurements (`trace_s`: seconds per fingerprint traced, None when it traced none;
    `rules`: its budgeted rules, fingerprinted now); a file that cannot be written is said on stderr and the run
    goes on (the next estimate is then uncalibrated, and says so)."""
    file = file or path()
    entry = {"key": run_key, "formula_s": round(formula_s, 3), "rows_s": round(rows_s, 3),
             "fixed_s": round(fixed_s, 3), "rows": rows, "trace_s": None if trace_s is None else round(trace_s, 3),
             "rules": sorted(rules)}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with file.open("a") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError as e:
        print(f"[fxbudget] warning: could not record this run's rate in {file} ({e}); the next estimate will not be "
              "calibrated on it", file=sys.stderr)
