"""Tiny random-weight models of several architectures, and greedy decoding helpers."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from hypothesis import settings
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, \
    MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fxbudget.cache_arg import cache_kwargs, output_cache

torch.set_num_threads(1)  # on 2 cores, OpenMP spinning makes everything slower

# Property tests draw the same examples on every run and machine (CI included): a fixed derivation per test, no
# example database carried between runs.
settings.register_profile("fxbudget", derandomize=True, database=None, deadline=None)
settings.load_profile("fxbudget")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, attn_implementation="sdpa")


def tiny_model(arch: str = "llama", layers: int = 2, seed: int = 0):
    """A random-weight causal LM in eval mode: llama, mistral, qwen2, qwen3, phi3 (GQA 2:1; phi3 fused QKV) or gemma3
    (sliding + full layers)."""
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **COMMON))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **COMMON))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=layers, **COMMON))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, head_dim=16, **COMMON))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(num_hidden_layers=layers, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                           **COMMON))
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(num_hidden_layers=max(layers, 3), head_dim=16, sliding_window=8,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"][:max(layers, 3)],
                               query_pre_attn_scalar=16, **COMMON)
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


def greedy(model, ids: torch.Tensor, steps: int, cache=None):
    """Prefill `ids` then `steps` greedy decode steps; returns (logits of every step `[steps + 1, batch, vocab]`, cache)."""
    # The cache keyword the model declares (`cache` from transformers 5.24, `past_key_values` before).
    out = model(input_ids=ids, use_cache=True, **cache_kwargs(model.forward, cache))
    cache = output_cache(out)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=tok, use_cache=True, **cache_kwargs(model.forward, cache))
        logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def fresh(model):
    return copy.deepcopy(model)


@contextlib.contextmanager
def registry_restored():
    """The rule registry (and the rule files `load_file` registered) as it was on entry, again on exit."""
    from fxbudget.rules import _LOADED, _REGISTRY

    before, loaded = dict(_REGISTRY), dict(_LOADED)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(before)
        _LOADED.clear()
        _LOADED.update(loaded)


@pytest.fixture(autouse=True)
def _registry_restored():
    """Rules a test registers stay in that test: the registry is process-wide, and with pytest-xdist a later test in
    the same worker (e.g. cross_device's "every registered rule") would otherwise see them."""
    with registry_restored():
        yield


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Qwen2 with the embedded model's tokenizer, saved as a local model directory (prompts are
    tokenized as on the real model)."""
    from transformers import AutoTokenizer

    from fxbudget.models import default_cache_dir, load_default

    path = default_cache_dir()
    if not (path / "tokenizer_config.json").is_file():
        load_default(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=8192, tie_word_embeddings=True))
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
