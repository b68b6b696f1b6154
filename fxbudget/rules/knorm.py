"""`knorm`: keep the keys with the lowest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
(arXiv:2406.11430). score = -||k|| (post-RoPE key, as cached; RoPE preserves the norm).
"""

from dataclasses import dataclass

from torch import Tensor

from .registry import register
from .base import Rule, Signals


@register("knorm")
@dataclass
class KNorm(Rule):
    def score(self, s: Signals) -> Tensor:
        return -s.key_norm
