"""`compactor`: leverage of the pre-RoPE keys blended with non-causal chunked attention (Compactor).

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores", 2025
(arXiv:2507.08143), as kvpress's `CompactorPress` (`LeverageScorePress` + `NonCausalAttnPress`). The first
`sink_size_start` and last `sink_size_end` positions are kept; over the rest (the middle, in position order): -
`leverage`'s z-scored leverage (`fxbudget.rules.leverage`), centred and sketched over the middle only; - non-causal
chunked attention: the middle is tiled into chunks of `chunk_size`, each query attends to every key of its chunk with
unscaled logits `q . k` (softmax in fp32), and a key's score is the attention it receives, averaged over the KV group,
times `|v|`, average-pooled over 3 neighbours, z-scored over the layer. As kvpress, the last chunk is padded with zero
queries and keys, padded keys at logit -1e-9 (so they take a share of the softmax) and padded query rows attend
uniformly; score = `blending` x leverage + attention, `blending = compression ratio` when None (kvpress's default;
fxbudget's ratio is `1 - budget / positions seen`). Departures: the sketch is `leverage`'s fixed one; a cached entry
(chunked prefill, decode) has no query in the call and attends with a zero query, like kvpress's padding; statistics are
per batch row; kvpress supports prefill only. Needs the model's RoPE frequencies (`fxbudget.cache.rope`: default,
llama3, YaRN, linear). `chunk_size` is kvpress's name; `fxbudget.compile`'s own `chunk_size` is the prefill's, so set
this one on an instance: `rule=rules.get("compactor", chunk_size=128)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals
from .leverage import layer_zscore, leverage_scores


def noncausal_chunked_attention(s: Signals, mid: Tensor, chunk: int) -> Tensor:
    """kvpress's `NonCausalAttnPress` attention term over the `mid` candidates (sequence order), `[b, h, C]`."""
    b, h, c = s.pos.shape
    n = s.new_pos.shape[-1]
    g = s.queries.shape[2] // n
    d = s.queries.shape[-1]
    dt = s.dtype
    S = c - n
    # Every candidate's queries [b, h, g, C, d]: the call's tokens have theirs, cached entries a zero query.
    q = torch.cat([s.queries.new_zeros(b, h, g, S, d), s.queries.view(b, h, g, n, d)], dim=3).to(dt)
    first = (s.pos < _start(s, mid)).sum(-1, keepdim=True)  # candidates before the middle (empty slots, sinks)
    count = mid.sum(-1, keepdim=True)
    tiles = -(-c // chunk)
    place = torch.arange(tiles * chunk, device=s.pos.device).expand(b, h, -1)
    real = place < count  # [b, h, T * chunk]
    src = s.order.gather(-1, (first + place).clamp(max=c - 1))  # candidate index of each place
    keys = s.keys.to(dt).gather(2, src.unsqueeze(-1).expand(b, h, -1, d)) * real.unsqueeze(-1)
    qs = q.gather(3, src.view(b, h, 1, -1, 1).expand(b, h, g, -1, d)) * real.view(b, h, 1, -1, 1)
    dots = qs.view(b, h, g, tiles, chunk, d) @ keys.view(b, h, 1, tiles, chunk, d).transpose(-1, -2)
    pad_q = ~real.view(b, h, 1, tiles, chunk, 1)
    pad_k = ~real.view(b, h, 1, tiles, 1, chunk)
    dots = dots.masked_fill(pad_q, 0.0).masked_fill(pad_k, -1e-9)
    att = torch.softmax(dots, dim=-1).sum(dim=-2).mean(dim=2).reshape(b, h, -1)  # [b, h, T * chunk]
    vnorm = s.value_norm.gather(-1, src)
    x = torch.where(real, att * vnorm, 0.0)
    x = F.avg_pool1d(x.reshape(b * h, 1, -1), 3, stride=1, padding=1).view(b, h, -1)
    out = torch.zeros(b, h, c, dtype=dt, device=x.device).scatter_add(-1, torch.where(real, src, 0),
                                                                     torch.where(real, x, 0.0))
    return out


def _start(s: Signals, mid: Tensor) -> Tensor:
    """The first middle position of each row and head (a large value where there is none)."""
    return torch.where(mid, s.pos, s.pos.new_full((), 2**62)).amin(-1, keepdim=True)


@register("compactor")
@dataclass
class Compactor(Rule):
    sink_size_start: int = 8
    sink_size_end: int = 4
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: float | None = None
    seed: int = 0
    needs_rope: ClassVar[bool] = True

    def __post_init__(self):
        check_int("compactor sink_size_start", self.sink_size_start, 0)
        check_int("compactor sink_size_end", self.sink_size_end, 0)
        check_int("compactor chunk_size", self.chunk_size)
        check_int("compactor sketch_dimension", self.sketch_dimension)
        check_int("compactor seed", self.seed, 0)
        if self.blending is not None and (isinstance(self.blending, bool)
                                          or not isinstance(self.blending, (int, float)) or self.blending < 0):
            raise ValueError(f"compactor blending must be None or a float >= 0, got {self.blending!r}")

    def _ends(self, s: Signals) -> Tensor:
        return (s.pos >= 0) & ((s.pos < self.sink_size_start) | (s.pos >= s.step - self.sink_size_end))

    def score(self, s: Signals) -> Tensor:
        mid = (s.pos >= 0) & ~self._ends(s)
        lev = layer_zscore(leverage_scores(s.prerope_keys(), mid, self.sketch_dimension, self.seed), mid)
        att = layer_zscore(noncausal_chunked_attention(s, mid, self.chunk_size), mid)
        if self.blending is None:
            blend = (1 - s.budget / s.step.to(s.dtype)).clamp(min=0)
        else:
            blend = torch.tensor(float(self.blending), dtype=s.dtype, device=s.pos.device)
        return torch.where(mid, blend * lev + att, 0.0)

    def protect(self, s: Signals) -> Tensor:
        return self._ends(s)

    def protected_per_head(self, budget: int) -> int:
        return self.sink_size_start + self.sink_size_end  # both ends
