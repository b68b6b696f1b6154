"""RULER's frequent-words extraction (``scripts/data/synthetic/freq_words_extraction.py``, task ``fwe``): coded
6-letter words drawn with Zipf (zeta) frequencies; the most frequent one is '...' (noise), the next three answer."""

from __future__ import annotations

import math
import random
import string

from ..sample import _check_args
from .fit import fit, to_sample
from .templates import CONFIGS, FAMILIES

_FAMILY = FAMILIES["freq_words_extraction"]
CODED_WORDLEN = 6  # RULER's --coded_wordlen default


def zeta(s: float) -> float:
    """Riemann zeta for s > 1 (scipy.special.zeta(s) in RULER): the first 1000 terms plus the Euler-Maclaurin tail."""
    if s <= 1:
        raise ValueError(f"alpha must be > 1, got {s}")
    n = 1000
    head = math.fsum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12 \
        - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720


def counts(num_words: int, vocab_size: int, alpha: float) -> list[int]:
    """RULER's per-rank counts: ``int(num_words * k**-alpha / zeta(alpha))`` for ranks k = 1..vocab_size."""
    z = zeta(alpha)
    return [int(num_words * k ** -alpha / z) for k in range(1, vocab_size + 1)]


def _vocab(rng: random.Random, size: int) -> list[str]:
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=CODED_WORDLEN)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."  # RULER: the top-ranked word is noise
    return words


def generator(name: str):
    args = CONFIGS[name].args
    task = f"ruler:{name}"
    alpha = args["alpha"]

    def generate(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, data_dir=None):
        _check_args(n_tokens, depth)
        vocab_size = (n_tokens - _FAMILY.tokens_to_generate) // 50  # RULER: max_seq_length // 50, after generation
        if vocab_size < 5:
            least = 5 * 50 + _FAMILY.tokens_to_generate
            raise ValueError(f"too short for {task}: RULER's vocabulary is (length - 50) // 50 words and needs 5; "
                             f"give at least {least}")
        vocab = _vocab(random.Random(f"{task}:{seed}:vocab"), vocab_size)
        # The three answers must be told apart from each other and from the fourth: ranks 2 > 3 > 4 > 5 in count.
        lowest = next(n for n in range(1, 10_000) if all(a > b for a, b in zip(counts(n, 5, alpha)[1:],
                                                                                counts(n, 5, alpha)[2:])))

        def prompt(k):
            words = [w for w, c in zip(vocab, counts(k, vocab_size, alpha)) for _ in range(c)]
            random.Random(f"{task}:{seed}:{k}").shuffle(words)
            return _FAMILY.template.format(context=" ".join(words), query="") + _FAMILY.answer_prefix

        k, text, _ = fit(prompt, tokenizer, n_tokens, _FAMILY.tokens_to_generate, lowest, task)
        return to_sample(task, "freq_words_extraction", text, _FAMILY.answer_prefix, vocab[1:4], tokenizer,
                         n_tokens, seed, {"n_words": k, "vocab_size": vocab_size,
                                          "counts": counts(k, vocab_size, alpha)[:5]})

    generate.__name__ = generate.__qualname__ = name
    generate.__doc__ = (f"RULER's {name}: frequent-words extraction with {args} (scripts/synthetic.yaml); answers: "
                        "the three most frequent coded words after '...'. `depth` is ignored.")
    return generate
