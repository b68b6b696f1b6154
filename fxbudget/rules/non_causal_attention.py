"""`non_causal_attention`: the attention a key gets from every query of its chunk (before and after it) x its |v|.

kvpress's `NonCausalAttnPress` (Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores", 2025, arXiv:2507.08143: Compactor's attention term alone). The candidates, in position
order, are tiled into chunks of `chunk_size`; each query attends to every key of its chunk with unscaled logits
`q . k` (softmax in fp32, the last chunk padded as kvpress pads it); a key scores the attention it receives, averaged
over the KV group, times `|v|`, average-pooled over 3 neighbours, z-scored over the layer's KV heads
(`compactor.noncausal_chunked_attention`, shared with `compactor`). Departures: a cached entry (chunked prefill,
decode) has no query in the call and attends with a zero query, like kvpress's padding (kvpress supports prefill
only); the z-score is per batch row (kvpress: over the batch). No sinks, as kvpress's press.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..checks import check_int
from .base import Rule, Signals
from .compactor import noncausal_chunked_attention
from .leverage import layer_zscore
from .registry import register


@register("non_causal_attention")
@dataclass
class NonCausalAttention(Rule):
    chunk_size: int = 256

    def __post_init__(self):
        check_int("non_causal_attention chunk_size", self.chunk_size)

    def score(self, s: Signals) -> Tensor:
        valid = s.pos >= 0
        return layer_zscore(noncausal_chunked_attention(s, valid, self.chunk_size), valid)
