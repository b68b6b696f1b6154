"""`Chunk`: any rule's scores spent chunk by chunk: every chunk of `chunk_length` positions keeps the same share.

kvpress's `ChunkPress(press, chunk_length=1024)` (from FINCH: Corallo & Papotti, "FINCH: Prompt-guided Key-Value Cache
Compression for Large Language Models", TACL 2024, doi:10.1162/tacl_a_00716): the sequence is cut into chunks of
`chunk_length` positions (`[0, c)`, `[c, 2c)`, ...) and each keeps its top `max(1, int(len x (1 - ratio)))` by the
wrapped press's score, independently, so no region of the context is emptied by a region that scores higher.

Here (`quota_scores`): each candidate's score becomes its chunk quantile, `-(r + 1/2) / n` with `r` its rank from the
top within its chunk and `n` the chunk's candidates, so the kernel's one top-`budget` keeps about `budget / N` of every
chunk (`N` candidates in all); the wrapped rule's protected tokens stay protected. Departures: the budget is filled
exactly (kvpress's per-chunk `int` floors keep up to a token per chunk fewer; here the tokens the floors leave go to the
newer chunks, the kernel's tie-break); kvpress scores each chunk by the press run on that chunk alone (its own
hidden states, keys and values: a window-based press sees the chunk's tail as its window), here the wrapped rule
scores the whole call once and only the selection is per chunk (the same kept sets for a per-token score; for a
window-attention rule they differ widely: benchmarks/results/vs_kvpress_presses.md); with chunked prefill (or
decode) a chunk holds what is still cached, so its share is of the candidates of the call. A Python wrapper like
`Pyramid`, not a name prefix: a prefix would add every rule's chunked form to the combination matrix (6 cells each).
Wrapping a rule that never evicts (`full`), a head-adaptive one (`adakv:`, whose spread over heads a per-head quota
would undo) or a replay-only one (`kvzip`, which cuts its cache once in its own protocol) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..checks import check_int
from .base import Rule, Signals
from .segments import Segments
from .snapkv import SnapKV
from .wrapper import Wrapper


def quota_scores(s: Signals, score: Tensor, chunk_length: int) -> Tensor:
    """`score` (`[b, h, C]`, higher = keep) replaced by each candidate's quantile within its chunk of `chunk_length`
    positions, `-(r + 1/2) / n` (rank `r` from the top, `n` candidates in the chunk): a top-k over the result takes the
    same share of every chunk. Empty slots get -inf (the kernel ignores them anyway)."""
    valid = s.pos >= 0
    seg = Segments(s, torch.where(valid, s.pos // chunk_length, -1))
    x = s.in_sequence_order(torch.where(valid, score, float("-inf")))
    up = seg.rank(x)  # 0 = lowest
    n = seg.spread(seg.count)
    quantile = -((n - 1 - up) + 0.5) / n
    out = s.from_sequence_order(quantile.to(score.dtype))
    return torch.where(valid, out, float("-inf"))


@dataclass
class Chunk(Wrapper):
    """Any rule's scores, selected chunk by chunk (`chunk_length` positions each keep the same share)."""

    rule: Rule = field(default_factory=SnapKV)
    chunk_length: int = 1024

    def __post_init__(self):
        self._check_wrapped()
        self.name = f"chunk({self.rule.name or type(self.rule).__name__})"
        check_int(f"{self.name} chunk_length", self.chunk_length)
        why = ("it never evicts" if self.rule.never_evicts else
               "it spreads the budget over heads, which a per-head chunk quota would undo" if self.rule.head_adaptive
               else "it evicts only once, in its own replay protocol" if self.rule.replay_only else None)
        if why:
            raise ValueError(f"rule {self.name!r}: Chunk cannot wrap {self.rule.name!r}: {why}")

    def score(self, s: Signals) -> Tensor:
        return quota_scores(s, self.rule.score(s), self.chunk_length)

    def params(self) -> dict:
        return {"chunk_length": self.chunk_length, **self.rule.params()}
