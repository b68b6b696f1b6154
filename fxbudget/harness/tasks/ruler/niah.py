"""RULER's needle-in-a-haystack family (``scripts/data/synthetic/niah.py``): 8 of the 13 tasks, as
``scripts/synthetic.yaml`` configures them (haystack noise / essay / needle; keys and values numbers / words /
uuids; several keys, values or queries)."""

from __future__ import annotations

import re

from ..sample import _check_args
from .data import data_file, essay_words
from .fit import fit, rng_for, to_sample
from .templates import CONFIGS, DEPTHS, FAMILIES, NEEDLE, NOISE
from .words import random_needle

# nltk's punkt (RULER's sent_tokenize) needs a download; this splits after . ! ? (optionally followed by a closing
# quote or bracket) and whitespace. Unlike punkt it does not know abbreviations ("Mr. Smith" is two sentences).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")


def split_sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s]


def _needles(task: str, seed: int, args: dict):
    """RULER's keys, values and needle sentences (shuffled), and the asked keys and expected answers, drawn from their
    own generator so that every haystack size tried for this sample hides the same needles."""
    rng = rng_for(task, seed, "needles")
    nk = max(args["num_needle_k"], args["num_needle_q"])
    keys, values, needles = [], [], []
    for _ in range(nk):
        keys.append(random_needle(args["type_needle_k"], rng))
        values.append([random_needle(args["type_needle_v"], rng) for _ in range(args["num_needle_v"])])
        needles += [NEEDLE.format(type_needle_v=args["type_needle_v"], key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    asked = rng.sample(range(nk), args["num_needle_q"])
    queries = [keys[i] for i in asked]
    answers = [a for i in asked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    return needles, query, answers


def _haystack(task: str, seed: int, args: dict, needles: list[str], k: int, essay) -> str:
    rng = rng_for(task, seed, "haystack", k)
    if args["type_haystack"] == "essay":
        words = essay[:k] if k <= len(essay) else (essay * -(-k // len(essay)))[:k]
        sents = split_sentences(" ".join(words).strip())
        cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        return " ".join(parts)
    if args["type_haystack"] == "noise":
        sentences = [NOISE] * k
    else:  # "needle": distractor needles with random keys and values of the task's types
        sentences = [NEEDLE.format(type_needle_v=args["type_needle_v"], key=random_needle(args["type_needle_k"], rng),
                                   value=random_needle(args["type_needle_v"], rng)) for _ in range(k)]
    for index, needle in zip(sorted(rng.sample(range(k), len(needles)), reverse=True), needles):
        sentences.insert(index, needle)
    return "\n".join(sentences)


def _prompt(args: dict, context: str, query: str) -> tuple[str, str]:
    """RULER's template and answer prefix for this configuration: singular wording for one expected answer."""
    family = FAMILIES["niah"]
    template, prefix, kind = family.template, family.answer_prefix, args["type_needle_v"]
    if args["num_needle_q"] * args["num_needle_v"] == 1:  # RULER niah.py's replacements, in its order
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        kind = kind[:-1]
    prefix = prefix.format(type_needle_v=kind, query=query)
    return template.format(type_needle_v=kind, context=context, query=query) + prefix, prefix


def generator(name: str):
    args = CONFIGS[name].args
    task = f"ruler:{name}"

    def generate(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, data_dir=None):
        _check_args(n_tokens, depth)
        essay = essay_words(data_file("PaulGrahamEssays.json", task, data_dir), task) \
            if args["type_haystack"] == "essay" else None
        needles, query, answers = _needles(task, seed, args)
        if args["type_haystack"] == "essay":
            lowest = 500
        else:
            lowest = 5 if n_tokens < 4096 else 25
        k, prompt, _ = fit(lambda k: _prompt(args, _haystack(task, seed, args, needles, k, essay), query)[0],
                           tokenizer, n_tokens, FAMILIES["niah"].tokens_to_generate, lowest, task)
        prefix = _prompt(args, "", query)[1]
        first = next(n for n in needles if n.endswith(f" {answers[0]}."))
        return to_sample(task, "niah", prompt, prefix, answers, tokenizer, n_tokens, seed,
                         {"haystack": args["type_haystack"], "n_haystack": k, "needles": needles, "query": query,
                          "requested_depth": None}, needle=first)

    generate.__name__ = generate.__qualname__ = name
    generate.__doc__ = (f"RULER's {name}: needle-in-a-haystack with {args} (scripts/synthetic.yaml). `depth` is "
                        "ignored: RULER draws the needles' positions at random (the sample's `depth` is measured). "
                        "`data_dir`: where PaulGrahamEssays.json is, for an essay haystack (default "
                        "$FXBUDGET_RULER_DATA).")
    return generate
