"""`keydiff`: keep the keys least similar to the mean normalized key.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference", 2025
(arXiv:2504.15364); kvpress's `KeyDiffPress`. score = -cos(k, anchor), anchor = the mean of the L2-normalized
valid candidate keys, per batch row and KV head (post-RoPE keys, as cached and as kvpress scores them).
Departures: with chunked prefill or decode the anchor is the mean over the call's candidates (the cached entries and
the new tokens), where kvpress scores the whole prompt once; the paper's block-wise iteration is kvpress's
`BlockPress(KeyDiffPress)`, which is fxbudget's chunked prefill with this rule.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .registry import register
from .base import Rule, Signals


@register("keydiff")
@dataclass
class KeyDiff(Rule):
    def score(self, s: Signals) -> Tensor:
        keys = s.keys.to(torch.promote_types(s.k_slots.dtype, torch.float32))
        valid = (s.pos >= 0).unsqueeze(-1)
        unit = F.normalize(keys, p=2, dim=-1) * valid
        anchor = unit.sum(dim=2, keepdim=True) / valid.sum(dim=2, keepdim=True).clamp(min=1)
        return -F.cosine_similarity(keys, anchor, dim=-1)
