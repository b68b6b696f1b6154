"""`streamingllm`: attention sinks plus the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv:2309.17453).
Keeps the first `n_sink` positions and fills the rest of the budget with the most recent tokens:
score = position, sinks protected. Same kept set as the paper's cache; positions are not re-indexed
(keys are cached after RoPE with their original positions, as in most reproductions).
"""

from dataclasses import dataclass

from torch import Tensor

from .registry import register
from .base import Rule, Signals


@register("streamingllm")
@dataclass
class StreamingLLM(Rule):
    n_sink: int = 4

    def score(self, s: Signals) -> Tensor:
        return s.pos.float()

    def protect(self, s: Signals) -> Tensor:
        return (s.pos >= 0) & (s.pos < self.n_sink)

    def protected_per_head(self, budget: int) -> int:
        return self.n_sink  # the sinks
