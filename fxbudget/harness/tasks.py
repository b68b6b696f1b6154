"""Synthetic long-context tasks, generated offline and deterministically from a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Word lists for a haystack that does not repeat: each sentence is drawn independently, so no span of text is a
# copy of another (a repeated sentence makes retrieval too easy).
_ADJ = ("quiet", "distant", "copper", "narrow", "ancient", "bright", "hollow", "gentle", "crooked", "silver", "amber",
        "restless", "frozen", "velvet", "faded", "patient", "brisk", "humble", "tangled", "lofty")
_NOUN = ("river", "lantern", "orchard", "library", "harbor", "meadow", "engine", "violin", "glacier", "market",
         "bridge", "garden", "tower", "forest", "canal", "workshop", "island", "valley", "museum", "station")
_VERB = ("watches", "follows", "shelters", "crosses", "remembers", "outlasts", "reflects", "surrounds", "greets",
         "ignores", "measures", "echoes", "borders", "feeds", "guards", "faces")
_TAIL = ("at dawn", "in winter", "after the rain", "every evening", "without a sound", "for many years",
         "under a grey sky", "before the market opens", "when the wind turns", "as the tide recedes")


def haystack_sentence(rng: random.Random) -> str:
    return (f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} the {rng.choice(_ADJ)} "
            f"{rng.choice(_NOUN)} {rng.choice(_TAIL)}.")


@dataclass
class Sample:
    """One prompt: `context` then `question`; `answer` is the exact string expected in the output."""

    context: str
    question: str
    answer: str
    depth: float  # where the needle sits in the context, 0 = start, 1 = end
    task: str


def passkey(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """Passkey retrieval: a 5-digit key hidden at `depth` in about `n_tokens` tokens of haystack.

    Args:
        tokenizer: counts tokens, so the context is `n_tokens` long to within one sentence.
        n_tokens: context length in tokens. depth: needle position as a fraction. seed: fixes text and key.
    """
    rng = random.Random(seed)
    key = f"{rng.randint(10000, 99999)}"
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    budget = n_tokens - len(tokenizer(needle).input_ids)
    sentences, used = [], 0
    while used < budget:
        s = haystack_sentence(rng)
        used += len(tokenizer(" " + s).input_ids)
        sentences.append(s)
    sentences.insert(round(depth * len(sentences)), needle)
    return Sample(context=" ".join(sentences), question="What is the pass key? Answer with the number only.",
                  answer=key, depth=depth, task="passkey")


def chat_ids(tokenizer, sample: Sample):
    """`(context_ids, question_ids)`: the chat-formatted prompt split where the question starts."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": sample.context + "\n\n" + sample.question}], tokenize=False,
        add_generation_prompt=True)
    cut = text.index(sample.context) + len(sample.context)
    ctx = tokenizer(text[:cut], return_tensors="pt", add_special_tokens=False).input_ids
    question = tokenizer(text[cut:], return_tensors="pt", add_special_tokens=False).input_ids
    return ctx, question
