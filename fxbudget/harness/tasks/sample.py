"""A task sample and what every task family shares: token counting, per-task seeding, argument checks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Sample:
    """One prompt: `context`, `separator`, then `question`; the assistant turn starts with `answer_prefix`.
    Without a chat template the prompt is ``context + separator + question + plain_suffix + answer_prefix``."""

    task: str
    context: str
    question: str
    answers: list[str]  # every string expected in the output; score = fraction of them found
    answer_prefix: str = ""
    depth: float | None = None  # measured: token offset of the (asked) needle / n_tokens; None without a needle
    n_tokens: int = 0  # tokenizer's count of `context`, no special tokens
    seed: int = 0
    max_new_tokens: int = 16
    meta: dict = field(default_factory=dict)
    separator: str = "\n\n"  # between context and question (RULER's prompts carry their own: "")
    plain_suffix: str = "\nAnswer: "  # before the answer prefix when there is no chat template (RULER: "")

    @property
    def answer(self) -> str:
        return self.answers[0]


def _count(tokenizer, texts) -> list[int]:
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def _rng(task: str, seed: int) -> random.Random:
    return random.Random(f"{task}:{seed}")  # str seeds hash with sha512: stable across runs; tasks don't share keys


def _check_args(n_tokens, depth) -> None:
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens <= 0:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")


def _check_count(context: str, text: str, expected: int = 1) -> None:
    # Construction guarantees this (no digits in the haystack, distinct numbers); a failure is a bug, not bad luck.
    if context.count(text) != expected:
        raise RuntimeError(f"{text!r} occurs {context.count(text)} times in the context, expected {expected}")
