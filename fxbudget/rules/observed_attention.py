"""`observed_attention`: the mean attention each candidate receives from the queries that can see it.

H2O's prefill form (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, arXiv:2306.14048) as kvpress's `ObservedAttentionPress`: score = the attention mass a
candidate receives from the call's queries, divided by the number of those queries that see it (causally: a token at
index j of an n-token prompt is seen by n - j queries), averaged over the query heads of the KV group (a constant
factor here: the kernel sums over them). Departures: each call is scored by its own queries (kvpress scores the whole
prompt once; with chunked prefill a cached entry is scored by the chunk's queries, all of which see it); nothing is
accumulated across calls (that is `h2o`).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from .registry import register
from .base import Rule, Signals


def seen_by(s: Signals) -> Tensor:
    """For each candidate, how many of the call's valid queries may see it (position >= its own), `[b, h, C]`."""
    b, h, c = s.pos.shape
    qpos = torch.sort(s.new_pos, dim=-1).values  # pads (-1) first: never counted below
    before = torch.searchsorted(qpos.contiguous(), s.pos.reshape(b, h * c).contiguous(), side="left")
    return (qpos.shape[-1] - before).view(b, h, c)


@register("observed_attention")
@dataclass
class ObservedAttention(Rule):
    def score(self, s: Signals) -> Tensor:
        return s.attn / seen_by(s).clamp(min=1).to(s.dtype)
