"""User task files: one JSON object per line (`--task-file`)."""

from __future__ import annotations

import json
from pathlib import Path

from .sample import Sample, _count

# Every field of a task file line, as `fxbudget compare --help` lists them.
FIELDS = {
    "context": "the text the rule compresses (string)",
    "question": "asked after the context (string)",
    "answer": "an expected answer, or a list of them (each must appear in the output)",
    "answer_prefix": "optional: the start of the assistant's turn (string, default empty)",
    "max_new_tokens": "optional: the answer's length limit (positive int, default 32)",
}


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
