"""Speculative decoding on a `BudgetCache`: the `crop` that transformers' assisted generation and prompt lookup call
after each verification call (`generate(assistant_model=...)`, `generate(prompt_lookup_num_tokens=...)`), exact or
refused.

A verification call appends the last accepted token and the draft tokens; `crop(-r)` then drops the `r` rejected
ones. That is exact only when the calls being undone evicted nothing: their tokens then sit in empty slots, and
emptying those slots (position -1, zero state and per-token signals, counts back) gives the cache the
non-speculative run would hold. A call that evicted chose with the rejected tokens among its candidates and in its
observation window, so what it dropped cannot come back: refused, in one line (`refusal`). Eviction is frozen while
it decodes under the query-agnostic and query-aware protocols (`with cache.frozen(): model.generate(...)` after a
prefill with eviction), and never runs under a budget covering the sequence; it runs in decoding under the
streaming protocol (and plain `generate()` past the budget), at an `interval` too.

What a crop cannot undo is the rejected queries' attention added to the kept entries' accumulated attention
(`acc_attn`, the slots' `state`): it decides nothing while nothing is evicted, so after a crop of a multi-token call
the cache refuses every later call that would evict (`BudgetCache.admit`) until it is reset or restored.

Sliding-window layers hold exactly their window: once full, each call drops the oldest entries for its new ones, and
after a crop of `r >= 2` tokens the next query would miss `r - 1` tokens of its window: refused too (`r <= 1` is
exact: the one entry missing is outside the next query's window).
"""

from __future__ import annotations

import torch

FIX = ("use the query-agnostic protocol (prefill the context, then generate under `with cache.frozen():` with "
       "headroom= for the question and answer; docs/api.md, Speculative decoding), a budget covering the prompt and "
       "max_new_tokens, or generate without assistant_model / prompt_lookup_num_tokens")


def protocol(cache) -> str:
    """How `cache` evicts while it decodes, as the refusal names it."""
    if cache.interval > 1:
        return f"the streaming protocol at decode interval {cache.interval} (--interval)"
    return "the streaming protocol (every call past the budget evicts, as plain generate() does)"


def refusal(cache, why: str, fix: str = FIX) -> ValueError:
    """The one-line refusal of speculative decoding on a cache whose decoding evicts (`why`: which call, and why)."""
    return ValueError(f"speculative decoding (assistant_model= or prompt_lookup_num_tokens=) on a BudgetCache "
                      f"under {protocol(cache)}, budget {cache.budget}: {why}; {fix}")


EVICTED = "the verification call evicted, and a crop cannot restore what the rejected draft tokens evicted"
FULL = "the cache is full, so every verification call would evict what a crop cannot restore"
STALE = ("this call would evict by an accumulated attention that still holds the rejected draft tokens' attention "
         "(a crop cannot take it back)")
STALE_FIX = FIX + ", or restore a snapshot taken before speculative decoding (cache.restore) or reset the cache"


def check_crop(cache, r: int) -> None:
    """Raise unless dropping the last `r` tokens of `cache` (`crop(-r)`) is exact (the module docstring)."""
    length, dropped = cache._last
    if r > cache._clean or (dropped and length > 1):
        raise refusal(cache, EVICTED)
    if r > 1:
        seen = cache.tokens_seen
        window = next((layer.sliding for layer in cache.layers if layer.sliding and seen > layer.sliding), 0)
        if window:
            raise ValueError(f"speculative decoding on a BudgetCache: a sliding-window layer (window {window}) is "
                             f"full, so the verification call dropped entries of its window for the {r} rejected "
                             f"draft tokens, and a crop cannot restore them; use num_assistant_tokens=1 (or "
                             f"prompt_lookup_num_tokens=1) or generate without assistant_model")


def crop(cache, tokens_to_remove: int) -> None:
    """`BudgetCache.crop`: forget the last `-tokens_to_remove` tokens of every row, exactly, or raise."""
    if isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.numel() == 1 \
            and not tokens_to_remove.is_floating_point():
        # A draft model's own cache is cropped by a count computed from `get_seq_length()`, a tensor here.
        tokens_to_remove = int(tokens_to_remove)
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise TypeError(f"crop() takes an int, got {tokens_to_remove!r}")
    if tokens_to_remove > 0:  # transformers' own layers refuse the legacy absolute length the same way
        raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. Please use a "
                         "negative integer to remove that number of tokens from the cache instead.")
    r = -tokens_to_remove
    check_crop(cache, r)
    if cache._last[0] > 1:
        cache._speculated = True  # the kept entries' acc_attn holds the call's rejected queries' attention
    if not r:
        return
    first = cache.next_pos - r  # each row's first position to drop
    for layer in cache.layers:
        layer.drop_from(first, r)
    cache.next_pos.sub_(r)
    cache._held = [max(held - r, 0) for held in cache._held]
    cache._clean -= r


def drop_slots(layer, first: torch.Tensor, r: int) -> None:
    """`BudgetLayer.drop_from`: empty the slots holding a position >= `first[b]` of their row, as `reset` leaves a
    slot, and count `r` tokens fewer seen."""
    drop = layer.pos >= first.to(layer.device).view(-1, 1, 1)
    layer.pos.masked_fill_(drop, -1)
    layer.state.masked_fill_(drop, 0)
    for t in (layer.norms, layer.keys, layer.values):
        t.masked_fill_(drop.unsqueeze(-1), 0)
    if layer.pooled:
        layer.owner.masked_fill_(drop, -1)  # a free slot of the pool, as `evict` leaves one
    layer.seen.sub_(r)
