"""`fxbudget compare --ray` on a local Ray with 2 workers (tiny random Qwen2): the rows equal a serial run's, a worker
SIGKILLed mid-sample costs nothing but time, and without Ray installed `--ray` says how to install it."""

import json
import os
import signal
import sys
import threading
import time

import pytest

from fxbudget.cli import main
from fxbudget.harness.report import load_rows
from fxbudget.harness.runner import Grid

# Passkey samples of 2000 tokens, two protocols sharing one prefill, relative budgets (3% evicts, 100% covers the
# context): each sample (unit) has 2 x (1 + 2 x 2) = 10 rows, long enough to kill its worker between its first and
# last row.
RULES, BUDGETS, PROTOCOLS, SAMPLES, LENGTH, NEW = "full,snapkv,knorm", "3%,100%", "query-agnostic,streaming", 3, 2000, 4
ROWS_PER_SAMPLE = 10
ARGS = ["--tasks", "passkey", "--lengths", str(LENGTH), "--rules", RULES, "--budgets", BUDGETS,
        "--protocol", PROTOCOLS, "--samples", str(SAMPLES), "--max-new-tokens", str(NEW), "--quiet"]
# What must not depend on where a row ran.
SAME = ("prediction", "score", "output_tokens", "kv_allocated_bytes", "kv_held_bytes", "kernel_fingerprint",
        "layer_budgets", "shared_prefill", "n_tokens", "depth", "headroom", "window", "rule_params",
        "protocol", "budget", "budget_fraction", "answer_logprob", "answer_logprob_mean")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs started by the test (the driver then uses it as it is)."""
    try:
        import ray
    except ImportError:  # never a skip: `make test` (CI) installs the extra, so a missing Ray is a broken setup
        pytest.fail("tests/test_ray.py needs Ray, the [ray] extra: `make test` installs it, or pip install -c "
                    "constraints.txt -e '.[ray]'", pytrace=False)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def idle_ray(local_ray):
    """The local Ray once both CPUs are free again: a run kills its workers when it ends, but Ray hands their CPUs
    back a moment later, and a next run sizes itself on what is free."""
    deadline = time.monotonic() + 30
    while local_ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, f"the local Ray did not free its CPUs: {local_ray.available_resources()}"
        time.sleep(0.1)
    return local_ray


@pytest.fixture(scope="module")
def serial(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    assert main(["compare", "--model", tiny_dir, *ARGS, "--out", str(out)]) == 0
    return {r["key"]: r for r in load_rows([out])}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_same_rows(rows: dict, serial: dict):
    assert set(rows) == set(serial)
    for key, row in rows.items():
        assert {f: row.get(f) for f in SAME} == {f: serial[key].get(f) for f in SAME}, key


def test_rows_equal_the_serial_run_and_resume(tiny_dir, idle_ray, serial, tmp_path):
    """Resuming from the serial run's first rows (one sample cut after its 4th row), 2 workers write the rest: every
    row once, equal to the serial run's; a rerun has nothing left to do."""
    out = tmp_path / "out"
    out.mkdir()
    first = list(serial.values())[:4]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    assert main(["compare", "--model", tiny_dir, *ARGS, "--out", str(out), "--ray", "--workers", "2"]) == 0
    lines = _lines(out / "results.jsonl")
    keys = [r["key"] for r in lines]
    assert len(keys) == len(set(keys)) == len(serial)
    assert [r["key"] for r in lines[:4]] == [r["key"] for r in first]  # only the missing rows ran
    _assert_same_rows({r["key"]: r for r in lines}, serial)
    assert {(r["protocol"], r["budget_fraction"]) for r in lines} == {
        (p, f) for p in PROTOCOLS.split(",") for f in (None, 0.03, 1.0)}
    run = json.loads((out / "run.json").read_text())
    assert run["ray"]["workers"] == 2 and run["torch"] == first[0]["torch"]  # the workers' environment
    assert main(["report", str(out)]) == 0 and (out / "report.md").is_file()
    assert main(["compare", "--model", tiny_dir, *ARGS, "--out", str(out), "--ray", "--workers", "2"]) == 0
    assert len(_lines(out / "results.jsonl")) == len(serial)
    assert json.loads((out / "run.json").read_text()) == run  # a rerun with nothing to do leaves it as it was


def test_killed_worker_loses_nothing(tiny_dir, idle_ray, serial, tmp_path):
    """SIGKILL a worker once the driver holds some of its sample's rows: the sample runs again (on whichever worker
    is free), its partial rows are dropped, the run completes with every row exactly once."""
    from fxbudget.harness.ray_runner import RayOptions, RayRunner

    grid = Grid(tasks=["passkey"], lengths=[LENGTH], rules=RULES.split(","), budgets=BUDGETS.split(","),
                protocols=PROTOCOLS.split(","), samples=SAMPLES)
    runner = RayRunner(tiny_dir, grid, tmp_path, progress=False, max_new_tokens=NEW, options=RayOptions(workers=2))
    killed, stop = [], threading.Event()

    def kill_one():
        while not stop.is_set():
            for pid, (unit, received) in list(runner.busy.items()):
                if 1 <= received < ROWS_PER_SAMPLE:  # rows arrived, the sample is not complete
                    os.kill(pid, signal.SIGKILL)
                    killed.append((pid, unit))
                    return
            time.sleep(0.002)

    thread = threading.Thread(target=kill_one)
    thread.start()
    try:
        written = runner.run()
    finally:
        stop.set()
        thread.join()
    assert killed, "no worker was killed"
    assert [u for u, _ in runner.retried] == [killed[0][1]]  # that sample, and only it, ran again
    assert runner.discarded_rows >= 1
    assert len({w["pid"] for w in runner.workers}) == 2
    keys = [r["key"] for r in _lines(tmp_path / "results.jsonl")]
    assert len(keys) == len(set(keys)) == len(serial) == len(written)
    _assert_same_rows({r["key"]: r for r in written}, serial)


def test_more_workers_than_the_cluster_has_room_for(tiny_dir, idle_ray, tmp_path):
    from fxbudget.harness.ray_runner import RayOptions, RayRunner

    grid = Grid(tasks=["passkey"], lengths=[LENGTH], rules=["full"], budgets=[64], samples=SAMPLES)
    runner = RayRunner(tiny_dir, grid, tmp_path, progress=False, options=RayOptions(workers=3))
    with pytest.raises(RuntimeError, match="2 CPUs and 0 GPUs free now: room for 2 workers of 1 CPUs and 0 GPUs, 3 "
                                           "asked"):
        runner.run()
    assert not (tmp_path / "results.jsonl").exists()


def test_ray_missing_says_how_to_install(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if Ray were not installed
    assert main(["compare", "--model", tiny_dir, *ARGS, "--out", str(tmp_path / "out"), "--ray"]) == 2
    assert "--ray needs Ray, an optional extra: pip install 'flexbudget[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_worker_options_need_ray(tiny_dir, tmp_path, capsys):
    assert main(["compare", "--model", tiny_dir, *ARGS, "--out", str(tmp_path), "--workers", "2"]) == 2
    assert "need --ray" in capsys.readouterr().err


def test_shared_context_rows_on_ray(tiny_dir, idle_ray, tmp_path):
    """A shared-context protocol writes one row per request: on Ray too, each equal to the serial run's (the driver
    counts a unit's rows per request)."""
    args = ["--tasks", "shared_passkey", "--lengths", "300", "--rules", "full,snapkv", "--budgets", "40",
            "--protocol", "multi-request,multi-turn", "--samples", "2", "--max-new-tokens", "3", "--quiet"]
    assert main(["compare", "--model", tiny_dir, *args, "--out", str(tmp_path / "serial")]) == 0
    assert main(["compare", "--model", tiny_dir, *args, "--out", str(tmp_path / "ray"), "--ray", "--workers", "2"]) == 0
    serial = {r["key"]: r for r in load_rows([tmp_path / "serial"])}
    rows = {r["key"]: r for r in load_rows([tmp_path / "ray"])}
    assert len(serial) == 2 * 2 * 2 * 3  # samples x protocols x (full + snapkv) x requests
    _assert_same_rows(rows, serial)
    assert all(rows[k]["turn"] == serial[k]["turn"] for k in rows)
