"""`--dtype auto` (bfloat16 on a GPU or a CPU with native bf16, float32 otherwise), why the dtype was chosen, and the
warning for bfloat16 on a CPU without native bf16 (a measured cost, not a refusal); `--model` naming an embedded model
whose extra is not installed (one line with the pip command)."""

import pytest
import torch

from fxbudget.models import cpu_bf16, devices
from fxbudget.cli import main
from fxbudget.models.embedded import EMBEDDED, GEMMA3_270M, by_name

from conftest import fails_in_one_line

NO_BF16 = {"fpu", "avx", "avx2", "fma"}
BF16 = NO_BF16 | {"avx512f", "avx512_bf16"}


def test_native_bf16_is_read_from_the_cpu_flags():
    assert cpu_bf16.native_bf16(NO_BF16) == (False, "the CPU has no native bf16 (no avx512_bf16, amx_bf16 or bf16 "
                                                    "flag)")
    assert cpu_bf16.native_bf16(BF16)[0] and "avx512_bf16" in cpu_bf16.native_bf16(BF16)[1]
    assert cpu_bf16.native_bf16({"amx_bf16"})[0]
    assert cpu_bf16.native_bf16(set(cpu_bf16.cpu_flags() or ())) == cpu_bf16.native_bf16()


@pytest.mark.parametrize("flags, dtype, want", [
    (NO_BF16, "auto", "float32"), (BF16, "auto", "bfloat16"), (NO_BF16, None, "float32"), (BF16, None, "float32"),
    (BF16, "bfloat16", "bfloat16"), (NO_BF16, "float32", "float32"),
])
def test_auto_and_the_cpu_default(monkeypatch, flags, dtype, want):
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_bf16, "matmul_slowdown", lambda: pytest.fail("measured without need"))
    place = devices.resolve("cpu", dtype)
    assert place.dtype == want and place.why and not place.warning
    if dtype is None and flags is BF16:
        assert "--dtype auto would run bfloat16" in place.why  # the CPU default says what auto would pick


def test_bfloat16_without_native_bf16_warns_with_the_measured_cost(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: NO_BF16)
    monkeypatch.setattr(cpu_bf16, "matmul_slowdown", lambda: 3.04)
    place = devices.resolve("cpu", "bfloat16")
    assert place == devices.Placement("cpu", "bfloat16")  # not refused
    assert place.warning.startswith("--dtype bfloat16 on a CPU without native bf16: a 256x896x896 matmul took 3.0x")
    assert "\n" not in place.warning


def test_matmul_slowdown_is_measured():
    ratio = cpu_bf16.matmul_slowdown(m=8, k=16, n=16, repeats=2)
    assert ratio > 0


def test_auto_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices.resolve("cuda", "auto") == devices.Placement("cuda:0", "bfloat16")


def test_dry_run_start_line_says_the_dtype_and_why(tiny_dir, tmp_path, capsys, no_model_load, monkeypatch):
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: NO_BF16)
    monkeypatch.setattr(cpu_bf16, "matmul_slowdown", lambda: 2.5)
    argv = ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--samples", "1", "--rules",
            "full,snapkv", "--budgets", "64", "--out", str(tmp_path / "o"), "--quiet", "--dry-run"]
    assert main([*argv, "--dtype", "auto"]) == 0
    err = capsys.readouterr().err
    assert "(float32 on cpu [dtype: --dtype auto; the CPU has no native bf16" in err
    assert "a budget applies to all 2 layers (full attention)" in err
    assert main([*argv, "--dtype", "bf16"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: --dtype bfloat16 on a CPU without native bf16: a 256x896x896 matmul took 2.5x") == 1


def test_embedded_model_without_its_extra_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fxbudget.models.embedded_available", lambda entry: False)
    fails_in_one_line(capsys, ["compare", "--model", "gemma3-270m", "--out", str(tmp_path / "o"), "--dry-run"],
                      r"^fxbudget compare: --model gemma3-270m: the embedded gemma-3-270m is not installed; "
                      r"install it with: pip install 'flexbudget\[gemma\]'$")


def test_the_table_of_embedded_models():
    assert set(EMBEDDED) == {"qwen2.5-coder-0.5b", "gemma3-270m"}
    assert by_name("gemma-3-270m") is GEMMA3_270M and by_name("gemma3-270m") is GEMMA3_270M
    assert not GEMMA3_270M.chat and EMBEDDED["qwen2.5-coder-0.5b"].chat
    for m in EMBEDDED.values():
        assert len(m.sha256) == 64 and m.size > 0 and len(set(m.packages)) == len(m.chunks)
