"""The KVzip protocol (rule `kvzip`): prefill the context in full, replay it once, cut the cache to the budget.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", 2025 (arXiv:2505.23416); the
steps of kvpress 0.5.5's `KVzipPress`:
1. the context is prefilled with eviction frozen: every context token is cached (the cache holds
   `max(context, budget + headroom)` slots);
2. the replay, `"\\n\\nRepeat the previous context exactly."`, the chat template's assistant header, then the context
   after the template's user header (`replay_ids`), runs as ONE evicting call of the shared kernel with the `kvzip`
   rule: each cached token scores its largest attention from any replay query and query head of its group, the
   replay's own tokens score -inf, and the kernel keeps the top `budget` of the layer (sinks protected);
3. the replay's positions are rewound, so the question and the answer follow the context at the positions the
   unmodified model gives them, with eviction frozen (the query-agnostic protocol's head-room).
The replay runs only when the context overflows the budget (with a covering budget nothing is evicted, as the
reference skips it at compression ratio 0). Its cost is part of the prefill (`Compressed.prefill_s`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..cache.budget_cache import BudgetCache
from ..compiler.forward import BudgetForward

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."


def template_parts(tokenizer) -> tuple[int, Tensor]:
    """The chat template's user-turn header length (tokens before the context) and its assistant header ids
    (what follows the user's text), found by templating a marker text; without a template, the BOS token's length
    (0 or 1) and "\\n".

    Returns:
        `(prefix_length, suffix_ids [1, m])`.
    """
    if not getattr(tokenizer, "chat_template", None):  # the header is the BOS token, if the prompt starts with one
        from .tasks.prompt import bos_ids

        return len(bos_ids(tokenizer)), tokenizer("\n", return_tensors="pt", add_special_tokens=False).input_ids
    marker = "fxbudget context marker"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)  # the reference's header
    head, tail = text.split(marker, 1)
    prefix = tokenizer(head, return_tensors="pt", add_special_tokens=False).input_ids.shape[1]
    return prefix, tokenizer(tail, return_tensors="pt", add_special_tokens=False).input_ids


def replay_ids(tokenizer, context_ids: Tensor, *, prefix_length: int | None = None) -> Tensor:
    """The replay call's tokens: the repeat prompt, the template's assistant header, the context after its header.

    Args:
        tokenizer: the model's tokenizer.
        context_ids: `[batch, n]`, the context as prefilled (chat-template user header included).
        prefix_length: tokens of the header before the context text (default: `template_parts`'s).
    Returns:
        `[batch, m]` token ids.
    """
    prefix, suffix = template_parts(tokenizer)
    prefix = prefix if prefix_length is None else prefix_length
    b = context_ids.shape[0]
    prompt = tokenizer(REPEAT_PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    parts = [prompt.expand(b, -1), suffix.expand(b, -1)]
    return torch.cat([p.to(context_ids.device) for p in parts] + [context_ids[:, prefix:]], dim=1)


@dataclass
class Compressed:
    """What `compress` leaves: the cache (at most `budget` entries per layer and KV head, then `headroom` free
    slots), the context's last-position logits `[batch, vocab]`, and its timings (seconds; `prefill_s` = context
    prefill + replay). `replay_tokens` is 0 when the budget covered the context and nothing was replayed."""

    cache: BudgetCache
    logits: Tensor
    prefill_s: float
    replay_s: float
    replay_tokens: int


class WallClock:
    """Wall time of a block (`.run`, seconds), the device synchronized at both ends."""

    def __init__(self, device: torch.device):
        self.device = device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        self._sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.run = time.perf_counter() - self.t0


def compress(model: nn.Module, context_ids: Tensor, replay: Tensor, *, headroom: int = 0,
             cache: BudgetCache | None = None, clock: Callable[[], Any] | None = None) -> Compressed:
    """Run the KVzip protocol on a model compiled with `fxbudget.compile(model, rule="kvzip", budget=B)`.

    Args:
        model: the compiled model (its forward a `BudgetForward` with a `replay_only` rule).
        context_ids: `[batch, n]` context tokens (rows of one length: no padding).
        replay: `[batch, m]` replay tokens (`replay_ids`); at most the rule's window (`chunk_size` + prompt).
        headroom: slots kept free after the compression, for what is appended frozen (question and answer).
        cache: an empty cache to fill (default: a new one, `max(n - B, headroom)` slots of head-room).
        clock: makes the context manager that times each phase (its `.run` after the block, seconds; default
            `WallClock`): the harness passes one that leaves compile time out.
    Returns:
        `Compressed`.
    Raises:
        ValueError: the model is not compiled with a replay rule, the inputs do not match, the context is longer
            than `chunk_size`, the replay longer than the window, or the model has sliding-window layers.
        RuntimeError: a replay token was kept (a broken kernel invariant; never silently).
    """
    fwd = model.forward
    if not isinstance(fwd, BudgetForward) or not fwd.rule.replay_only:
        raise ValueError("kvzip_protocol.compress needs a model compiled by fxbudget.compile(model, rule='kvzip', "
                         "budget=...)")
    rule, budget = fwd.rule, fwd.budget
    if context_ids.dim() != 2 or replay.dim() != 2 or replay.shape[0] != context_ids.shape[0]:
        raise ValueError(f"context_ids and replay must be [batch, tokens] of one batch, got "
                         f"{tuple(context_ids.shape)} and {tuple(replay.shape)}")
    b, n = context_ids.shape
    m = replay.shape[1]
    if n > rule.chunk_size:
        raise ValueError(f"{rule.name}: a context of {n} tokens exceeds chunk_size={rule.chunk_size}; the replay is "
                         f"one call (replaying chunk by chunk needs a score carried across calls): pass chunk_size "
                         f">= {n}")
    if m > rule.window:
        raise ValueError(f"{rule.name}: the replay of {m} tokens exceeds the kernel window {rule.window} "
                         f"(chunk_size + prompt tokens): its scores would miss replay queries")
    cache = cache if cache is not None else fwd.new_cache(b, headroom=max(n - budget, headroom))
    if any(layer.sliding for layer in cache.layers):
        raise ValueError(f"{rule.name}: models with sliding-window layers are not supported (their window would hold "
                         "the replay's tokens)")
    if cache.tokens_seen:
        raise ValueError(f"{rule.name}: compress needs an empty cache, this one has seen {cache.tokens_seen} tokens")
    clock = clock or (lambda: WallClock(context_ids.device))
    with clock() as pre, cache.frozen():
        logits = model(input_ids=context_ids, cache=cache, logits_to_keep=1).logits[:, -1]
    if n <= min(cache.layer_budgets):
        return Compressed(cache, logits, pre.run, 0.0, 0)
    fwd.replaying = True
    try:
        with clock() as rep:
            model(input_ids=replay, cache=cache, logits_to_keep=1)
    finally:
        fwd.replaying = False
    for layer in cache.layers:  # the question follows the context, as in the unmodified model
        layer.seen.sub_(m)
    cache.next_pos -= m
    for layer in cache._budgeted():
        held = layer.pos >= 0
        if bool((layer.pos >= n).any()) or bool((held.sum(-1) != min(n, layer.budget)).any()):
            raise RuntimeError(f"{rule.name}: layer {layer.layer} kept a replay token or not {layer.budget} context "
                               "tokens after the replay")
    return Compressed(cache, logits, pre.run + rep.run, rep.run, m)
