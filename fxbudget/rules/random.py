"""`random`: uniform random scores, reproducible for a seed (a floor every rule should beat).

score = an integer hash of (position, KV head, seed) in [0, 2^24) (xorshift-multiply rounds modulo 2^31): a pure
function of the signals, so the eager and compiled paths keep the same tokens, reruns are identical, and another seed
gives another draw. Products stay below 2^62, so no backend sees an overflow.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .registry import register
from .base import Rule, Signals

_M, _A = 2**31, 739982445  # modulus and an odd multiplier below 2^30


@register("random")
@dataclass
class Random(Rule):
    seed: int = 0

    def score(self, s: Signals) -> Tensor:
        head = torch.arange(s.pos.shape[1], device=s.pos.device).view(1, -1, 1)
        # xorshift-multiply mixing: nearby positions get unrelated scores; the top 24 bits are exact in float32.
        return _hash24(s.pos + 1 + head * 1000003 + (self.seed % _M) * 7919).float()


def _hash24(x: Tensor) -> Tensor:
    """The rule's xorshift-multiply mixing of non-negative int64 `x` (< 2^31): 24 well-mixed bits."""
    x = x % _M
    for _ in range(3):
        x = x ^ (x >> 15)
        x = (x * _A) % _M
        x = x ^ (x >> 12)
    return x >> 7


def gaussian_sketch(rows: int, cols: int, seed: int, device, dtype: torch.dtype) -> Tensor:
    """A fixed pseudo-random standard-normal matrix `[rows, cols]` (Box-Muller on hashed indices): the same for a
    seed on every device and call, so rules that sketch (`leverage`, `compactor`, `cur`) stay pure functions."""
    i = torch.arange(rows * cols, device=device) * 2 + 1 + (seed % _M) * 7919
    u1, u2 = ((_hash24(i + k).to(torch.float64) + 0.5) / 2**24 for k in (0, 1))
    z = torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)
    return z.to(dtype).view(rows, cols)
