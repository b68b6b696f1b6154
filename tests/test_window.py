"""Properties of a run: one observation window (validated, never mixed, printed), and the report header naming it and
the embedded model's weights; and the models' own sliding windows (model-wide, per layer type, Qwen2's
use_sliding_window), reproduced exactly."""

import pytest
import torch

import fxbudget
from fxbudget import rules
from fxbudget.compiler.backend import kernel_window
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


# Sliding windows as transformers' mask code applies them (issue 20, item 2): a model-wide `sliding_window` with no
# `layer_types` (Mistral v0.1, Phi-3, Starcoder2) slides every layer; Qwen2's use_sliding_window/max_window_layers
# slide the layers from max_window_layers on. Windows shorter than the prompt, so a dropped or off-by-one window shows.

def _windowed(arch: str, window: int, **extra):
    from transformers import MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM, Starcoder2Config, Starcoder2ForCausalLM

    from conftest import COMMON

    torch.manual_seed(0)
    cls, cfg = {"mistral": (MistralForCausalLM, MistralConfig), "phi3": (Phi3ForCausalLM, Phi3Config),
                "starcoder2": (Starcoder2ForCausalLM, Starcoder2Config), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[arch]
    kw = dict(COMMON, num_hidden_layers=2, sliding_window=window, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              **extra)
    return cls(cfg(**kw)).eval()


WINDOWED = [("mistral", 6, {}), ("phi3", 7, {}), ("starcoder2", 5, {}),
            ("qwen2", 6, {"use_sliding_window": True, "max_window_layers": 1})]


@pytest.mark.newest
@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("arch, window, extra", WINDOWED, ids=[a for a, _, _ in WINDOWED])
def test_model_wide_sliding_window_reproduces_the_model(arch, window, extra, backend):
    """37 tokens, a covering budget: the unmodified model's logits over prefill + 20 greedy steps (today's main ran
    these windows as full attention: max logit difference 0.79 for Mistral, 0.75 for Phi-3)."""
    from conftest import fresh, greedy

    model = _windowed(arch, window, **extra)
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (1, 37))
    with torch.no_grad():
        ref, _ = greedy(model, ids, 20)
        got, cache = greedy(fxbudget.compile(fresh(model), rule="snapkv", budget=64, backend=backend), ids, 20)
    assert (got - ref).abs().max().item() <= 1e-4
    expect = [0, window] if arch == "qwen2" else [window, window]
    assert [layer.sliding for layer in cache.layers] == expect
    for i, layer in enumerate(cache.layers):  # a sliding layer holds the last `window` positions of every head
        held = cache.positions(i)[0]
        want = torch.arange(57 - layer.sliding, 57) if layer.sliding else torch.arange(57)
        assert all(torch.equal(h[h >= 0].sort().values, want) for h in held), f"layer {i}"


def test_layer_windows_follow_the_mask_code():
    """Which layers slide, read as each model's own mask code decides it."""
    from transformers import MistralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig

    from fxbudget.models.layer_config import layer_windows

    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=4096)) == (4096,) * 3
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=None)) == (0,) * 3
    # Mistral's modeling code slides every layer under a sliding_window whatever layer_types says
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=9,
                                       layer_types=["full_attention", "sliding_attention"])) == (9, 9)
    assert layer_windows(Qwen2Config(num_hidden_layers=4, sliding_window=32)) == (0,) * 4  # use_sliding_window off
    assert layer_windows(Qwen2Config(num_hidden_layers=4, sliding_window=32, use_sliding_window=True,
                                     max_window_layers=2)) == (0, 0, 32, 32)
    assert layer_windows(Qwen2MoeConfig(num_hidden_layers=4, sliding_window=32, use_sliding_window=True,
                                        max_window_layers=3)) == (32, 0, 32, 0)
    assert layer_windows(Qwen3MoeConfig(num_hidden_layers=2, sliding_window=16, use_sliding_window=True)) == (16, 16)
    assert layer_windows(Qwen3MoeConfig(num_hidden_layers=2, sliding_window=16)) == (0, 0)
