"""Processes that start together (test workers, Ray workers) convert an embedded model once: the second waits for the
first and reads its result, instead of converting beside it (~90 s of CPU each)."""

import threading
import time

import pytest

from fxbudget.models import load
from fxbudget.models.embedded import DEFAULT

pytest.importorskip("fcntl")


def test_a_second_conversion_waits_and_reuses_the_first(tmp_path, monkeypatch, capsys):
    target = tmp_path / DEFAULT.cache_subdir
    started, runs = threading.Event(), []

    def convert(path, progress, model):  # the real one takes ~90 s; its result is config.json in the target
        runs.append(path)
        started.set()
        time.sleep(0.5)
        path.mkdir()
        (path / "config.json").write_text("{}")

    monkeypatch.setattr(load, "_convert_unlocked", convert)
    first = threading.Thread(target=load._convert, args=(target, True, DEFAULT))
    first.start()
    assert started.wait(10)
    load._convert(target, True, DEFAULT)  # the lock is held: waits, then finds the checkpoint there
    first.join()
    assert runs == [target]
    assert f"waiting for another process converting {DEFAULT.name}" in capsys.readouterr().err
    load._convert(target, True, DEFAULT)  # and a later call takes the lock at once
    assert runs == [target]
