"""`random`: uniform random scores, reproducible for a seed (a floor every rule should beat).

score = an integer hash of (position, KV head, seed) in [0, 2^24) (xorshift-multiply rounds modulo 2^31): a pure
function of the signals, so the eager and compiled paths keep the same tokens, reruns are identical, and another seed
gives another draw. Products stay below 2^62, so no backend sees an overflow.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from . import register
from .base import Rule, Signals

_M, _A = 2**31, 739982445  # modulus and an odd multiplier below 2^30


@register("random")
@dataclass
class Random(Rule):
    seed: int = 0

    def score(self, s: Signals) -> Tensor:
        head = torch.arange(s.pos.shape[1], device=s.pos.device).view(1, -1, 1)
        x = (s.pos + 1 + head * 1000003 + (self.seed % _M) * 7919) % _M
        for _ in range(3):  # xorshift-multiply mixing: nearby positions get unrelated scores
            x = x ^ (x >> 15)
            x = (x * _A) % _M
            x = x ^ (x >> 12)
        return (x >> 7).float()  # the top 24 bits: exact in float32, so no two values merge
