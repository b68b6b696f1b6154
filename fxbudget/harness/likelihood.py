"""The answer log-likelihood metric: how likely the model finds the gold answer after the compressed context.

Exact match moves in steps of 1/samples; the teacher-forced log-probability of the gold answer (`tasks.answer_ids`)
moves continuously, so it separates rules with far fewer samples. It is scored from the state right after the whole
prompt, the state greedy decoding starts from, and the cache is put back in that state afterwards (a `BudgetCache`
in place: a copy would be a new object to a compiled forward and cost a recompile per row; any other cache is
deep-copied): decoding afterwards is unchanged, and neither the prefill nor the question's forward is repeated.
The prompt's end is reached as each protocol does (`finish_prompt`): query-agnostic appends the question with
eviction frozen, streaming appends it with eviction, query-aware has prefilled it. Then the answer but its last token
is appended:

- eviction frozen, in one call (query-agnostic, query-aware; the unmodified model's own cache for the reference row;
  one token per call under a compiled forward, to reuse its decode graph);
- `streaming`: one token per call with eviction, i.e. the protocol's greedy decode with the gold tokens fed instead
  of the argmax (teacher forcing, no sampling).

The first answer token is scored by the prompt's last-position logits. Log-probabilities come from a float32
log-softmax and are summed in float64.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import Tensor, nn

from ..api import compile as fx_compile
from ..cache.budget_cache import BudgetCache
from ..cache.keyword import cache_kwargs
from ..rules import Rule, get
from .branch import SharedPrefill, branch

PROTOCOLS = ("query-agnostic", "query-aware", "streaming")


def frozen_tokens(protocol: str, question_tokens: int, answer_tokens: int) -> int:
    """Tokens appended with eviction frozen after the prefill, for the likelihood (what the head-room must hold)."""
    return {"query-agnostic": question_tokens + answer_tokens - 1, "query-aware": answer_tokens - 1,
            "streaming": 0}[protocol]


def finish_prompt(model: nn.Module, cache, last_logits: Tensor, question: Tensor, protocol: str) -> Tensor:
    """Append what `protocol` appends of the prompt after its prefill (the question, unless query-aware prefilled
    it) to `cache`, in place, and return the prompt's last-position logits `[batch, vocab]`."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if protocol == "query-aware":
        return last_logits
    with cache.frozen() if protocol == "query-agnostic" else contextlib.nullcontext():
        return model(input_ids=question, use_cache=True, logits_to_keep=1,
                     **cache_kwargs(model.forward, cache)).logits[:, -1]


@contextlib.contextmanager
def scratch(cache):
    """`cache` to run on, left as it was afterwards: a `BudgetCache` is put back in place, bit-identical
    (`snapshot` / `restore`: a compiled forward keeps its inputs); any other cache is deep-copied."""
    if not isinstance(cache, BudgetCache):
        yield copy.deepcopy(cache)
        return
    saved = cache.snapshot()
    try:
        yield cache
    finally:
        cache.restore(saved)


def _logprobs(logits: Tensor, answer: Tensor) -> Tensor:
    """`[m]` float64 log-probabilities of `answer[0]` under `logits [1, m, vocab]`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp[0].gather(-1, answer[0, :, None])[:, 0].double()


def answer_logprobs(model: nn.Module, cache, last_logits: Tensor, answer: Tensor, *, evict: bool = False,
                    stepwise: bool = False) -> Tensor:
    """Teacher-forced log-probabilities of each answer token, from the state right after the whole prompt.

    Args:
        model: the model the cache belongs to: fxbudget-compiled for a `BudgetCache`, unmodified otherwise.
        cache: the cache after the whole prompt (`finish_prompt`); left in that state.
        last_logits: `[1, vocab]` logits of the prompt's last position (they score the first answer token).
        answer: `[1, m]` gold answer ids (`tasks.answer_ids`).
        evict: False: the answer goes in with eviction frozen (a `BudgetCache` needs the head-room); True
            (streaming): one token per call, evicting as decoding does.
        stepwise: frozen too, but one token per call: with a compiled forward this reuses the decode step's graph
            instead of compiling one for the answer's length (same values up to float rounding).
    Returns:
        `[m]` float64 log-probabilities (natural log) of the answer tokens.
    """
    m = answer.shape[1]
    if m < 1:
        raise ValueError("the answer has no tokens")
    logits = last_logits[:, None].float()
    if m == 1:
        return _logprobs(logits, answer)
    with torch.no_grad(), scratch(cache) as cache:
        frozen = cache.frozen if hasattr(cache, "frozen") and not evict else contextlib.nullcontext
        with frozen():
            if evict or stepwise:  # fresh [[id]] tensors, as decoding feeds: a strided view would recompile
                steps = [model(input_ids=torch.tensor([[int(answer[0, t])]], device=answer.device),
                               use_cache=True, logits_to_keep=1, **cache_kwargs(model.forward, cache)).logits[:, -1:]
                         for t in range(m - 1)]
            else:
                steps = [model(input_ids=answer[:, :-1], use_cache=True, **cache_kwargs(model.forward, cache),
                               logits_to_keep=m - 1).logits]
    return _logprobs(torch.cat([logits] + [x.float() for x in steps], dim=1), answer)


def rule_answer_logprobs(model: nn.Module, prefill: SharedPrefill, rule: Rule | str, budget: int, question: Tensor,
                         answer: Tensor, *, protocol: str = "query-agnostic", **rule_params) -> Tensor:
    """One trial of a rule search: the answer's log-probabilities under `rule` at `budget`, without a prefill.

    The cache is branched from `prefill` (`branch.py`: only the rule's score and the shared eviction run), the
    prompt finished as `protocol` does, then `answer_logprobs` scores the answer. Cost: one branch plus forwards
    over the question (unless query-aware) and the answer tokens.

    Args:
        model: the unmodified model `prefill` was recorded on (it is compiled and restored here).
        prefill: `shared_prefill(model, ids)` of one sample; `ids` must be what `protocol` prefills with eviction:
            the context for `query-agnostic` and `streaming`, context + question for `query-aware`.
        rule, budget, rule_params: the configuration to score.
        question, answer: `[1, q]` and `[1, m]` ids (`tasks.chat_ids`, `tasks.answer_ids`).
        protocol: as in the comparison grid.
    Returns:
        `[m]` float64 log-probabilities; `.sum()` is the answer's log-likelihood, `.mean()` per token.
    """
    rule = get(rule, **rule_params)
    headroom = frozen_tokens(protocol, question.shape[1], answer.shape[1])
    fx_compile(model, rule=rule, budget=budget, backend=None, headroom=headroom, progress=False)
    try:
        cache = model.forward.new_cache(prefill.logits.shape[0])
        branch(prefill, cache, rule)
        with torch.no_grad():
            logits = finish_prompt(model, cache, prefill.logits, question, protocol)
        return answer_logprobs(model, cache, logits, answer, evict=protocol == "streaming")
    finally:
        model.forward.restore()
