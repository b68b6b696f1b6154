"""Issue 50, item 1: Ctrl-C is never lost. A real `fxbudget compare` process on a tiny model gets SIGINT at six
moments (model load, the kernel fingerprint, inside the first row, inside a later row, the report, and a second
Ctrl-C during a stretch with no safe point); each must exit 130 within seconds with one line naming what is saved
and the command that resumes, no traceback, a results file of complete rows, and a rerun that resumes.

The moments are found with a hook, not with sleeps: the child runs `fxbudget.cli.main` with
`fxbudget.harness.interrupt.checkpoint` wrapped so that, at the n-th safe point of a given name, the process sends
itself SIGINT and goes on into the work after it (the model load, the tracing, the row's next decode step, the
report), as a Ctrl-C pressed right then would find it."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxbudget.cli import main
from fxbudget.harness import interrupt

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--tasks", "passkey", "--lengths", "300", "--samples", "2", "--rules", "full,snapkv", "--budgets", "32",
        "--max-new-tokens", "3", "--quiet"]
ROWS = 4  # 2 samples x (full, snapkv at 32)

# The child: `fxbudget compare ARGS...` whose checkpoint POINT sends SIGINT to the process the N-th time it is
# passed, writing the time to LOG (then the time `main` returned); with SLEEP = 1 it then sleeps as a stretch without
# a safe point would, until the test's second Ctrl-C.
CHILD = r"""
import json, os, signal, sys, time
from fxbudget.harness import interrupt

point, nth, log, sleep = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
real, hits, times = interrupt.checkpoint, [0], {}


def checkpoint(where=""):
    real(where)
    if where == point:
        hits[0] += 1
        if hits[0] == nth:
            times["signal"] = time.time()
            os.kill(os.getpid(), signal.SIGINT)
            open(log, "w").write(json.dumps(times))
            if sleep:
                time.sleep(120)


interrupt.checkpoint = checkpoint
from fxbudget.cli import main

status = main(sys.argv[5:])
times["stop"] = time.time()
open(log, "w").write(json.dumps(times))
sys.exit(status)
"""


def _start(tiny_dir, out: Path, point: str, nth: int, env: dict, sleep: bool = False) -> subprocess.Popen:
    argv = ["compare", "--model", tiny_dir, *ARGS, "--out", str(out)]
    log = out.parent / f"{out.name}.times.json"
    return subprocess.Popen([sys.executable, "-c", CHILD, point, str(nth), str(log), "1" if sleep else "0", *argv],
                            cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _rows(out: Path) -> list[dict]:
    """Every line of the results file, each a complete row (a cut or glued line fails here)."""
    path = out / "results.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    assert not text or text.endswith("\n"), text[-200:]
    rows = [json.loads(line) for line in text.splitlines()]
    assert all("key" in r for r in rows) and len({r["key"] for r in rows}) == len(rows)
    return rows


def _finish(proc: subprocess.Popen, out_dir: Path, since: float | None = None) -> tuple[str, str]:
    """The child's stdout and stderr, once it exited 130 with no traceback within seconds of its Ctrl-C (`since`: the
    test's own second one; else the child's)."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Exception ignored" not in err, err
    times = json.loads((out_dir.parent / f"{out_dir.name}.times.json").read_text())
    # Generous for a shared machine: the tiny model reaches its next safe point in milliseconds of CPU.
    assert times["stop"] - (since or times["signal"]) < 30, times
    return out, err


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")  # kernel fingerprints: traced once, by the first child
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FXBUDGET_CACHE": str(cache),
            "FXBUDGET_RATES": str(cache / "rates.jsonl")}


def test_ctrl_c_at_every_moment_stops_with_one_line_and_resumes(tiny_dir, tmp_path, env, capsys, monkeypatch):
    command = re.escape(f"fxbudget compare --model {tiny_dir} ") + ".*" + re.escape(" --quiet --out ")
    runs = {name: tmp_path / name for name in ("load", "fingerprint", "first", "later", "report", "twice")}
    # The fingerprint child traces snapkv's kernel fingerprint and leaves it in the cache the others read.
    procs = {"load": _start(tiny_dir, runs["load"], "model load", 1, env),
             "fingerprint": _start(tiny_dir, runs["fingerprint"], "fingerprint", 1, env)}
    fingerprint_err = _finish(procs.pop("fingerprint"), runs["fingerprint"])[1]
    procs |= {"first": _start(tiny_dir, runs["first"], "decode step", 1, env),
              "later": _start(tiny_dir, runs["later"], "row", 2, env),
              "report": _start(tiny_dir, runs["report"], "report", 1, env),
              "twice": _start(tiny_dir, runs["twice"], "report", 1, env, sleep=True)}
    mark = tmp_path / "twice.times.json"
    deadline = time.monotonic() + 300
    while not mark.exists():  # the first Ctrl-C is recorded and the child is in a stretch with no safe point
        assert time.monotonic() < deadline and procs["twice"].poll() is None, procs["twice"].communicate()[1][-3000:]
        time.sleep(0.1)
    second = time.time()
    procs["twice"].send_signal(signal.SIGINT)  # the second Ctrl-C: at once, not after the 120 s stretch
    errs = {"fingerprint": fingerprint_err}
    for name, proc in procs.items():
        out, errs[name] = _finish(proc, runs[name], second if name == "twice" else None)
        assert not out.strip(), (name, out)  # stopped before the tables

    # Exactly one line says it, the last; the rows on disk are what it says.
    saved = {}
    for name, err in errs.items():
        lines = err.strip().splitlines()
        said = [line for line in lines if "interrupted" in line]
        assert said == [lines[-1]], (name, err)
        saved[name] = len(_rows(runs[name]))
        if name in ("report", "twice"):
            assert saved[name] == ROWS
            continue
        where = f"in {runs[name] / 'results.jsonl'}" if saved[name] else f"(nothing written in {runs[name]} yet)"
        assert re.fullmatch(rf"\[fxbudget\] interrupted: {saved[name]} of {ROWS} rows saved {re.escape(where)}; "
                            rf"resume with: {command}{re.escape(str(runs[name]))}", lines[-1]), (name, lines[-1])
    # Each moment stopped where it should: before any row (model load), after the reference row (its snapkv
    # fingerprint), inside the first row (not written), inside the third (two written).
    assert saved["load"] == 0 and saved["first"] == 0 and saved["later"] == 2 and saved["fingerprint"] == 1, saved
    assert errs["report"].strip().splitlines()[-1] == (
        f"[fxbudget] interrupted after the report: all {ROWS} rows are saved in {runs['report'] / 'results.jsonl'}, "
        f"the report in {runs['report'] / 'report.md'}; rerunning prints the tables: fxbudget compare --model "
        f"{tiny_dir} {' '.join(ARGS)} --out {runs['report']}")
    assert errs["twice"].strip().splitlines()[-1] == (
        f"[fxbudget] interrupted while writing the report: all {ROWS} rows are saved in "
        f"{runs['twice'] / 'results.jsonl'}; write it with: fxbudget report {runs['twice']}")
    assert not (runs["twice"] / "report.md").exists() and (runs["report"] / "report.md").exists()

    # The same command resumes each: the missing rows run, every row once; a finished grid writes a missing report.
    monkeypatch.setenv("FXBUDGET_CACHE", env["FXBUDGET_CACHE"])
    capsys.readouterr()
    for name, out in runs.items():
        assert main(["compare", "--model", tiny_dir, *ARGS, "--out", str(out)]) == 0, name
        printed = capsys.readouterr()
        if 0 < saved[name] < ROWS:
            assert f"resuming: {saved[name]} of {ROWS} rows done" in printed.err, (name, printed.err)
        assert len(_rows(out)) == ROWS and (out / "report.md").is_file(), name
        assert f"report (paired comparisons per budget): {out / 'report.md'}" in printed.out, (name, printed.out)


def test_the_handler_is_installed_only_while_compare_runs(tiny_dir, tmp_path, monkeypatch):
    from fxbudget.cli import compare

    before = signal.getsignal(signal.SIGINT)
    seen = []

    def run(args):
        seen.append(signal.getsignal(signal.SIGINT))
        interrupt.checkpoint("test")  # nothing recorded: passes
        os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised
        seen.append(interrupt.requested())
        interrupt.checkpoint("test")  # raises here
        raise AssertionError("the checkpoint did not stop the run")

    monkeypatch.setattr(compare, "_compare", run)
    assert main(["compare", "--model", tiny_dir, *ARGS, "--out", str(tmp_path / "x")]) == 130
    assert seen == [interrupt._handler, True]
    assert signal.getsignal(signal.SIGINT) is before and not interrupt.requested()


def test_a_second_ctrl_c_raises_at_once_and_immediate_raises_on_the_first():
    with interrupt.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # not reached: the second Ctrl-C raises in here
    with interrupt.deferred():
        with pytest.raises(KeyboardInterrupt), interrupt.immediate():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)


def test_the_first_ctrl_c_says_at_once_that_it_was_heard(capfd):
    # Issue 55: after a Ctrl-C inside a row nothing printed for the seconds the row took to reach its safe point.
    with interrupt.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        assert capfd.readouterr().err == interrupt.NOTICE
        assert "interrupted" not in interrupt.NOTICE  # the one "interrupted" line stays the last one
        with pytest.raises(KeyboardInterrupt):
            interrupt.checkpoint("test")
