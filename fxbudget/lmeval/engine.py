"""The budgeted forwards behind lm-eval's three request types, on token ids (no lm-eval import).

- `prefill`: a left-padded batch of prompts through the budget (eviction on; one call, or `chunk_size` chunks).
- `score`: teacher-forced log-probabilities of continuations from the state after a prefill: the tokens after the
  prefill go in with eviction frozen in one call (query-aware, query-agnostic), or one token per call with eviction
  (streaming); the cache is put back afterwards (`likelihood.scratch`), so several continuations of one context
  share its prefill.
- `generate`: greedy decoding after a prefill, each row first fed its forced tokens (the question, query-agnostic),
  eviction frozen (query-aware, query-agnostic) or on (streaming).
- `rolling`: a left-padded batch of windows through the budget in calls of `Options.rolling_call` tokens, every call
  evicting; every position's log-probability.

Rows of a batch are independent: pads are never visible and never kept (tests/test_padding.py). Rows of different
lengths after the prefill are right-padded in `score` only, where nothing follows the pads.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import Tensor, nn

from ..api import compile as fx_compile
from ..cache.byte_budget import model_tokens_for_bytes
from ..cache.for_model import resolve_head_pool
from ..harness.likelihood import scratch
from ..harness.grid import budget_kind
from ..harness.runner import resolve_budget
from .options import Options


def left_pad(seqs: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    """`(ids, mask)` `[batch, longest]`, each row's tokens on the right (0s in the mask for pads)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


class Budgeted:
    """One model under one rule and budget spec: a `BudgetForward` per (absolute budget, chunk size), built once and
    installed only around each use (the model is the unmodified one in between)."""

    def __init__(self, model: nn.Module, opts: Options, pad_id: int):
        self.model, self.opts, self.pad = model, opts, pad_id
        self.device = next(model.parameters()).device
        self._forwards: dict = {}
        self.budgets_used: set[int] = set()  # the absolute budgets run (one per distinct prefill length if relative)
        # A byte budget's tokens for this model, its dtype and the rule's layout (`cache.byte_budget`).
        spec = opts.budget
        self.byte_tokens = {spec: model_tokens_for_bytes(spec, model, head_pool=resolve_head_pool(opts.rule, None),
                                                         slot_dtype=opts.slot_dtype)} \
            if budget_kind(spec) == "bytes" else {}

    def budget_for(self, prefill_tokens: int) -> int:
        """The absolute budget for a request that prefills `prefill_tokens` tokens with eviction."""
        return resolve_budget(self.opts.budget, prefill_tokens, self.byte_tokens)

    def headroom(self, frozen_tokens: int) -> int:
        """Head-room slots for `frozen_tokens` appended with eviction frozen; compiled, rounded up to 64 so that a
        few cache shapes (graphs) serve every batch."""
        if self.opts.backend is None or frozen_tokens == 0:
            return frozen_tokens
        return math.ceil(frozen_tokens / 64) * 64

    @contextlib.contextmanager
    def installed(self, budget: int, chunk: int | None):
        """The model compiled for `budget` (prefill chunks of `chunk`) for the duration; restored afterwards."""
        key = (budget, chunk)
        forward = self._forwards.get(key)
        if forward is None:
            fx_compile(self.model, rule=self.opts.rule, budget=budget, chunk_size=chunk, backend=self.opts.backend,
                       block=self.opts.block, progress=False, slot_dtype=self.opts.slot_dtype)
            forward = self._forwards[key] = self.model.forward
        else:
            forward.install()
        self.budgets_used.add(budget)
        try:
            with torch.no_grad():
                yield forward
        finally:
            forward.restore()

    def _call(self, ids: Tensor, mask: Tensor, cache, keep: int = 1) -> Tensor:
        return self.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=keep).logits

    def prefill(self, forward, seqs: list[list[int]], headroom: int):
        """Prefill the rows `seqs` with eviction. Returns `(cache, mask, last_logits [batch, vocab])`."""
        ids, mask = left_pad(seqs, self.pad, self.device)
        cache = forward.new_cache(len(seqs), headroom=self.headroom(headroom), prompt=ids.shape[1])
        return cache, mask, self._call(ids, mask, cache)[:, -1]

    def score(self, cache, mask: Tensor, last_logits: Tensor, feeds: list[list[int]], targets: list[list[int]],
              *, evict: bool) -> list[tuple[float, bool]]:
        """Log-likelihood and greedy match of each row's target after its feed, the cache left as it was.

        Args:
            cache, mask, last_logits: the state after `prefill`.
            feeds: per row, every token after the prefill but the target's last (question + target[:-1]).
            targets: per row, the tokens to score (the last `len(target)` tokens of `feed + target[-1:]`).
            evict: False: the feeds go in with eviction frozen, in one call; True (streaming): one token per call,
                evicting as decoding does.
        Returns:
            Per row `(sum of natural-log probabilities (float64), every target token the argmax)`.
        """
        width = max(len(f) for f in feeds)
        pieces = [last_logits[:, None].float()]
        with scratch(cache) as c:
            if width:
                ids = torch.tensor([f + [self.pad] * (width - len(f)) for f in feeds], device=self.device)
                if evict:
                    for t in range(width):
                        step = torch.cat([mask, mask.new_ones(len(feeds), t + 1)], dim=1)
                        pieces.append(self._call(ids[:, t:t + 1].clone(), step, c)[:, -1:].float())
                else:
                    with c.frozen():
                        full = torch.cat([mask, mask.new_ones(len(feeds), width)], dim=1)
                        pieces.append(self._call(ids, full, c, keep=0).float())
        logits = torch.cat(pieces, dim=1)
        out = []
        for i, (feed, target) in enumerate(zip(feeds, targets)):
            start = len(feed) + 1 - len(target)  # position whose logits predict target[0]
            row = logits[i, start:start + len(target)]
            tgt = torch.tensor(target, device=row.device)
            lp = torch.log_softmax(row, dim=-1).gather(-1, tgt[:, None])[:, 0].double()
            out.append((float(lp.sum()), bool((row.argmax(-1) == tgt).all())))
        return out

    def generate(self, cache, mask: Tensor, last_logits: Tensor, forced: list[list[int]], max_new: int,
                 eos: set[int], stop: Callable[[int, list[int]], bool], *, evict: bool) -> list[list[int]]:
        """Greedy tokens per row after the prefill: each row is first fed its `forced` tokens (teacher-forced, the
        query-agnostic question), then its argmax, until `max_new` tokens, an `eos` id or `stop(row, tokens)`.

        Frozen unless `evict` (the head-room must hold the longest forced row plus `max_new`). Rows that finished
        keep decoding until all have (their extra tokens are dropped). Returns each row's tokens (an eos included).
        """
        rows = len(forced)
        out: list[list[int]] = [[] for _ in range(rows)]
        done = [max_new < 1] * rows
        if all(done):
            return out
        with contextlib.nullcontext() if evict else cache.frozen():
            common = min(len(f) for f in forced)
            logits = last_logits
            if common:  # the part every row is forced to feed goes in one call
                ids = torch.tensor([f[:common] for f in forced], device=self.device)
                mask = torch.cat([mask, mask.new_ones(rows, common)], dim=1)
                logits = self._call(ids, mask, cache)[:, -1]
            at = [common] * rows
            while True:
                best, feed = logits.argmax(-1).tolist(), []
                for i in range(rows):
                    if at[i] < len(forced[i]):
                        tok = forced[i][at[i]]
                        at[i] += 1
                    else:
                        tok = best[i]
                        if not done[i]:
                            out[i].append(tok)
                            done[i] = len(out[i]) >= max_new or tok in eos or stop(i, out[i])
                    feed.append(tok)
                if all(done):
                    return out
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                logits = self._call(torch.tensor(feed, device=self.device)[:, None], mask, cache)[:, -1]

    def rolling(self, forward, inputs: list[list[int]], targets: list[list[int]]) -> list[float]:
        """Summed log-probabilities of each window's targets (the last `len(target)` tokens of `input +
        target[-1:]`), the windows streamed through the budget in calls of `forward.chunk_size` tokens."""
        ids, mask = left_pad(inputs, self.pad, self.device)
        cache = forward.new_cache(len(inputs), prompt=ids.shape[1])
        logits = self._call(ids, mask, cache, keep=0)
        out = []
        for i, target in enumerate(targets):
            row = logits[i, ids.shape[1] - len(target):].float()
            tgt = torch.tensor(target, device=row.device)
            out.append(float(torch.log_softmax(row, dim=-1).gather(-1, tgt[:, None])[:, 0].double().sum()))
        return out
