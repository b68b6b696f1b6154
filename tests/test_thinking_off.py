"""The chat prompt is built with `enable_thinking=False`, as kvpress's pipeline builds it (issue 32: Qwen3-8B is a
leaderboard model): a template that reads the flag (Qwen3's) opens the answer with an empty thinking block; a template
that does not (the embedded Qwen2.5's) gives the prompt it gave before."""

import copy

from fxbudget.harness.tasks import chat_ids
from fxbudget.harness.tasks.sample import Sample

# Qwen3's generation prompt, reduced to what the flag changes (its template's last lines).
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")


def sample():
    return Sample(task="t", context="The key is 7351.", question=" What is the key?", answers=["7351"],
                  n_tokens=0, depth=0.0, answer_prefix="The key is", separator="")


def test_a_template_reading_the_flag_gets_an_empty_thinking_block(tok):
    qwen3 = copy.deepcopy(tok)
    qwen3.chat_template = QWEN3_LIKE
    ctx, question = chat_ids(qwen3, sample())
    assert qwen3.decode(ctx[0]) == "<|im_start|>user\nThe key is 7351."
    assert qwen3.decode(question[0]) == (" What is the key?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                                         "The key is")


def test_a_template_without_the_flag_is_unchanged(tok):
    ctx, question = chat_ids(tok, sample())
    text = tok.apply_chat_template([{"role": "user", "content": "The key is 7351. What is the key?"}], tokenize=False,
                                   add_generation_prompt=True) + "The key is"
    assert tok.decode(ctx[0]) + tok.decode(question[0]) == text
    assert "<think>" not in text
