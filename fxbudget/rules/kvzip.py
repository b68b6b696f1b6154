"""`kvzip`: each cached context token scored by its largest attention from a replay of the context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025 (arXiv:2505.23416), as
kvpress 0.5.5's `KVzipPress` (n_sink 4, chunk_size 2048, KVzip+ normalization off): the context is prefilled in
full; the model then reads "\\n\\nRepeat the previous context exactly." and the chat template's assistant header,
followed by the context itself (the replay); every cached context token scores the largest attention probability it
gets from any replay query and any query head of its KV group; the first `n_sink` positions are always kept; the
cache is cut to the budget once, and the replay's own tokens are never kept.

A protocol plus a rule: the rule only ranks a replay call's candidates (`fxbudget.harness.kvzip_protocol.compress` runs the
context prefill with eviction frozen, the replay as one evicting call, then rewinds the positions so the question
follows the context). Its score is `window_max_attn` (the kernel's max over the window's queries and the group) of
the cached slots, and -inf for the call's own tokens, which therefore rank below every cached token: with at least
`budget` context tokens cached (the protocol replays only then) no replay token can be kept. The kernel's window is
`chunk_size + REPLAY_PROMPT_TOKENS`, so the window of the replay call is all of its queries. Outside the protocol the
rule is refused (`replay_only`: an evicting call that is not its replay raises).

Departures: kvpress's default `layerwise=False` allocates the pruned entries over all layers and heads at once; here
every layer and KV head keeps `budget` entries (the budget contract shared by every rule), so `compression_ratio` and
`layerwise` are not fields (the budget replaces them). The replay is one call: a context longer than `chunk_size` is
refused, not replayed chunk by chunk (that needs a score carried across calls). The softmax of the replay is the
model's own over every visible candidate: the reference renormalizes it over the sinks, the replayed chunk and the
replay, which is the same set when the context has no chat-template header before it (one chunk); with a header
(`prefix_length` tokens: scored 0 past the sinks, as the reference) each replay query's softmax here also covers the
header. KVzip+ normalization
(1/||h|| per replay query and ||W_o v||_2 per query head, inside the max) needs signals the kernel does not measure:
`kvzip_plus_normalization=True` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals

# Tokens of the replay besides the replayed context: the repeat prompt, the template's assistant header and (the
# reference's later chunks) the previous chunk's last 8 tokens. The replay call's window covers them.
REPLAY_PROMPT_TOKENS = 64


@register("kvzip")
@dataclass
class KVzip(Rule):
    replay_only: ClassVar[bool] = True  # evicts only in `fxbudget.harness.kvzip_protocol.compress`'s replay call
    n_sink: int = 4
    kvzip_plus_normalization: bool = False
    chunk_size: int = 2048
    # Not a hyperparameter of the reference, which reads it from the tokenizer: the chat template's header tokens
    # before the context (not replayed; past the sinks they score 0, as the reference leaves them). `compare` sets it
    # from the model's tokenizer (`kvzip_protocol.template_parts`).
    prefix_length: int = 0

    def __post_init__(self):
        check_int("kvzip n_sink", self.n_sink, 0)
        check_int("kvzip chunk_size", self.chunk_size)
        check_int("kvzip prefix_length", self.prefix_length, 0)
        if not isinstance(self.kvzip_plus_normalization, bool):
            raise ValueError(f"kvzip kvzip_plus_normalization must be a bool, got {self.kvzip_plus_normalization!r}")
        if self.kvzip_plus_normalization:
            raise ValueError("kvzip kvzip_plus_normalization=True is not supported: KVzip+ weighs each replay query "
                             "by 1/||h|| and each candidate by its per-query-head ||W_o v||_2 inside the max, signals "
                             "the shared kernel does not measure")

    @property
    def window(self) -> int:
        """The kernel's observation window: the whole replay call (context chunk plus its prompt)."""
        return self.chunk_size + REPLAY_PROMPT_TOKENS

    def _is_slot(self, s: Signals) -> Tensor:
        return torch.arange(s.pos.shape[-1], device=s.pos.device) < s.k_slots.shape[2]

    def score(self, s: Signals) -> Tensor:
        # The call's own tokens (the replay) rank below every cached token: never kept while one is left.
        score = torch.where(self._is_slot(s), s.window_max_attn, float("-inf"))
        return torch.where((s.pos >= 0) & (s.pos < self.prefix_length), 0.0, score)

    def protect(self, s: Signals) -> Tensor:
        return (s.pos >= 0) & (s.pos < self.n_sink) & self._is_slot(s)

    def protected_per_head(self, budget: int) -> int:
        return self.n_sink  # the sinks
