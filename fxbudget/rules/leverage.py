"""`leverage`: approximate statistical leverage of the pre-RoPE keys (Compactor's geometric score).

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores", 2025
(arXiv:2507.08143), as kvpress's `LeverageScorePress`: per batch row and KV head, the pre-RoPE keys `K` (the cached
keys rotated back with the layer's RoPE frequencies: kvpress projects the hidden states through `k_proj`, which
is the same vector) are centred over the candidates and sketched on the right, `X = (K - mean) Phi` with
`Phi` `[head_dim, sketch_dimension]` Gaussian / sqrt(sketch_dimension); the score is the leverage
`x_i^T (X^T X + 1e-2 I)^-1 x_i` (a Cholesky solve, clamped at 0), z-scored over the layer's KV heads (mean and
unbiased std over all of them, std floored at 1e-6). Departures: `Phi` is a fixed pseudo-random Gaussian from a hash
of `seed`, the KV head and the indices (the same in every layer and call), where kvpress draws a new unseeded
`torch.randn` per call (with `sketch_dimension >= head_dim` the leverage does not depend on the sketch); the
Cholesky factorization keeps kvpress's first jitter (1e-2) and does not retry with more (a failed factorization
gives NaN scores, which rank lowest); the z-score is per batch row (kvpress: over the batch); with chunked prefill
or decode the statistics are over the call's candidates. Needs the model's RoPE frequencies (`fxbudget.cache.rope`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals
from .random import gaussian_sketch


def leverage_scores(keys: Tensor, use: Tensor, sketch_dimension: int, seed: int) -> Tensor:
    """kvpress's `LeverageScorePress.compute_leverage_scores` over the candidates in `use`, `[b, h, C]` (0 elsewhere).

    Args:
        keys: pre-RoPE keys `[b, h, C, d]` (float). use: `[b, h, C]` bool, the rows that take part.
        sketch_dimension, seed: the Gaussian sketch's width and seed.
    """
    b, h, _, d = keys.shape
    w = use.unsqueeze(-1).to(keys.dtype)
    mean = (keys * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp(min=1)
    phi = gaussian_sketch(h * d, sketch_dimension, seed, keys.device, keys.dtype).view(1, h, d, sketch_dimension)
    x = ((keys - mean) * w) @ (phi / math.sqrt(sketch_dimension))
    xt = x.transpose(-2, -1)
    gram = xt @ x
    eye = torch.eye(sketch_dimension, device=keys.device, dtype=keys.dtype)
    chol, _ = torch.linalg.cholesky_ex(0.5 * (gram + gram.transpose(-2, -1)) + 1e-2 * eye)
    solved = torch.cholesky_solve(xt, chol)
    return torch.where(use, (x * solved.transpose(-2, -1)).sum(-1).clamp_min(0), 0.0)


def layer_zscore(x: Tensor, use: Tensor) -> Tensor:
    """`(x - mean) / std` over the `use` entries of all KV heads of each batch row (unbiased std, floored at 1e-6)."""
    w = use.to(x.dtype)
    n = w.sum(dim=(1, 2), keepdim=True)
    mean = (x * w).sum(dim=(1, 2), keepdim=True) / n.clamp(min=1)
    var = ((x - mean).square() * w).sum(dim=(1, 2), keepdim=True) / (n - 1).clamp(min=1)
    return (x - mean) / var.sqrt().clamp_min(1e-6)


@register("leverage")
@dataclass
class Leverage(Rule):
    sketch_dimension: int = 48
    seed: int = 0
    needs_rope: ClassVar[bool] = True

    def __post_init__(self):
        check_int("leverage sketch_dimension", self.sketch_dimension)
        check_int("leverage seed", self.seed, 0)

    def score(self, s: Signals) -> Tensor:
        valid = s.pos >= 0
        return layer_zscore(leverage_scores(s.prerope_keys(), valid, self.sketch_dimension, self.seed), valid)
