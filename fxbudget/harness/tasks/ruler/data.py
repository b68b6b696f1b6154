"""The user's local files that some RULER tasks read, found by name in one folder, parsed as RULER parses them.

RULER downloads them (``scripts/data/synthetic/json/download_paulgraham_essay.py`` and ``download_qa_dataset.sh``);
nothing is downloaded here. Point ``FXBUDGET_RULER_DATA`` (or the generators' ``data_dir``) at a folder holding
RULER's files under RULER's names:

- ``PaulGrahamEssays.json``: ``{"text": ...}``, the essay haystack (niah_single_2/3, niah_multikey_1,
  niah_multivalue, niah_multiquery);
- ``squad.json``: SQuAD 2.0 dev (``dev-v2.0.json``), for qa_1;
- ``hotpotqa.json``: HotpotQA dev distractor (``hotpot_dev_distractor_v1.json``), for qa_2;
- ``english_words.json`` (optional): RULER's word list, read only when common-words extraction needs more words than
  wonderwords has (contexts of about 100K tokens).
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

ENV = "FXBUDGET_RULER_DATA"


def data_file(name: str, task: str, data_dir=None) -> Path:
    """The path of RULER's file `name` in `data_dir` (default: ``$FXBUDGET_RULER_DATA``).

    Raises:
        ValueError: one line naming the task, the file and where it was looked for.
    """
    where = data_dir if data_dir is not None else os.environ.get(ENV)
    if not where:
        raise ValueError(f"{task} needs RULER's {name}, which cannot be downloaded here: set {ENV} to a folder "
                         f"holding it")
    path = Path(where).expanduser() / name
    if not path.is_file():
        raise ValueError(f"{task} needs RULER's {name}: {path} is not there")
    return path


def _load_json(path: Path, task: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{task}: {path} is not a readable JSON file ({e})") from None


@lru_cache(maxsize=4)
def essay_words(path: Path, task: str) -> tuple[str, ...]:
    """RULER's essay haystack: the essays' text with every run of whitespace made one space, split on spaces."""
    data = _load_json(path, task)
    if not isinstance(data, dict) or not isinstance(data.get("text"), str) or not data["text"].strip():
        raise ValueError(f"{task}: {path} must be a JSON object with a non-empty 'text' (RULER's essay file)")
    return tuple(re.sub(r"\s+", " ", data["text"]).split(" "))


@lru_cache(maxsize=4)
def squad(path: Path, task: str):
    """RULER's ``read_squad``: (questions, documents); each question has ``query``, ``outputs`` (every answer),
    ``context`` (its paragraph's index) and ``more_context`` (the article's other paragraphs); impossible questions
    are left out; documents are the distinct paragraphs, sorted."""
    data = _load_json(path, task)
    try:
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data["data"]:
            more = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        own = index[p["context"]]
                        qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                    "context": [own], "more_context": [i for i in more if i != own]})
    except (KeyError, TypeError) as e:
        raise ValueError(f"{task}: {path} is not SQuAD 2.0 JSON (missing {e})") from None
    if not qas:
        raise ValueError(f"{task}: {path} holds no answerable question")
    return qas, docs


@lru_cache(maxsize=4)
def hotpotqa(path: Path, task: str):
    """RULER's ``read_hotpotqa``: documents are ``f"{title}\\n{''.join(sentences)}"``, distinct and sorted; each
    question's ``context`` is every document of its item (the gold and the distractor paragraphs)."""
    data = _load_json(path, task)
    try:
        docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = [{"query": d["question"], "outputs": [d["answer"]],
                "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{task}: {path} is not HotpotQA JSON ({e})") from None
    if not qas:
        raise ValueError(f"{task}: {path} holds no question")
    return qas, docs


@lru_cache(maxsize=2)
def english_words(path: Path, task: str) -> tuple[str, ...]:
    data = _load_json(path, task)
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{task}: {path} must be a JSON object of words (RULER's english_words.json)")
    return tuple(str(v) for v in data.values())
