"""Tiny random-weight models of several architectures, and greedy decoding helpers."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import settings
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, \
    Qwen2ForCausalLM

torch.set_num_threads(1)  # on 2 cores, OpenMP spinning makes everything slower

# Property tests draw the same examples on every run and machine (CI included): a fixed derivation per test, no
# example database carried between runs.
settings.register_profile("fxbudget", derandomize=True, database=None, deadline=None)
settings.load_profile("fxbudget")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, attn_implementation="sdpa")


def tiny_model(arch: str = "llama", layers: int = 2, seed: int = 0):
    """A random-weight causal LM in eval mode: llama, qwen2 (GQA 2:1) or gemma3 (sliding + full layers)."""
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **COMMON))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **COMMON))
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
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    cache = out.past_key_values
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def fresh(model):
    return copy.deepcopy(model)
