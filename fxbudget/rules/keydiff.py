"""`keydiff`: keep the keys least similar to the mean key.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference", 2025
(arXiv:2504.15364). score = -cos(k, mean of the valid candidate keys), per KV head (post-RoPE keys, as cached).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import register
from .base import Rule, Signals


@register("keydiff")
@dataclass
class KeyDiff(Rule):
    def score(self, s: Signals) -> Tensor:
        keys = s.keys.float()
        valid = (s.pos >= 0).unsqueeze(-1)
        mean = (keys * valid).sum(dim=2, keepdim=True) / valid.sum(dim=2, keepdim=True).clamp(min=1)
        return -F.cosine_similarity(keys, mean, dim=-1)
