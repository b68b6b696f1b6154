"""The haystack every generated task hides its needles in, the word lists behind it, and needle placement.

Sentences are drawn independently from word lists, so no span of text is a copy of another (a repeated essay makes
retrieval too easy and blurs where the needle is). They hold no digits, no capitals but "The" and none of the key
words (`_WORDS`), so an answer cannot appear in the haystack by accident.
"""

from __future__ import annotations

import bisect
import math
import random
import re
from itertools import accumulate

from .sample import _count

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


# Generated contexts from this many tokens on fit within 2% (shorter ones may not: sentences are a few tokens each).
SAFE_TOKENS = 200


def _assemble(tokenizer, n_tokens: int, rng: random.Random, header: str, needles: list[str],
              depths: list[float]) -> tuple[str, int, list[float]]:
    """Haystack of `n_tokens` with each needle at the sentence boundary nearest its requested depth.

    Needles are placed in order of requested depth (ties keep list order, so a chain stays in order).
    Returns ``(context, token count, measured depth of each needle)``.
    """
    head = _count(tokenizer, [header])[0] if header else 0
    sizes = _count(tokenizer, [" " + s for s in needles])
    if n_tokens < 1.1 * (head + sum(sizes)) + 16:
        # Below SAFE_TOKENS a context may not fit within 2% (sentences are a few tokens each): advise that much.
        least = max(SAFE_TOKENS, math.ceil(1.1 * (head + sum(sizes)) + 16))
        raise ValueError(f"n_tokens={n_tokens} is too small for this task (header and needles take "
                         f"{head + sum(sizes)} tokens): use at least {least} tokens")
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
    if abs(n - n_tokens) > 0.02 * n_tokens:  # short contexts: the sentences are too coarse to land within 2%
        raise ValueError(f"n_tokens={n_tokens}: could not fit the context within 2% (got {n} tokens): use a "
                         f"longer length (at least {SAFE_TOKENS} tokens)")
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
