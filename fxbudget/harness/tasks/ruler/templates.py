"""RULER's strings and per-task settings, in one place: templates, answer prefixes, generation lengths, the needle and
noise formats, the 13 task configurations, the metric of each family, and the question markers kvpress splits on.

Every string here is data transcribed from its source, character for character; the source is named beside it:
- ``scripts/data/synthetic/constants.py`` of NVIDIA/RULER (templates, answer prefixes, ``tokens_to_generate``);
- ``scripts/synthetic.yaml`` of NVIDIA/RULER (the 13 tasks and their arguments);
- ``scripts/eval/synthetic/constants.py`` of NVIDIA/RULER (the metric of each family);
- ``scripts/data/synthetic/niah.py``, ``variable_tracking.py``, ``qa.py`` of NVIDIA/RULER (needle, noise, document);
- ``evaluation/benchmarks/ruler/create_huggingface_dataset.py`` of NVIDIA/kvpress (question markers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    """One of RULER's generator scripts: its prompt template (with ``{context}`` and ``{query}``), the answer prefix
    RULER appends to it (with its leading space), how many tokens RULER lets the model generate, its metric, and the
    marker where kvpress cuts the question off the context (the last match in the prompt)."""

    template: str
    answer_prefix: str
    tokens_to_generate: int
    metric: str
    question_marker: re.Pattern
    answer_marker: re.Pattern


# RULER scripts/data/synthetic/constants.py (TASKS) + scripts/eval/synthetic/constants.py (metric_fn) + kvpress
# evaluation/benchmarks/ruler/create_huggingface_dataset.py (QUESTION_PATTERNS, ANSWER_PATTERNS).
FAMILIES: dict[str, Family] = {
    "niah": Family(
        template="Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?",
        answer_prefix=" The special magic {type_needle_v} for {query} mentioned in the provided text are",
        tokens_to_generate=128, metric="string_match_all",
        question_marker=re.compile(r"What (?:is|are all) the special magic"),
        answer_marker=re.compile(r"The special magic")),
    "variable_tracking": Family(
        template="Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
                 "Question: Find all variables that are assigned the value {query} in the text above.",
        answer_prefix=" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                      "are assigned the value {query}, they are: ",
        tokens_to_generate=30, metric="string_match_all",
        question_marker=re.compile(r"Question: Find all variables that are assigned the value"),
        answer_marker=re.compile(r"Answer:")),
    "common_words_extraction": Family(
        template="Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                 "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                 "list?",
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
        tokens_to_generate=120, metric="string_match_all",
        question_marker=re.compile(r"Question: What are the 10 most common words in the above list\?"),
        answer_marker=re.compile(r"Answer:")),
    "freq_words_extraction": Family(
        template="Read the following coded text and track the frequency of each coded word. Find the three most "
                 "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                 "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        answer_prefix=" Answer: According to the coded text above, the three most frequently appeared words are:",
        tokens_to_generate=50, metric="string_match_all",
        question_marker=re.compile(r"Question: Do not provide any explanation\."),
        answer_marker=re.compile(r"Answer:")),
    "qa": Family(
        template="Answer the question based on the given documents. Only give me the answer and do not output any "
                 "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
                 "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        answer_prefix=" Answer:",
        tokens_to_generate=32, metric="string_match_part",
        question_marker=re.compile(r"Answer the question based on the given documents\."),
        answer_marker=re.compile(r"Answer:")),
}

# RULER scripts/data/synthetic/niah.py: the needle, and the noise haystack (also variable_tracking.py's).
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# RULER scripts/data/synthetic/qa.py
DOCUMENT_PROMPT = "Document {i}:\n{document}"
# RULER niah.py / variable_tracking.py: DEPTHS = np.round(np.linspace(0, 100, num=40)).astype(int) (no .5 ties).
DEPTHS = tuple(round(100 * i / 39) for i in range(40))


@dataclass(frozen=True)
class Config:
    """One of RULER's 13 tasks: its family (generator script) and the arguments ``scripts/synthetic.yaml`` gives it."""

    family: str
    args: dict = field(default_factory=dict)


def _niah(haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> Config:
    return Config("niah", {"type_haystack": haystack, "type_needle_k": k, "type_needle_v": v, "num_needle_k": nk,
                           "num_needle_v": nv, "num_needle_q": nq})


# RULER scripts/synthetic.yaml, in its order.
CONFIGS: dict[str, Config] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", nk=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", nv=4),
    "niah_multiquery": _niah("essay", "words", "numbers", nq=4),
    "vt": Config("variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}),
    "cwe": Config("common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": Config("freq_words_extraction", {"alpha": 2.0}),
    "qa_1": Config("qa", {"dataset": "squad"}),
    "qa_2": Config("qa", {"dataset": "hotpotqa"}),
}


def needs_files(task: str) -> tuple[str, ...]:
    """The user's data files a RULER task reads (RULER's names): essays for an essay haystack, SQuAD / HotpotQA."""
    args = CONFIGS[task].args
    if args.get("type_haystack") == "essay":
        return ("PaulGrahamEssays.json",)
    if "dataset" in args:
        return (f"{args['dataset']}.json",)
    return ()
