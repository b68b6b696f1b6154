"""From a sample to token ids: the prompt (chat template or plain text), the gold answer, and RULER's scoring."""

from __future__ import annotations

from .sample import Sample


def score(sample: Sample, prediction: str) -> float:
    """Fraction of ``sample.answers`` found in `prediction`, case-insensitively (RULER's ``string_match_all``)."""
    found = sum(a.lower() in prediction.lower() for a in sample.answers)
    return found / len(sample.answers)


def chat_ids(tokenizer, sample: Sample):
    """`(context_ids [1, n], question_ids [1, m])`: the prompt split where the question starts.

    The prompt is the chat template's user turn ``context + "\\n\\n" + question`` with the generation prompt, then
    ``sample.answer_prefix``; without a chat template it is ``f"{context}\\n\\n{question}\\nAnswer: {prefix}"``
    (trailing space dropped: a lone space token is a poor place to start generating).
    """
    user = sample.context + "\n\n" + sample.question
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True) + sample.answer_prefix
    else:
        text = f"{user}\nAnswer: {sample.answer_prefix}".rstrip(" ")
    cut = text.index(user) + len(sample.context)
    ctx = tokenizer(text[:cut], return_tensors="pt", add_special_tokens=False).input_ids
    question = tokenizer(text[cut:], return_tensors="pt", add_special_tokens=False).input_ids
    return ctx, question


def answer_text(tokenizer, sample: Sample) -> str:
    """The gold continuation the likelihood metric scores: every expected answer, joined by ``", "`` in the task's
    order (RULER's expected output for multi-answer tasks), as the assistant continues the prompt of
    :func:`chat_ids`: after a space when the prompt ends in text (a non-empty ``answer_prefix``, or "Answer:" without
    a chat template), directly after the template's assistant header otherwise. The end-of-turn token is not part
    of it: the metric asks how likely the answer is, not where the model stops.
    """
    joined = ", ".join(sample.answers)
    if not getattr(tokenizer, "chat_template", None):
        return " " + joined  # the prompt ends in "Answer:" or the prefix, trailing spaces stripped
    prefix = sample.answer_prefix
    return " " + joined if prefix and not prefix[-1].isspace() else joined


def answer_ids(tokenizer, sample: Sample):
    """`[1, m]` token ids of :func:`answer_text` (tokenized on its own, like the question after the context)."""
    return tokenizer(answer_text(tokenizer, sample), return_tensors="pt", add_special_tokens=False).input_ids
