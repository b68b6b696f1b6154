"""RULER's question answering (``scripts/data/synthetic/qa.py``, tasks ``qa_1`` on SQuAD 2.0 and ``qa_2`` on
HotpotQA): the question's own documents among distractor documents of the same set; scored ``string_match_part``."""

from __future__ import annotations

import random

from ..sample import _check_args
from .data import data_file, hotpotqa, squad
from .fit import fit, to_sample
from .templates import CONFIGS, DOCUMENT_PROMPT, FAMILIES

_FAMILY = FAMILIES["qa"]
_READERS = {"squad": squad, "hotpotqa": hotpotqa}


def documents(qa: dict, docs: list[str], num_docs: int, rng: random.Random) -> list[str]:
    """RULER's choice of `num_docs` documents: the question's own, then its article's others (SQuAD), then random
    others; all of them, repeated, past the set's size; shuffled."""
    own, more = qa["context"], qa.get("more_context", [])
    if num_docs < len(docs):
        if num_docs - len(own) > len(more):
            taken = set(own + more)
            others = [i for i in range(len(docs)) if i not in taken]
            chosen = own + more + rng.sample(others, max(0, num_docs - len(own) - len(more)))
        else:
            chosen = own + rng.sample(more, num_docs - len(own))
        picked = [docs[i] for i in chosen]
    else:
        picked = (docs * -(-num_docs // len(docs)))[:num_docs]
    rng.shuffle(picked)
    return picked


def generator(name: str):
    args = CONFIGS[name].args
    task = f"ruler:{name}"
    dataset = args["dataset"]

    def generate(tokenizer, n_tokens: int, *, depth: float = 0.5, seed: int = 0, data_dir=None):
        _check_args(n_tokens, depth)
        qas, docs = _READERS[dataset](data_file(f"{dataset}.json", task, data_dir), task)
        index = seed % len(qas)  # RULER: sample i asks question i
        qa = qas[index]

        def prompt(k):
            picked = documents(qa, docs, k, random.Random(f"{task}:{seed}:{k}"))
            context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(picked))
            return _FAMILY.template.format(context=context, query=qa["query"]) + _FAMILY.answer_prefix

        k, text, _ = fit(prompt, tokenizer, n_tokens, _FAMILY.tokens_to_generate, 10, task)
        return to_sample(task, "qa", text, _FAMILY.answer_prefix, qa["outputs"], tokenizer, n_tokens, seed,
                         {"dataset": dataset, "question_index": index, "n_docs": k})

    generate.__name__ = generate.__qualname__ = name
    generate.__doc__ = (f"RULER's {name}: question answering on {dataset} (scripts/synthetic.yaml); sample `seed` asks "
                        f"question `seed % len(questions)`; `data_dir`: where {dataset}.json is (default "
                        "$FXBUDGET_RULER_DATA). `depth` is ignored.")
    return generate
