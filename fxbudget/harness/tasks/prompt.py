"""From a sample to token ids: the prompt (chat template or plain text), the gold answer, and RULER's scoring."""

from __future__ import annotations

from .sample import Sample


def score(sample: Sample, prediction: str) -> float:
    """Fraction of ``sample.answers`` found in `prediction`, case-insensitively (RULER's ``string_match_all``).

    A sample that names a RULER metric in ``meta["metric"]`` (the ``ruler:`` tasks) is scored as RULER scores it:
    its prediction post-processed as RULER does, then ``string_match_all`` or ``string_match_part`` (any answer found).
    A sample with ``meta["scoring"] == "keys_in_order"`` (``list_keys``) scores the fraction of its answers listed in
    order (``list_keys.in_order_score``).
    """
    if sample.meta.get("scoring") == "keys_in_order":
        from .list_keys import in_order_score
        return in_order_score(prediction, sample.answers)
    if "metric" in sample.meta:
        from .ruler.scoring import ruler_score
        return ruler_score(sample.meta["metric"], prediction, sample.answers)
    found = sum(a.lower() in prediction.lower() for a in sample.answers)
    return found / len(sample.answers)


def chat_ids(tokenizer, sample: Sample):
    """`(context_ids [1, n], question_ids [1, m])`: the prompt split where the question starts.

    The prompt is the chat template's user turn ``context + separator + question`` with the generation prompt
    (``enable_thinking=False``, as kvpress passes it: Qwen3's template then adds an empty thinking block), then
    ``sample.answer_prefix``; without a chat template it is ``context + separator + question + plain_suffix +
    answer_prefix`` (by default ``f"{context}\\n\\n{question}\\nAnswer: {prefix}"``; trailing spaces dropped: a lone
    space token is a poor place to start generating), after the BOS token the tokenizer puts before a text by
    default (`bos_ids`: Gemma's and Llama's base models expect it; a chat template writes its own). The template is applied to the context followed by a marker and
    the question put where the marker was (kvpress's split), so a template that trims its content cannot move the cut.
    """
    if getattr(tokenizer, "chat_template", None):
        mark = "#" * (len(sample.context) + 10)  # kvpress's marker: longer than any run of '#' in the context
        # enable_thinking=False as kvpress's pipeline passes it: a template that reads it (Qwen3) then opens the
        # answer with an empty thinking block instead of letting the model think inside the task's few tokens.
        head, tail = tokenizer.apply_chat_template([{"role": "user", "content": sample.context + mark}],
                                                   tokenize=False, add_generation_prompt=True,
                                                   enable_thinking=False).split(mark)
        ctx_text, question_text = head, sample.separator + sample.question + tail + sample.answer_prefix
    else:
        text = (sample.context + sample.separator + sample.question + sample.plain_suffix
                + sample.answer_prefix).rstrip(" ")
        ctx_text, question_text = text[:len(sample.context)], text[len(sample.context):]
    ctx = tokenizer(ctx_text, return_tensors="pt", add_special_tokens=False).input_ids
    question = tokenizer(question_text, return_tensors="pt", add_special_tokens=False).input_ids
    if not getattr(tokenizer, "chat_template", None):
        bos = bos_ids(tokenizer)
        if bos:
            import torch

            ctx = torch.cat([torch.tensor([bos], dtype=ctx.dtype), ctx], dim=1)
    return ctx, question


def bos_ids(tokenizer) -> list[int]:
    """`[bos]` if the tokenizer starts a text with its BOS token by default (Gemma, Llama), else `[]` (Qwen, GPT-2):
    what a prompt without a chat template starts with."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    return [bos] if tokenizer("x").input_ids[:1] == [bos] else []


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


def followup_ids(tokenizer, sample: Sample):
    """`[1, k]` ids of a later turn of a conversation about one context (the `multi-turn` protocol): what follows the
    previous turn's answer (:func:`answer_ids`) when `sample.question` is asked next: the end of that assistant turn,
    the user turn holding the question, the generation prompt, then ``sample.answer_prefix``.

    With a chat template, read off the template applied to ``[user, assistant, user]`` around markers (as
    :func:`chat_ids` reads the first turn); without one, ``separator + question + plain_suffix + answer_prefix``
    (trailing spaces dropped), the first turn's form. The first turn's ids are :func:`chat_ids`' second part.
    """
    if getattr(tokenizer, "chat_template", None):
        marks = ["@" * 40 + str(i) for i in range(3)]  # no template writes these
        text = tokenizer.apply_chat_template([{"role": "user", "content": marks[0]},
                                              {"role": "assistant", "content": marks[1]},
                                              {"role": "user", "content": marks[2]}],
                                             tokenize=False, add_generation_prompt=True)
        close, tail = text.split(marks[1])[1].split(marks[2])
        turn = close + sample.question + tail + sample.answer_prefix
    else:
        turn = (sample.separator + sample.question + sample.plain_suffix + sample.answer_prefix).rstrip(" ")
    return tokenizer(turn, return_tensors="pt", add_special_tokens=False).input_ids
