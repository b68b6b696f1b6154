"""Properties of a run: one observation window (validated, never mixed, printed), and the report header naming it and
the embedded model's weights."""

import pytest

import fxbudget
from fxbudget import rules
from fxbudget.backend import kernel_window
from fxbudget.harness.report import markdown
from fxbudget.harness.runner import Grid


@pytest.mark.parametrize("rule", ["snapkv", "pyramidkv"])
@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_rule_window_must_be_positive_int(rule, window):
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        rules.get(rule, window=window)


class _UserRule(rules.Rule):
    name = "user_window"

    def __init__(self, window):
        self.window = window

    def score(self, s):
        return s.window_attn


def test_kernel_window_refuses_zero_instead_of_defaulting():
    assert kernel_window(_UserRule(None)) == 32 and kernel_window(_UserRule(5)) == 5
    with pytest.raises(ValueError, match="'user_window': window must be an int >= 1, got 0"):
        kernel_window(_UserRule(0))
    from conftest import tiny_model

    with pytest.raises(ValueError, match="window must be an int >= 1"):
        fxbudget.compile(tiny_model("llama"), rule=_UserRule(0), budget=8, backend=None)


def test_compare_refuses_a_mix_of_windows():
    Grid(rules=["full", "snapkv", "h2o", "pyramidkv"]).validate()  # all at the default window 32
    with pytest.raises(ValueError, match="one observation window.*snapkv 64, h2o 32"):
        Grid(rules=["full", "snapkv", "h2o"], rule_params={"snapkv": {"window": 64}}).validate()


def _row(rule, window, **kw):
    return {"model": "m", "dtype": "float32", "device": "cpu", "torch": "t", "transformers": "tf", "fxbudget": "f",
            "threads": 1, "kernel_fingerprint": "ab" * 32, "protocol": "query-agnostic", "chunk_size": None,
            "backend": "none", "task": "passkey", "n_tokens": 100, "rule": rule, "budget": 8, "score": 1.0,
            "prefill_s": 1.0, "decode_s": 1.0, "output_tokens": 3, "kv_bytes": 1024, "compile_s": 0.0,
            "shared_prefill": False, "branch_s": None, "window": window, "sample": 0, "seed": 0, **kw}


def test_report_header_names_the_window():
    assert "- observation window (" in markdown([_row("snapkv", 32), _row("h2o", 32)], [])
    assert ": 32\n" in markdown([_row("snapkv", 32), _row("h2o", 32)], [])
    assert "**2 different windows (32, 64)**" in markdown([_row("snapkv", 64), _row("h2o", 32)], [])


def test_report_names_the_embedded_weights():
    from fxbudget.models import DEFAULT_MODEL_NAME

    text = markdown([_row("snapkv", 32, model=DEFAULT_MODEL_NAME)], [])
    assert f"- model: {DEFAULT_MODEL_NAME} (Q4_K_M GGUF dequantized to fp32: 4-bit-quantized weights)" in text
    assert "- model: m;" in markdown([_row("snapkv", 32)], [])  # other models are named as given
