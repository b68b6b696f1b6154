"""A hand-written one-layer model that calls SDPA through a BudgetCache (no transformers model code)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = SimpleNamespace(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                         hidden_size=8)


@dataclass
class Output:
    logits: torch.Tensor
    past_key_values: object


class OneLayer(nn.Module):
    """Embedding, one GQA attention layer (2 query heads, 1 KV head), output head. `cross=True` adds an SDPA over
    a fixed memory that no cache feeds (it must be left alone). `sdpa(q, k, v)` replaces the plain SDPA call (e.g. to
    pass a mask or a scale)."""

    def __init__(self, vocab: int = 16, cross: bool = False, use_sdpa: bool = True, sdpa=None):
        super().__init__()
        torch.manual_seed(0)
        self.config = None  # a plain module: fxbudget.compile skips the HF config checks
        self.emb = nn.Embedding(vocab, 8)
        self.q, self.k, self.v = nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
        self.out = nn.Linear(8, vocab, bias=False)
        self.memory = nn.Parameter(torch.randn(1, 2, 3, 4)) if cross else None
        self.use_sdpa = use_sdpa
        self.sdpa = sdpa or F.scaled_dot_product_attention

    def forward(self, input_ids, past_key_values=None, use_cache=True, **kwargs):
        x = self.emb(input_ids)
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 2, 4).transpose(1, 2)
        k = self.k(x).view(b, n, 1, 4).transpose(1, 2)
        v = self.v(x).view(b, n, 1, 4).transpose(1, 2)
        k, v = past_key_values.update(k, v, 0)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        if self.use_sdpa:
            y = self.sdpa(q, k, v)
        else:  # attention written by hand: nothing for fxbudget to rewrite
            y = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        if self.memory is not None:
            y = y + F.scaled_dot_product_attention(q, self.memory, self.memory)
        return Output(self.out(y.transpose(1, 2).reshape(b, n, 8)), past_key_values)
