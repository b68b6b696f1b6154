"""`fxbudget compare --dry-run` (issue 32: the leaderboard script's commands checked on a machine without a GPU):
every option checked, the samples built and the plan printed, then exit 0 with no model loaded and no results
folder; the device is checked by name only, and a folder with rows in it is left exactly as it was."""

from argparse import Namespace

import pytest

from fxbudget.models import devices
from fxbudget.cli import main
from fxbudget.cli.preflight import UsageError, placement

from conftest import fails_in_one_line


def test_dry_run_plans_a_gpu_grid_without_loading_or_writing(tiny_dir, tmp_path, capsys, no_model_load, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU here, as on the CPU machines
    out = tmp_path / "out"
    argv = ["compare", "--model", tiny_dir, "--tasks", "ruler:vt,ruler:fwe", "--lengths", "1024", "--samples", "2",
            "--rules", "full,snapkv,adakv:snapkv", "--budgets", "75%,12.5%", "--param", "snapkv.window=64",
            "--param", "adakv:snapkv.window=64",
            "--protocol", "query-agnostic,query-aware", "--device", "cuda", "--dtype", "bf16", "--out", str(out),
            "--quiet", "--dry-run"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    # 4 samples; per sample and protocol: full once + 2 budgeted rules x 2 budgets = 5 rows; 2 protocols -> 10.
    assert "--dry-run: 40 rows on 4 samples planned (bfloat16 on cuda" in err
    assert "40 rows on 4 samples:" in err and "no time estimate on cuda" in err
    assert not out.exists()


def test_dry_run_still_refuses_bad_input(tiny_dir, tmp_path, capsys, no_model_load):
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--tasks", "ruler:vt", "--lengths", "300",
                               "--device", "cuda", "--out", str(tmp_path / "o"), "--dry-run"],
                      r"ruler:vt at 300 tokens: too short for ruler:vt: .* give at least \d+")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--device", "tpu", "--out", str(tmp_path / "o"),
                               "--dry-run"], r"--device tpu: unknown device")
    assert not (tmp_path / "o").exists()


def test_dry_run_counts_what_a_resumed_folder_still_needs(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    small = ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--rules", "full,snapkv",
             "--budgets", "32", "--max-new-tokens", "2", "--quiet", "--device", "cpu", "--out", str(out)]
    assert main(small + ["--samples", "1"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    assert main(small + ["--samples", "3", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "resuming: 2 of 6 rows done" in err and "--dry-run: 4 rows on 2 samples planned" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_names_only_placement():
    assert placement(Namespace(device="cuda:3", dtype=None), names_only=True) == devices.Placement("cuda:3",
                                                                                                     "bfloat16")
    assert placement(Namespace(device=None, dtype=None), names_only=True) == devices.Placement("cpu", "float32")
    assert placement(Namespace(device="cuda", dtype="fp16"), names_only=True) == devices.Placement("cuda",
                                                                                                   "float16")
    with pytest.raises(UsageError, match="unknown dtype"):
        placement(Namespace(device="cuda", dtype="float64"), names_only=True)
