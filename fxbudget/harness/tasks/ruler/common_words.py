"""RULER's common-words extraction (``scripts/data/synthetic/common_words_extraction.py``, task ``cwe``): a numbered
list of words, 10 of them repeated more often than the rest; one solved example comes first."""

from __future__ import annotations

import random

from ..sample import _check_args
from .data import data_file, english_words
from .fit import fit, to_sample
from .templates import CONFIGS, FAMILIES
from .words import common_words

_FAMILY = FAMILIES["common_words_extraction"]


def _numbered(words) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _example(rng: random.Random, num_words: int, common_repeats: int, uncommon_repeats: int, common_nums: int,
             extra_words) -> tuple[str, list[str]]:
    """RULER's ``get_example``: `num_words` distinct words, the first `common_nums` repeated `common_repeats` times,
    the others `uncommon_repeats` times, shuffled and numbered."""
    pool = common_words() if num_words <= len(common_words()) else extra_words()
    chosen = rng.sample(pool, num_words)
    common, uncommon = chosen[:common_nums], chosen[common_nums:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(listed)
    return _numbered(listed), common


def generator(name: str):
    args = CONFIGS[name].args
    task = f"ruler:{name}"
    num_cw = args["num_cw"]

    def generate(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, data_dir=None):
        _check_args(n_tokens, depth)

        def extra_words():  # RULER's english_words.json, read only past wonderwords' ~8,700 words
            return english_words(data_file("english_words.json", task, data_dir), task)

        # RULER: below 4096 tokens, an example of 20 words (3 / 1 repeats) and a list with 6 / 1 repeats; else an
        # example of 40 words (10 / 3) and the configured freq_cw / freq_ucw.
        short = n_tokens < 4096
        shot_args = (20, 3, 1) if short else (40, 10, 3)
        repeats = (6, 1) if short else (args["freq_cw"], args["freq_ucw"])

        def prompt(k):
            rng = random.Random(f"{task}:{seed}:{k}")
            shot_ctx, shot_answer = _example(rng, *shot_args, num_cw, extra_words)
            ctx, answer = _example(rng, k, *repeats, num_cw, extra_words)
            shot = _FAMILY.template.format(context=shot_ctx, query="") + _FAMILY.answer_prefix + " " \
                + _numbered(shot_answer)
            return shot + "\n" + _FAMILY.template.format(context=ctx, query="") + _FAMILY.answer_prefix, answer, \
                shot

        k, text, _ = fit(lambda k: prompt(k)[0], tokenizer, n_tokens, _FAMILY.tokens_to_generate, 10, task)
        _, answers, shot = prompt(k)
        return to_sample(task, "common_words_extraction", text, _FAMILY.answer_prefix, answers, tokenizer, n_tokens,
                         seed, {"n_words": k, "example": shot})

    generate.__name__ = generate.__qualname__ = name
    generate.__doc__ = (f"RULER's {name}: common-words extraction with {args} (scripts/synthetic.yaml); answers: the "
                        f"{num_cw} common words. `depth` is ignored.")
    return generate
