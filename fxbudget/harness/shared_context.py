"""The shared-context protocols (SCBench's setting): one context, compressed once, several requests over it.

- `multi-request`: the context is prefilled and compressed once, query-agnostic (the rule sees no question); each
  request then starts from that same compressed cache: its question is appended with eviction frozen, its answer
  generated, and the cache put back bit-identically (`BudgetCache.snapshot` / `restore`) before the next request.
- `multi-turn`: the requests come one after another on the same cache, as turns of one chat. Turn 1's question is
  appended with eviction on (the rule sees this turn's question, never a later one), its answer generated with
  eviction frozen; turn t + 1's call appends turn t's gold answer and turn t + 1's question (`followup_ids`: the end
  of the assistant turn, the next user turn, the generation prompt), again with eviction, so the rule keeps choosing
  through the conversation and the cache holds the budget between turns. The gold answer, not the generated one, is
  kept as the turn's answer: every rule's turn t sees the same tokens, so a later turn's score measures what the cache
  lost, not an earlier wrong answer carried along. The generated tokens are dropped (the cache is put back as it was
  before the decode).

The unmodified model (transformers' own cache) runs the same calls: its `multi-request` requests each start from a
copy of the prefilled context, its `multi-turn` turns append the same ids; a budget that covers everything
reproduces it. Both generators also serve any cache of the fxbudget-compiled model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn

from ..cache.budget_cache import BudgetCache
from ..cache.keyword import cache_kwargs
from .likelihood import answer_logprobs, scratch
from .measure import Clock, greedy, kv_bytes
from .tasks import Sample, answer_ids, chat_ids, followup_ids, requests

MULTI_PROTOCOLS = ("multi-request", "multi-turn")


@dataclass
class Turn:
    """One request: `prompt` `[1, q]`, the ids its call appends (multi-request: the question; multi-turn: the question
    as the next chat turn, after the previous turn's gold answer); `answer` `[1, m]`, its gold answer (scored by the
    likelihood; in multi-turn also the answer kept in the conversation); `max_new`, its answer length."""

    sample: Sample
    prompt: Tensor
    answer: Tensor
    max_new: int


@dataclass
class TurnResult:
    """What one request produced: its generated ids, the answer's log-probabilities (None without the likelihood),
    seconds (appending the question, decoding, the likelihood, compiling inside them), the KV bytes at the end of the
    answer, and the tokens the call appended (the previous gold answer included in multi-turn)."""

    turn: int  # 1-based
    output_ids: list[int]
    logprobs: Tensor | None
    question_s: float
    decode_s: float
    likelihood_s: float | None
    compile_s: float
    kv: dict
    appended_tokens: int


def turns(tokenizer, sample: Sample, protocol: str, max_new_tokens: int | None = None) -> tuple[Tensor, list[Turn]]:
    """`(context ids [1, n], one Turn per request)` of a shared-context sample under `protocol`.

    Args:
        max_new_tokens: the run's answer length override (None: each request's own).
    Raises:
        ValueError: an unknown protocol, or a sample with one request.
    """
    if protocol not in MULTI_PROTOCOLS:
        raise ValueError(f"protocol must be one of {MULTI_PROTOCOLS}, got {protocol!r}")
    reqs = requests(sample)
    if len(reqs) < 2:
        raise ValueError(f"{sample.task} asks one question per sample: {protocol} needs several over one context")
    ctx, first = chat_ids(tokenizer, reqs[0])
    out = []
    for i, r in enumerate(reqs):
        if protocol == "multi-request" or i == 0:
            prompt = chat_ids(tokenizer, r)[1]
        else:
            prompt = followup_ids(tokenizer, r)
        out.append(Turn(r, prompt, answer_ids(tokenizer, r), max_new_tokens or r.max_new_tokens))
    return ctx, out


def frozen_tokens(protocol: str, turn: Turn, likelihood: bool) -> int:
    """Tokens a turn appends with eviction frozen (what the cache's head-room must hold): multi-request freezes its
    question and answer, multi-turn only the answer (its question goes in with eviction)."""
    answer = max(turn.max_new, turn.answer.shape[1] - 1 if likelihood else 0)
    return answer + (turn.prompt.shape[1] if protocol == "multi-request" else 0)


def _frozen(cache):
    return cache.frozen() if isinstance(cache, BudgetCache) else contextlib.nullcontext()


def append(model: nn.Module, cache, ids: Tensor, *, frozen: bool) -> Tensor:
    """Append `ids` `[1, k]` to `cache` in place (eviction frozen or not; a cache that does not evict ignores it);
    returns the last position's logits `[1, vocab]`."""
    with _frozen(cache) if frozen else contextlib.nullcontext():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1,
                     **cache_kwargs(model.forward, cache)).logits[:, -1]


def _answer(model, cache, logits, turn: Turn, eos, likelihood: bool, stepwise: bool):
    """The turn's likelihood (cache left as it was) and its greedy answer (eviction frozen, on a scratch cache: the
    cache is as before the decode afterwards)."""
    lp, lik = None, None
    if likelihood:
        with Clock() as lik:
            lp = answer_logprobs(model, cache, logits, turn.answer, stepwise=stepwise)
    with scratch(cache) as work, Clock() as dec:
        with _frozen(work):
            ids, after = greedy(model, work, logits, turn.max_new, eos)
        kv = kv_bytes(after)
    return lp, lik, ids, dec, kv


@torch.no_grad()
def multi_request(model: nn.Module, cache, turns: list[Turn], *, eos: set[int], likelihood: bool = True,
                  stepwise: bool = False) -> Iterator[TurnResult]:
    """Answer each request from the compressed context in `cache` (prefilled, compressed: the state every request
    starts from): its question appended with eviction frozen, the likelihood, the greedy answer; `cache` is put back
    in that state before the result is yielded (bit-identical for a `BudgetCache`; a copy is run on otherwise).

    Args:
        stepwise: the likelihood token by token (a compiled forward's decode graph).
    """
    for t, turn in enumerate(turns, 1):
        with scratch(cache) as c:
            with Clock() as q:
                logits = append(model, c, turn.prompt, frozen=True)
            lp, lik, ids, dec, kv = _answer(model, c, logits, turn, eos, likelihood, stepwise)
        yield _result(t, ids, lp, q, dec, lik, kv, turn.prompt.shape[1])


@torch.no_grad()
def multi_turn(model: nn.Module, cache, turns: list[Turn], *, eos: set[int], likelihood: bool = True,
               stepwise: bool = False) -> Iterator[TurnResult]:
    """The requests as turns of one chat on `cache` (prefilled, compressed context), in place: turn t's call appends
    turn t - 1's gold answer and turn t's prompt with eviction on; then the likelihood and the greedy answer (eviction
    frozen, the cache put back as it was before the decode). After the last turn `cache` holds the context and every
    turn but the last one's answer."""
    previous = None
    for t, turn in enumerate(turns, 1):
        ids = turn.prompt if previous is None else torch.cat([previous, turn.prompt], dim=1)
        with Clock() as q:
            logits = append(model, cache, ids, frozen=False)
        lp, lik, out, dec, kv = _answer(model, cache, logits, turn, eos, likelihood, stepwise)
        previous = turn.answer
        yield _result(t, out, lp, q, dec, lik, kv, ids.shape[1])


def _result(t, ids, lp, q: Clock, dec: Clock, lik: Clock | None, kv, appended) -> TurnResult:
    return TurnResult(t, ids, lp, q.run, dec.run, None if lik is None else lik.run,
                      q.compile + dec.compile + (lik.compile if lik else 0.0), kv, appended)


RUN = {"multi-request": multi_request, "multi-turn": multi_turn}
