"""`finch`: the question's attention on the context (mean over its queries and the KV group); the question kept.

Corallo & Papotti, "FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models", TACL 2024
(doi:10.1162/tacl_a_00716), as kvpress's `FinchPress`: the observation window is the question (kvpress finds it from a
delimiter token placed between context and question), each context token scores the window's attention on it, mean
over the window's queries and the KV group, unpooled; the window is always kept; with `chunk_length`, each chunk of
`chunk_length` positions keeps the same share of the budget (kvpress's chunked mode, `chunk.quota_scores`).

No delimiter: the window is the last `window` tokens of each call (the kernel's observation window, one value per run,
DESIGN §4). In a query-aware run whose question has `window` tokens that is FINCH's window; query-agnostic, or with a
question of another length, it falls back to the context's last `window` tokens (snapkv's window, unpooled): stated
here, not refused, since a rule cannot see which protocol it is in.

Departures: kvpress multiplies each window query's attention by its position (`normalize_scores`, "the number of
non-zero weights") before the mean; the kernel sums the window's attention over its queries (`window_attn`), so every
query weighs the same (kvpress's weights differ by a factor of at most `(L - 1) / (L - window)` in an `L`-token
prompt: a few percent in a long one). kvpress re-rotates the kept keys to contiguous
positions (`rerotate_keys=True`, KeyRerotationPress): the kernel keeps each key at its original position (the kept
set is the same; what re-rotation would need is in docs/rules.md). The delimiter token (which kvpress adds to the
tokenizer and the embeddings, resizing them) is not used. kvpress's chunked mode asserts `chunk_length > window /
(1 - ratio)`; here the window is protected whatever the chunks' shares.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..checks import check_int
from .base import Rule, Signals, recent
from .chunk import quota_scores
from .registry import register


@register("finch")
@dataclass
class Finch(Rule):
    window: int = 32
    chunk_length: int | None = None

    def __post_init__(self):
        check_int("finch window", self.window)
        if self.chunk_length is not None:
            check_int("finch chunk_length", self.chunk_length)

    def score(self, s: Signals) -> Tensor:
        g = s.queries.shape[2] // s.new_pos.shape[-1]
        score = s.window_attn / (s.window * g)  # mean over the window's queries and the group
        return score if self.chunk_length is None else quota_scores(s, score, self.chunk_length)

    def protect(self, s: Signals) -> Tensor:
        return recent(s, s.window)

    def protected_per_head(self, budget: int) -> int:
        return self.window  # the question (the observation window)
