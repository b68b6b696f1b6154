"""RULER common-words extraction (aggregation): the words that recur most often in a numbered list."""

from __future__ import annotations

from itertools import accumulate, islice

from .haystack import _CWE_HEADER, _WORDS
from .sample import Sample, _check_args, _count, _rng


def common_words(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, n_common: int = 10) -> Sample:
    """RULER common-words extraction (aggregation): a numbered list in which `n_common` words recur most often.

    RULER's setting is 30 occurrences per common word and 3 per other word. Short contexts cannot hold 300 common
    entries, so the common frequency shrinks to fit (about 40% of the list, at least 2), the others' frequency stays
    below a third of it; long contexts, which exhaust the word list, repeat the others more (the common frequency
    then stays at least three times theirs). ``meta`` records both frequencies.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: ignored (no needle).
        seed: fixes the words and the order. n_common: how many words to find.

    Returns:
        A :class:`Sample` whose answers are the common words; ``depth`` is None.
    """
    _check_args(n_tokens, depth)
    rng = _rng("common_words", seed)
    words = list(_WORDS)
    rng.shuffle(words)
    # A common word inside another word ("pine" in "spine") would let a wrong prediction score.
    common = list(islice((w for w in words if not any(w in o for o in _WORDS if o != w)), n_common))
    others = [w for w in words if w not in common]
    head = _count(tokenizer, [_CWE_HEADER])[0]
    cost = dict(zip(words, _count(tokenizer, [" " + w for w in words])))
    num = [0]  # num[e]: tokens of the labels " 1." ... " e.", counted in chunks as far as needed

    def labels(e):
        while len(num) <= e:
            chunk = _count(tokenizer, [f" {i}." for i in range(len(num), len(num) + 1024)])
            num.extend(list(accumulate(chunk, initial=num[-1]))[1:])
        return num[e]

    avg_word = sum(cost.values()) / len(cost)
    entries = 1
    while head + labels(entries) + entries * avg_word < n_tokens:
        entries += 1
    freq_cw = min(30, max(2, int(0.4 * entries / n_common)))
    freq_ucw = max(1, min(3, freq_cw // 3), -(-(entries - n_common * freq_cw) // len(others)))
    other_cost = [0] + list(accumulate(cost[w] for w in others))
    common_cost = sum(cost[w] for w in common)

    def total(k):  # tokens of the context with the first k other words (token counts of the parts add up)
        return head + labels(n_common * freq_cw + k * freq_ucw) + freq_cw * common_cost + freq_ucw * other_cost[k]

    while True:
        freq_cw = max(freq_cw, 3 * freq_ucw)
        if total(0) > 1.02 * n_tokens:
            raise ValueError(f"n_tokens={n_tokens} is too small for common_words (its shortest list takes "
                             f"{total(0)} tokens): use a longer length")
        k = 0
        while k < len(others) and total(k + 1) <= n_tokens:
            k += 1
        if k < len(others) or total(k) >= 0.99 * n_tokens:
            break
        freq_ucw += 1  # the word list ran out: repeat the other words more
    if k < len(others) and total(k + 1) - n_tokens < n_tokens - total(k):
        k += 1
    listed = common * freq_cw + others[:k] * freq_ucw
    rng.shuffle(listed)
    context = _CWE_HEADER + " ".join(f"{i}. {w}" for i, w in enumerate(listed, 1))
    n = _count(tokenizer, [context])[0]
    if abs(n - n_tokens) > 0.02 * n_tokens:
        raise ValueError(f"n_tokens={n_tokens}: could not fit the context within 2% (got {n} tokens): use a "
                         "longer length")
    question = f"What are the {n_common} most common words in the list above? Answer with the words only."
    return Sample("common_words", context, question, common,
                  f"The top {n_common} words that appear most often in the list are:", None, n, seed, 96,
                  {"freq_common": freq_cw, "freq_uncommon": freq_ucw, "n_uncommon_words": k})
