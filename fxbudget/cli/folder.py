"""One folder, one grid: `fxbudget compare --out DIR` refuses a folder whose rows are of another model, dtype, slot
storage, device, protocol or signal set than the command's. Resuming would otherwise pool them into one report (rows
of two models read as one grid, their two kernels as "rules did not run the same kernel"). Runs of different settings go to their own folders;
`fxbudget report DIR1 DIR2` reads several on purpose."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Identity:
    """What the rows of one folder must share: the model as rows name it, the dtype and device as `Placement` names
    them, and the command's protocols (the folder's rows must be of these; a command may add protocols). `signals`:
    the run's signal set as rows name it (`kernel.settings.signals_label`); None skips the check. `slot_dtype`: how
    its caches store keys and values (rows before it: the model's dtype)."""

    model: str
    dtype: str
    device: str
    protocols: tuple[str, ...]
    signals: str | None = None
    slot_dtype: str = "model"


def _kind(device: str) -> str:
    """`cuda:1` -> `cuda`: shards of one grid may run on different GPUs of one kind."""
    return str(device).split(":")[0]


def check(out: str | Path, run: Identity) -> None:
    """Refuse a command whose rows would join rows of another setting in `out`.

    Raises:
        ValueError: one line naming the difference (the folder's value and the command's) and the fix.
    """
    from ..harness.results import read_rows

    rows = [r for path in sorted(Path(out).glob("results*.jsonl")) for r in read_rows(path)]
    if not rows:
        return
    fix = f"give this command another --out (`fxbudget report {out} OTHER` reads several folders together)"
    for what, ours, value in (("model", run.model, lambda r: r.get("model")),
                              ("dtype", run.dtype, lambda r: r.get("dtype")),
                              ("slot storage (--slot-dtype)", run.slot_dtype, lambda r: r.get("slot_dtype") or "model"),
                              ("device", _kind(run.device), lambda r: _kind(r.get("device")))):
        theirs = sorted({str(value(r)) for r in rows if value(r) is not None} - {str(ours)})
        if theirs:
            raise ValueError(f"--out {out} holds rows of another {what} ({', '.join(theirs)}; this command: {ours}): "
                             f"one folder holds one grid; {fix}")
    other = sorted({r["protocol"] for r in rows if r.get("protocol") not in run.protocols})
    if other:
        both = ",".join([*run.protocols, *other])
        raise ValueError(f"--out {out} holds rows of protocol {', '.join(other)} (this command: "
                         f"{', '.join(run.protocols)}): one folder holds one grid; {fix}, or run them together "
                         f"with --protocol {both}")
    if run.signals is not None:
        _check_signals(out, rows, run.signals, fix)


def _check_signals(out, rows, ours: str, fix: str) -> None:
    """The signal set is a kernel setting (one kernel per grid): budgeted rows measured with another set would read as
    two kernels in one report. Rows written before the set was recorded measured every signal ("all")."""
    from ..kernel.settings import ALL_SIGNALS

    theirs = sorted({r.get("signals") or ALL_SIGNALS for r in rows if r.get("kernel_fingerprint")} - {ours})
    if theirs:
        raise ValueError(f"--out {out} holds budgeted rows measured with another signal set ({'; '.join(theirs)}; "
                         f"this command: {ours}; the set is the union of the rules' signals): one folder holds one "
                         f"grid; {fix}, or run every rule of the folder together, or pass --signals all to both")
