"""RULER's random needles and word lists: 7-digit numbers, ``adjective-noun`` words and UUIDs (``niah.py``), and the
noun + adjective + verb list of common-words extraction (``common_words_extraction.py``), both from the
`wonderwords` package's lists as RULER reads them."""

from __future__ import annotations

import random
import uuid
from functools import lru_cache


@lru_cache(maxsize=None)
def wonderwords(name: str) -> tuple[str, ...]:
    """One of wonderwords' lists (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``), one word a line, as
    ``wonderwords.random_word._get_words_from_text_file`` reads it (RULER's call).

    Raises:
        ValueError: wonderwords is not installed (a dependency of flexbudget: reinstall it).
    """
    try:
        from importlib.resources import files
        text = files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise ValueError("RULER's words come from the wonderwords package, which is not installed: "
                         "pip install wonderwords") from None
    return tuple(line.rstrip() for line in text.splitlines(keepends=True))


@lru_cache(maxsize=None)
def _distinct(name: str) -> tuple[str, ...]:
    return tuple(sorted(set(wonderwords(name))))


def random_word(rng: random.Random) -> str:
    """An ``adjective-noun`` word, uniform over RULER's ``sorted(set(f"{adj}-{noun}" ...))`` (drawn as an adjective
    and a noun, each uniform over its distinct words: the same distribution without building the 6-million list)."""
    return f"{rng.choice(_distinct('adjectivelist.txt'))}-{rng.choice(_distinct('nounlist.txt'))}"


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_needle(kind: str, rng: random.Random) -> str:
    """A key or value of RULER's ``type_needle_k`` / ``type_needle_v``: ``numbers``, ``words`` or ``uuids``."""
    if kind == "numbers":
        return random_number(rng)
    if kind == "words":
        return random_word(rng)
    if kind == "uuids":
        return random_uuid(rng)
    raise ValueError(f"unknown needle type {kind!r}; RULER's are numbers, words, uuids")


@lru_cache(maxsize=None)
def common_words() -> tuple[str, ...]:
    """``sorted(set(nouns + adjs + verbs))``: the list RULER's common-words extraction draws from (it shuffles it
    with its seed; a sample here draws from it with its own generator)."""
    return tuple(sorted(set(wonderwords("nounlist.txt") + wonderwords("adjectivelist.txt")
                            + wonderwords("verblist.txt"))))
