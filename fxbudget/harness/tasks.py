"""Synthetic long-context tasks for the comparison harness: offline, seeded and deterministic.

The families follow RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv:2404.06654): needle-in-a-haystack retrieval (single, multi-key, multi-value, multi-query), multi-hop
variable tracking and common-words extraction, plus the classic passkey (Mohtashami & Jaggi 2023). Every generator is
``fn(tokenizer, n_tokens, *, depth=0.5, seed=0) -> Sample``; its context is ``n_tokens`` tokens of that tokenizer
(within 2%), and the same arguments give the same sample on every machine (per-sample seeded :mod:`random`, nothing
downloaded). :func:`load_jsonl` reads user tasks, :func:`score` is RULER's ``string_match_all``, and :func:`chat_ids`
turns a sample into the token ids the runner prefills.

The haystack is built from sentences drawn independently from word lists, so no span of text is a copy of another (a
repeated essay makes retrieval too easy and blurs where the needle is). It holds no digits, no capitals but "The" and
none of the key words, so an answer cannot appear in it by accident.
"""

from __future__ import annotations

import bisect
import json
import random
import re
from dataclasses import dataclass, field
from itertools import accumulate, islice
from pathlib import Path
from typing import Callable

_ADJ = ("quiet", "distant", "copper", "narrow", "ancient", "bright", "hollow", "gentle", "crooked", "silver", "amber",
        "restless", "frozen", "velvet", "faded", "patient", "brisk", "humble", "tangled", "lofty", "dusty", "golden",
        "misty", "rusty", "sunlit", "weathered", "wooden", "marble", "crimson", "slender")
_NOUN = ("river", "lantern", "orchard", "library", "harbor", "meadow", "engine", "violin", "glacier", "market",
         "bridge", "garden", "tower", "forest", "canal", "workshop", "island", "valley", "museum", "station",
         "cathedral", "lighthouse", "vineyard", "courtyard", "quarry", "chapel", "fountain", "windmill", "pasture",
         "balcony")
_VERB = ("watches", "follows", "shelters", "crosses", "remembers", "outlasts", "reflects", "surrounds", "greets",
         "ignores", "measures", "echoes", "borders", "feeds", "guards", "faces", "overlooks", "resembles", "shadows",
         "frames")
_TAIL = ("at dawn", "in winter", "after the rain", "every evening", "without a sound", "for many years",
         "under a grey sky", "before the market opens", "when the wind turns", "as the tide recedes",
         "long after midnight", "through the long summer", "beneath the old clouds", "in the pale morning light",
         "while the town sleeps", "at the turn of the season")
_REST = ("rests", "waits", "sleeps", "glows", "hums", "sways", "stands")  # short sentences fill the last few tokens

_NIAH_HEADER = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards.\n")
_VT_HEADER = "Memorize and track the chain of variable assignments hidden in the following text.\n"
_CWE_HEADER = ("Below is a numbered list of words. In these words, some appear more often than others. "
               "Memorize the ones that appear most often.\n")

# Key words (needle keys, common-words lists): ordinary English words that never occur in the haystack or a header.
_RAW_WORDS = """
apple banana cherry grape lemon mango melon peach pear plum olive onion carrot potato tomato pepper garlic ginger honey
butter cheese bread cookie muffin pancake noodle pasta pizza salad soup sugar coffee juice cream yogurt cereal basket
bottle bucket candle carpet chair clock cushion drawer envelope eraser feather folder hammer helmet jacket kettle
ladder magnet mirror napkin needle notebook paddle pencil pillow plate pocket puzzle ribbon rocket saddle scissors
shovel spoon stapler suitcase sweater teapot ticket towel trumpet umbrella wallet whistle window zipper anchor arrow
badge banner barrel beacon blanket bonnet bracelet brush cabinet camera canvas cargo carriage castle cellar chimney
compass cottage crayon crown curtain dagger desk diamond doorbell dragon drum emerald fabric fence flute furnace gadget
gallery garage goblet guitar hammock harp hatchet hinge jewel kayak keyboard kitchen knife lamp lemonade locket
mailbox mantle mask medal microscope mitten monitor mountain mural necklace oven parcel parrot passport pebble pendant
piano pottery pulley quill quilt radio raft railing robot rope ruler sandal satchel scarf sculpture shelf shield sled
slipper sofa spade spindle sponge staircase statue stove sword tablet telescope tent thimble throne torch tractor
trophy tunnel vase wagon wheel whisk wrench yacht badger beaver buffalo camel cheetah cobra donkey dolphin eagle
falcon ferret flamingo gazelle giraffe goose gorilla hamster hedgehog heron hippo jaguar kangaroo koala lemur leopard
lizard llama lobster macaw meerkat monkey moose octopus ostrich otter panda panther pelican penguin pigeon puffin
rabbit raccoon raven rhino salmon shark sheep sloth snail spider squid squirrel stork swan tiger toucan turkey turtle
walrus weasel whale zebra acorn blossom boulder breeze canyon cactus cliff coral crater daisy desert dune fern field
flower geyser gravel iceberg jungle lagoon lily maple marsh moss oasis ocean pine pond prairie rainbow reef ridge
shore snow spruce storm stream summit sunrise sunset swamp thunder tulip volcano waterfall willow adventure answer
balance bargain battle beauty birthday blessing bravery breakfast budget business calendar campaign capital career
celebration century challenge champion chapter charity circle climate comfort comedy concert contest corner courage
culture custom danger debate decision degree delight design detail dinner discovery doctor dream effort election
energy example exercise factory family fashion festival fiction figure finance flavor freedom friend future galaxy
gesture glory habit harvest health history holiday honor hunger idea image impact industry insect instinct journey
justice kingdom knowledge language laughter legend leisure letter liberty lunch machine mammal manner marriage meeting
memory message method miracle mission moment motion music mystery nation nature network notion object office opinion
option orbit origin palette panic parade pattern peace people picture pilot planet pleasure poetry portrait power
prayer present process product promise purpose quality question rhythm riddle safety salary science secret signal
silence sketch society soldier spirit sport statement story strategy student success surprise symbol talent teacher
theory tradition traffic treasure triumph trouble truth victory village vision visitor volume voyage weather wedding
wisdom wonder worker writer youth absorb admire adopt arrange bounce breathe build calculate capture carry celebrate
chase collect compose construct decorate deliver discover elevate embrace explore gather giggle hover imagine invent
juggle knit launch listen mingle nibble observe polish ponder quiver relax rescue sail scatter sculpt shimmer skate
sparkle splash sprint stretch swim travel tumble unfold wander whisper wiggle yawn agile bashful bold brave calm
cheerful clever cozy curious daring eager elegant fancy fierce fluffy fragile friendly fuzzy giant glossy graceful
grumpy happy hasty jolly jumpy keen lively lucky majestic merry mighty modest nimble noble plucky polite proud rapid
rowdy shiny silly sleepy smooth snug sturdy swift tender tidy tiny vivid witty zesty
"""
_RESERVED = set(re.findall(r"[a-z]+", " ".join(_ADJ + _NOUN + _VERB + _TAIL + _REST).lower()
                           + (_NIAH_HEADER + _VT_HEADER + _CWE_HEADER).lower()))
_WORDS = tuple(sorted(set(_RAW_WORDS.split()) - _RESERVED))  # sorted: the same order whatever the set hashing


def haystack_sentence(rng: random.Random) -> str:
    """One haystack sentence (about 15 tokens) drawn from the word lists."""
    return (f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} the {rng.choice(_ADJ)} "
            f"{rng.choice(_NOUN)} {rng.choice(_TAIL)}.")


@dataclass
class Sample:
    """One prompt: `context` then `question`; the assistant turn starts with `answer_prefix`."""

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


class _Haystack:
    """Seeded streams of full and short sentences, token-counted in batches (one tokenizer call per batch is fast,
    one per sentence or per trial context is not). Filling a budget twice replays the same streams."""

    def __init__(self, tokenizer, seed: int):
        self.tok, self.rng, self.short_rng = tokenizer, random.Random(seed), random.Random(seed + 1)
        self.sents, self.counts, self.shorts, self.short_counts = [], [], [], []

    def fill(self, budget: int) -> tuple[list[str], list[int]]:
        while sum(self.counts) < budget:
            new = [haystack_sentence(self.rng) for _ in range(max(16, (budget - sum(self.counts)) // 12))]
            self.sents += new
            self.counts += _count(self.tok, [" " + s for s in new])
        n = bisect.bisect_right(list(accumulate(self.counts)), budget)
        sents, counts = self.sents[:n], self.counts[:n]
        left, i = budget - sum(counts), 0
        while True:  # short sentences close the gap to within a few tokens (a full one is ~15)
            if i == len(self.shorts):
                new = [f"The {self.short_rng.choice(_NOUN)} {self.short_rng.choice(_REST)}." for _ in range(8)]
                self.shorts += new
                self.short_counts += _count(self.tok, [" " + s for s in new])
            if self.short_counts[i] > left:
                return sents, counts
            sents.append(self.shorts[i])
            counts.append(self.short_counts[i])
            left -= self.short_counts[i]
            i += 1


def _assemble(tokenizer, n_tokens: int, rng: random.Random, header: str, needles: list[str],
              depths: list[float]) -> tuple[str, int, list[float]]:
    """Haystack of `n_tokens` with each needle at the sentence boundary nearest its requested depth.

    Needles are placed in order of requested depth (ties keep list order, so a chain stays in order).
    Returns ``(context, token count, measured depth of each needle)``.
    """
    head = _count(tokenizer, [header])[0] if header else 0
    sizes = _count(tokenizer, [" " + s for s in needles])
    if n_tokens < 1.1 * (head + sum(sizes)) + 16:
        raise ValueError(f"n_tokens={n_tokens} is too small for this task (header and needles take "
                         f"{head + sum(sizes)} tokens)")
    hay = _Haystack(tokenizer, rng.getrandbits(64))
    order = sorted(range(len(needles)), key=lambda i: depths[i])
    budget = n_tokens - head - sum(sizes)
    for _ in range(3):  # token counts of parts add up for BPE tokenizers; the retry is for ones where they don't
        sents, counts = hay.fill(budget)
        items, pending, used = [], list(order), head
        for s, c in zip(sents + [None], counts + [0]):
            # Emit a needle before this sentence if that boundary is nearer its target than the next one.
            while pending and (s is None or abs(depths[pending[0]] * n_tokens - used)
                               <= abs(depths[pending[0]] * n_tokens - used - c)):
                items.append(pending[0])
                used += sizes[pending.pop(0)]
            if s is not None:
                items.append(s)
                used += c
        parts = [needles[x] if isinstance(x, int) else x for x in items]
        context = header + " ".join(parts)
        enc = tokenizer(context, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
        n = len(enc["input_ids"])
        if abs(n - n_tokens) <= 0.01 * n_tokens:
            break
        budget += n_tokens - n
    if abs(n - n_tokens) > 0.02 * n_tokens:
        raise RuntimeError(f"could not fit the context to {n_tokens} tokens (got {n})")
    starts, pos = {}, len(header)
    for x, part in zip(items, parts):
        if isinstance(x, int):
            starts[x] = pos
        pos += len(part) + 1
    if tokenizer.is_fast:  # offset of a needle = index of the first token ending after its first character
        ends = [e for _, e in enc["offset_mapping"]]
        offsets = {i: bisect.bisect_right(ends, c) for i, c in starts.items()}
    else:
        offsets = {i: _count(tokenizer, [context[:c].rstrip(" ")])[0] for i, c in starts.items()}
    return context, n, [offsets[i] / n for i in range(len(needles))]


def passkey(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """Passkey retrieval (Mohtashami & Jaggi 2023; RULER's simplest NIAH): a 5-digit key at `depth` in a haystack.

    The needle states the key twice ("The pass key is K. Remember it. K is the pass key."), as in the original.

    Args:
        tokenizer: a Hugging Face tokenizer; lengths are counted in its tokens.
        n_tokens: context length in tokens (met within 2%).
        depth: requested needle position, 0 = start, 1 = end.
        seed: fixes the haystack and the key.

    Returns:
        A :class:`Sample` with ``answers == [key]`` and the measured depth.
    """
    _check_args(n_tokens, depth)
    rng = _rng("passkey", seed)
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    context, n, (measured,) = _assemble(tokenizer, n_tokens, rng, "", [needle], [depth])
    _check_count(context, key, 2)
    return Sample("passkey", context, "What is the pass key? Answer with the number only.", [key],
                  "The pass key is", measured, n, seed, 16,
                  {"requested_depth": depth, "needles": [{"text": needle, "depth": measured}]})


def _niah(task, tokenizer, n_tokens, depth, seed, rng, pairs, depths, asked, answers, meta) -> Sample:
    """NIAH sample from (key, value) needles; `asked` are the keys the question names."""
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in pairs]
    context, n, measured = _assemble(tokenizer, n_tokens, rng, _NIAH_HEADER, needles, depths)
    for _, v in pairs:
        _check_count(context, v)
    keys = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    if len(answers) == 1:
        question = f"What is the special magic number for {keys} mentioned in the provided text? " \
                   "Answer with the number only."
        prefix = f"The special magic number for {keys} mentioned in the provided text is"
    else:
        question = f"What are all the special magic numbers for {keys} mentioned in the provided text? " \
                   "Answer with the numbers only."
        prefix = f"The special magic numbers for {keys} mentioned in the provided text are"
    meta = {"requested_depth": depth, **meta,
            "needles": [{"text": t, "key": k, "value": v, "depth": d}
                         for t, (k, v), d in zip(needles, pairs, measured)]}
    return Sample(task, context, question, answers, prefix, measured[0], n, seed, 16 if len(answers) == 1 else 64,
                  meta)


def _numbers(rng: random.Random, k: int) -> list[str]:
    return [str(x) for x in rng.sample(range(1_000_000, 10_000_000), k)]  # distinct 7-digit: none inside another


def _near(depth: float, offsets) -> list[float]:
    return [depth + o if 0 <= depth + o <= 1 else depth - o for o in offsets]


def niah_single(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """RULER NIAH single (Hsieh et al. 2024, arXiv:2404.06654): one "special magic number" needle at `depth`.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: needle position in [0, 1].
        seed: fixes haystack, key word and 7-digit number.

    Returns:
        A :class:`Sample` whose one answer is the number; ``depth`` is the needle's measured depth.
    """
    _check_args(n_tokens, depth)
    rng = _rng("niah_single", seed)
    key, value = rng.choice(_WORDS), _numbers(rng, 1)[0]
    return _niah("niah_single", tokenizer, n_tokens, depth, seed, rng, [(key, value)], [depth], [key], [value], {})


def niah_multikey(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """RULER NIAH multi-key: the asked needle at `depth` plus 3 distractor needles (other keys, other numbers).

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: asked needle's position.
        seed: fixes haystack, keys, numbers and the distractors' depths (at least 0.1 away from `depth`).

    Returns:
        A :class:`Sample` whose one answer is the asked key's number; ``meta["distractors"]`` lists the others.
    """
    _check_args(n_tokens, depth)
    rng = _rng("niah_multikey", seed)
    keys, values = rng.sample(_WORDS, 4), _numbers(rng, 4)
    depths = [depth]
    while len(depths) < 4:
        d = rng.random()
        if abs(d - depth) >= 0.1:
            depths.append(d)
    distractors = [{"key": k, "value": v, "requested_depth": d} for k, v, d in zip(keys[1:], values[1:], depths[1:])]
    return _niah("niah_multikey", tokenizer, n_tokens, depth, seed, rng, list(zip(keys, values)), depths, keys[:1],
                 values[:1], {"distractors": distractors})


def niah_multivalue(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """RULER NIAH multi-value: 4 needles with the same key and different numbers, at `depth` and 0.05-0.1 around it.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: first needle's position.
        seed: fixes haystack, key and numbers.

    Returns:
        A :class:`Sample` whose answers are the 4 numbers; ``depth`` is the first needle's measured depth.
    """
    _check_args(n_tokens, depth)
    rng = _rng("niah_multivalue", seed)
    key, values = rng.choice(_WORDS), _numbers(rng, 4)
    return _niah("niah_multivalue", tokenizer, n_tokens, depth, seed, rng, [(key, v) for v in values],
                 _near(depth, (0, 0.05, -0.05, 0.1)), [key], values, {})


def niah_multiquery(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> Sample:
    """RULER NIAH multi-query: 4 needles with different keys, one per quarter of the context; all 4 are asked.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: first needle's position; the
            others follow at `depth` + 0.25, 0.5, 0.75 (wrapped into [0, 1)).
        seed: fixes haystack, keys and numbers.

    Returns:
        A :class:`Sample` whose answers are the 4 numbers, in the order the question names their keys.
    """
    _check_args(n_tokens, depth)
    rng = _rng("niah_multiquery", seed)
    keys, values = rng.sample(_WORDS, 4), _numbers(rng, 4)
    depths = [depth] + [(depth + k / 4) % 1.0 for k in (1, 2, 3)]
    return _niah("niah_multiquery", tokenizer, n_tokens, depth, seed, rng, list(zip(keys, values)), depths, keys,
                 values, {})


def variable_tracking(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, hops: int = 4) -> Sample:
    """RULER variable tracking (multi-hop): "VAR A = 12345." then "VAR B = VAR A." ... spread through the haystack.

    Args:
        tokenizer: counts tokens. n_tokens: context length (within 2%). depth: position of the first assignment;
            the `hops` later ones follow in order, evenly between it and the end.
        seed: fixes haystack, value and variable names (5 capital letters).

    Returns:
        A :class:`Sample` whose answers are the ``hops + 1`` variable names holding the value.
    """
    _check_args(n_tokens, depth)
    rng = _rng("variable_tracking", seed)
    value, names = str(rng.randint(10000, 99999)), []
    while len(names) < hops + 1:
        name = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5))
        if name not in names and name.lower() not in _RESERVED:
            names.append(name)
    needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = [depth + (1 - depth) * k / (hops + 1) for k in range(hops + 1)]
    context, n, measured = _assemble(tokenizer, n_tokens, rng, _VT_HEADER, needles, depths)
    _check_count(context, value)
    question = f"Find all variables that are assigned the value {value} in the text above. " \
               "Answer with the variable names only."
    prefix = (f"According to the chain of variable assignments in the text above, {hops + 1} variables are "
              f"assigned the value {value}, they are:")
    return Sample("variable_tracking", context, question, names, prefix, measured[0], n, seed, 32,
                  {"requested_depth": depth, "needles": [{"text": t, "depth": d} for t, d in zip(needles, measured)]})


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
            raise ValueError(f"n_tokens={n_tokens} is too small for common_words")
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
        raise RuntimeError(f"could not fit the context to {n_tokens} tokens (got {n})")
    question = f"What are the {n_common} most common words in the list above? Answer with the words only."
    return Sample("common_words", context, question, common,
                  f"The top {n_common} words that appear most often in the list are:", None, n, seed, 96,
                  {"freq_common": freq_cw, "freq_uncommon": freq_ucw, "n_uncommon_words": k})


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey, "niah_single": niah_single, "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue, "niah_multiquery": niah_multiquery, "variable_tracking": variable_tracking,
    "common_words": common_words,
}
NEEDLE_TASKS: frozenset[str] = frozenset(TASKS) - {"common_words"}


def make_samples(task: str, tokenizer, n_tokens: int, n: int, *, seed: int = 0) -> list[Sample]:
    """`n` samples of `task`; needle depths spread evenly, ``(i + 0.5) / n``, and sample `i` seeded ``seed*1000+i``.

    Raises:
        ValueError: unknown task (the message lists :data:`TASKS`) or `n` not a positive int.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    depth = (lambda i: (i + 0.5) / n) if task in NEEDLE_TASKS else (lambda i: 0.5)
    return [TASKS[task](tokenizer, n_tokens, depth=depth(i), seed=seed * 1000 + i) for i in range(n)]


def load_jsonl(path, tokenizer=None) -> list[Sample]:
    """User tasks: one JSON object per line with `context`, `question`, `answer` (a string or a list of strings)
    and optionally `answer_prefix` and `max_new_tokens`; other fields go to ``meta``. Blank lines are skipped.

    Args:
        path: the ``.jsonl`` file; its stem names the task.
        tokenizer: if given, ``n_tokens`` of each sample is its context's token count.

    Raises:
        ValueError: naming the file and line of a line that is not a JSON object or lacks / mistypes a field.
    """
    path, samples = Path(path), []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for name in ("context", "question", "answer"):
            if name not in row:
                raise ValueError(f"{where}: missing field {name!r}")
        answers = [row["answer"]] if isinstance(row["answer"], str) else row["answer"]
        if not (isinstance(answers, list) and answers and all(isinstance(a, str) and a for a in answers)):
            raise ValueError(f"{where}: 'answer' must be a non-empty string or a non-empty list of them")
        for name in ("context", "question", "answer_prefix"):
            if not isinstance(row.get(name, ""), str):
                raise ValueError(f"{where}: {name!r} must be a string")
        max_new = row.get("max_new_tokens", 32)
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new <= 0:
            raise ValueError(f"{where}: 'max_new_tokens' must be a positive int")
        meta = {k: v for k, v in row.items()
                if k not in ("context", "question", "answer", "answer_prefix", "max_new_tokens")}
        samples.append(Sample(path.stem, row["context"], row["question"], answers, row.get("answer_prefix", ""),
                              None, _count(tokenizer, [row["context"]])[0] if tokenizer is not None else 0,
                              0, max_new, {"line": lineno, **meta}))
    if not samples:
        raise ValueError(f"{path}: no samples")
    return samples


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
