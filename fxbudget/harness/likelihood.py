"""The answer log-likelihood metric: how likely the model finds the gold answer after the compressed context.

Exact match moves in steps of 1/samples; the teacher-forced log-probability of the gold answer (`tasks.answer_ids`)
moves continuously, so it separates rules with far fewer samples. It is measured from the state a protocol's prefill
leaves (the shared prefill's branch, or a rule's own prefill) on a **copy** of the cache, so decoding afterwards is
unchanged and no prefill is repeated. Per protocol, the tokens appended after that state:

- `query-agnostic`: the question and the answer (but its last token) in one call, eviction frozen (head-room);
- `query-aware` and the unmodified model (`frozen=None`): the answer but its last token in one call, eviction frozen;
  the first answer token is scored by the prefill's last-position logits;
- `streaming`: the question in one call with eviction, then the answer one token per call with eviction, i.e. the
  protocol's greedy decode with the gold tokens fed instead of the argmax (teacher forcing, no sampling).

The log-probabilities come from a float32 log-softmax and are summed in float64.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import Tensor, nn

from ..api import compile as fx_compile
from ..rules import Rule, get
from .branch import SharedPrefill, branch

PROTOCOLS = ("query-agnostic", "query-aware", "streaming")


def frozen_tokens(protocol: str, question_tokens: int, answer_tokens: int) -> int:
    """Tokens the likelihood forward appends with eviction frozen (what the cache's head-room must hold)."""
    return {"query-agnostic": question_tokens + answer_tokens - 1, "query-aware": answer_tokens - 1,
            "streaming": 0}[protocol]


def _logprobs(logits: Tensor, answer: Tensor) -> Tensor:
    """`[m]` float64 log-probabilities of `answer[0]` under `logits [1, m, vocab]`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp[0].gather(-1, answer[0, :, None])[:, 0].double()


def answer_logprobs(model: nn.Module, cache, last_logits: Tensor, question: Tensor, answer: Tensor,
                    protocol: str | None) -> Tensor:
    """Teacher-forced log-probabilities of each answer token, from the state right after a prefill.

    Args:
        model: the model the cache belongs to: fxbudget-compiled for a `BudgetCache`, unmodified otherwise.
        cache: the cache after the protocol's prefill; it is not modified (the forward runs on a deep copy).
        last_logits: `[1, vocab]` logits of the prefill's last position.
        question: `[1, q]` question ids (appended first under `query-agnostic` and `streaming`).
        answer: `[1, m]` gold answer ids (`tasks.answer_ids`).
        protocol: one of `PROTOCOLS`, or None for the unmodified model after a prefill of context + question.
    Returns:
        `[m]` float64 log-probabilities (natural log) of the answer tokens.
    """
    m = answer.shape[1]
    if m < 1:
        raise ValueError("the answer has no tokens")
    if protocol not in PROTOCOLS + (None,):
        raise ValueError(f"protocol must be one of {PROTOCOLS} or None, got {protocol!r}")
    cache = copy.deepcopy(cache)
    frozen = cache.frozen if hasattr(cache, "frozen") else contextlib.nullcontext
    with torch.no_grad():
        if protocol == "query-agnostic":
            ids = torch.cat([question, answer[:, :-1]], dim=1)
            with frozen():
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=m).logits
        elif protocol == "streaming":
            step = model(input_ids=question, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = [step.logits[:, -1]]
            for t in range(m - 1):
                step = model(input_ids=answer[:, t:t + 1], past_key_values=cache, use_cache=True, logits_to_keep=1)
                logits.append(step.logits[:, -1])
            logits = torch.stack(logits, dim=1)
        else:
            logits = last_logits[:, None]
            if m > 1:
                with frozen():
                    rest = model(input_ids=answer[:, :-1], past_key_values=cache, use_cache=True,
                                 logits_to_keep=m - 1).logits
                logits = torch.cat([logits, rest.to(logits.dtype)], dim=1)
    return _logprobs(logits, answer)


def rule_answer_logprobs(model: nn.Module, prefill: SharedPrefill, rule: Rule | str, budget: int, question: Tensor,
                         answer: Tensor, *, protocol: str = "query-agnostic", **rule_params) -> Tensor:
    """One trial of a rule search: the answer's log-probabilities under `rule` at `budget`, without a prefill.

    The cache is branched from `prefill` (`branch.py`: only the rule's score and the shared eviction run), then
    `answer_logprobs` scores the answer. Cost: one branch plus a forward over the question and answer tokens.

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
    fx_compile(model, rule=rule, budget=budget, backend=None, headroom=headroom)
    try:
        cache = model.forward.new_cache(prefill.logits.shape[0])
        branch(prefill, cache, rule)
        return answer_logprobs(model, cache, prefill.logits, question, answer, protocol)
    finally:
        model.forward.restore()
