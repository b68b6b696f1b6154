"""Task generators against the embedded model's real tokenizer: answers, lengths, depths, determinism, scoring."""

import collections
import json
import re

import pytest
import torch

from fxbudget.harness import tasks as T
from fxbudget.harness.tasks import NEEDLE_TASKS, TASKS, Sample, chat_ids, load_jsonl, make_samples, score

LENGTHS = (500, 2000)
OWN_TASKS = sorted(t for t in TASKS if not t.startswith("ruler:"))  # RULER's tasks: tests/test_ruler.py




def count(tok, text):
    return len(tok(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("n_tokens", LENGTHS)
@pytest.mark.parametrize("task", OWN_TASKS)
def test_length_and_count(tok, task, n_tokens):
    s = TASKS[task](tok, n_tokens, depth=0.3, seed=3)
    real = count(tok, s.context)
    assert s.task == task and s.seed == 3 and s.n_tokens == real
    assert abs(real - n_tokens) <= 0.02 * n_tokens, (task, real)
    assert s.max_new_tokens > 0 and s.question and s.answer == s.answers[0]


@pytest.mark.parametrize("n_tokens", LENGTHS)
@pytest.mark.parametrize("task", sorted(NEEDLE_TASKS))
@pytest.mark.parametrize("depth", (0.2, 0.75))
def test_needle_depth_is_measured(tok, task, n_tokens, depth):
    s = TASKS[task](tok, n_tokens, depth=depth, seed=5)
    assert abs(s.depth - depth) <= 0.05, (task, s.depth)
    assert s.meta["requested_depth"] == depth
    assert s.depth == s.meta["needles"][0]["depth"]
    for needle in s.meta["needles"]:
        start = s.context.index(needle["text"])
        assert s.context.count(needle["text"]) == 1
        # The token offset counted independently: tokens of the text before the needle (less the joining space).
        offset = count(tok, s.context[:start].rstrip(" "))
        assert needle["depth"] == pytest.approx(offset / s.n_tokens, abs=1e-9), (task, needle)


@pytest.mark.parametrize("n_tokens", LENGTHS)
def test_niah_answers(tok, n_tokens):
    numbers = re.compile(r"\d+")
    for task in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
        s = TASKS[task](tok, n_tokens, depth=0.4, seed=7)
        values = [n["value"] for n in s.meta["needles"]]
        # Every number in the context is a needle's value, each exactly once; the haystack has no digits.
        assert sorted(numbers.findall(s.context)) == sorted(values), task
        assert all(re.fullmatch(r"\d{7}", v) for v in values)
        expected = values[:1] if task in ("niah_single", "niah_multikey") else values
        assert s.answers == expected, task
        for n in s.meta["needles"]:
            assert f"special magic numbers for {n['key']} is: {n['value']}." in s.context
    single = TASKS["niah_single"](tok, n_tokens, seed=7)
    assert len(single.meta["needles"]) == 1 and single.meta["needles"][0]["key"] in single.question
    mk = TASKS["niah_multikey"](tok, n_tokens, depth=0.4, seed=7)
    asked = mk.meta["needles"][0]["key"]
    assert asked in mk.question and len(mk.meta["distractors"]) == 3
    for d in mk.meta["distractors"]:
        assert d["key"] != asked and d["key"] not in mk.question
        assert d["value"] in mk.context and d["value"] not in mk.answers
        assert abs(d["requested_depth"] - 0.4) >= 0.1
    mv = TASKS["niah_multivalue"](tok, n_tokens, depth=0.4, seed=7)
    assert len({n["key"] for n in mv.meta["needles"]}) == 1 and len(set(mv.answers)) == 4
    assert all(abs(n["depth"] - 0.4) <= 0.15 for n in mv.meta["needles"])
    mq = TASKS["niah_multiquery"](tok, n_tokens, depth=0.4, seed=7)
    keys = [n["key"] for n in mq.meta["needles"]]
    assert len(set(keys)) == 4 and all(k in mq.question for k in keys) and len(set(mq.answers)) == 4


@pytest.mark.parametrize("n_tokens", LENGTHS)
def test_passkey(tok, n_tokens):
    s = TASKS["passkey"](tok, n_tokens, depth=0.5, seed=2)
    assert re.fullmatch(r"\d{5}", s.answer)
    # The classic needle states the key twice; nowhere else has a digit.
    assert re.findall(r"\d+", s.context) == [s.answer, s.answer]
    assert s.answer_prefix == "The pass key is"


@pytest.mark.parametrize("n_tokens", LENGTHS)
def test_variable_tracking(tok, n_tokens):
    s = TASKS["variable_tracking"](tok, n_tokens, depth=0.3, seed=4)
    names = s.answers
    assert len(set(names)) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in names)
    value = re.search(rf"VAR {names[0]} = (\d{{5}})\.", s.context).group(1)
    assert s.context.count(value) == 1 and value in s.question
    # Following the chain from the value reaches exactly the answers, in context order.
    chain = re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d{5})\.", s.context)
    held, order = {value}, []
    for lhs, rhs in chain:
        if rhs in held:
            held.add(lhs)
            order.append(lhs)
    assert order == names and len(chain) == 5
    assert str(len(names)) in s.answer_prefix


@pytest.mark.parametrize("n_tokens", LENGTHS)
def test_common_words(tok, n_tokens):
    s = TASKS["common_words"](tok, n_tokens, seed=6)
    assert s.depth is None and len(s.answers) == 10
    entries = re.findall(r"(\d+)\. ([a-z]+)", s.context)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    freq = collections.Counter(w for _, w in entries)
    top = freq.most_common()
    assert {w for w, _ in top[:10]} == set(s.answers)
    assert top[9][1] > top[10][1], "the common words must be strictly more frequent than the rest"
    assert all(freq[w] == s.meta["freq_common"] for w in s.answers)
    assert all(c == s.meta["freq_uncommon"] for w, c in top[10:])
    # No answer hides inside another listed word (a prediction naming that word would score).
    assert not any(a in w for a in s.answers for w in freq if w != a)


@pytest.mark.parametrize("task", OWN_TASKS)
def test_deterministic_per_seed(tok, task):
    a, b = TASKS[task](tok, 500, depth=0.4, seed=11), TASKS[task](tok, 500, depth=0.4, seed=11)
    assert a == b
    c = TASKS[task](tok, 500, depth=0.4, seed=12)
    assert c.context != a.context and c.answers != a.answers


def test_score():
    s = Sample("t", "ctx", "q", ["1234567", "ABCDE", "apple", "pear"])
    assert score(s, "The numbers are 1234567, abcde, Apple and PEAR.") == 1.0
    assert score(s, "1234567 and apple") == 0.5
    assert score(s, "abcde") == 0.25
    assert score(s, "nothing here") == 0.0
    assert score(Sample("t", "c", "q", ["42"]), "") == 0.0


def test_make_samples(tok):
    samples = make_samples("niah_single", tok, 500, 4, seed=1)
    assert [s.meta["requested_depth"] for s in samples] == [0.125, 0.375, 0.625, 0.875]
    assert [s.seed for s in samples] == [1000, 1001, 1002, 1003]
    assert all(abs(s.depth - (i + 0.5) / 4) <= 0.05 for i, s in enumerate(samples))
    assert len({s.answer for s in samples}) == 4
    assert make_samples("niah_single", tok, 500, 4, seed=1) == samples
    cw = make_samples("common_words", tok, 500, 2)
    assert [s.depth for s in cw] == [None, None] and cw[0].answers != cw[1].answers
    with pytest.raises(ValueError, match="niah_multikey"):
        make_samples("no_such_task", tok, 500, 2)


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="depth"):
        T.niah_single(tok, 500, depth=1.5)
    with pytest.raises(ValueError, match="n_tokens"):
        T.passkey(tok, 0)
    with pytest.raises(ValueError, match="too small"):
        T.niah_multivalue(tok, 60)


@pytest.mark.parametrize("task", sorted(NEEDLE_TASKS))
def test_too_short_says_the_least_length_that_works(tok, task):
    with pytest.raises(ValueError, match=r"too small .*use at least \d+ tokens") as e:
        make_samples(task, tok, 20, 2)
    least = int(re.search(r"use at least (\d+) tokens", str(e.value)).group(1))
    assert all(s.n_tokens > 0 for s in make_samples(task, tok, least, 2))  # the stated minimum is enough


def test_a_context_too_coarse_to_fit_is_a_value_error(tok):
    # 44 tokens pass the needle check, but the sentences cannot land within 2% (43 tokens): bad input, said so.
    with pytest.raises(ValueError, match=r"could not fit the context within 2% .*use a longer length"):
        make_samples("passkey", tok, 44, 2)


def test_too_short_common_words(tok):
    with pytest.raises(ValueError, match=r"too small for common_words \(its shortest list takes \d+ tokens\)"):
        make_samples("common_words", tok, 20, 1)


def test_task_package_has_one_module_per_family():
    families = {"passkey": "passkey", "niah_single": "niah", "niah_multikey": "niah", "niah_multivalue": "niah",
                "niah_multiquery": "niah", "variable_tracking": "variable_tracking", "common_words": "common_words",
                "list_keys": "list_keys", "shared_niah": "shared", "shared_passkey": "shared"}
    assert {name: fn.__module__.rsplit(".", 1)[1] for name, fn in TASKS.items() if name in OWN_TASKS} == families
    assert load_jsonl.__module__.endswith(".jsonl") and set(T.TASK_FILE_FIELDS) >= {"max_new_tokens", "answer"}


def test_load_jsonl(tok, tmp_path):
    path = tmp_path / "my_task.jsonl"
    rows = [{"context": "The sky is green here.", "question": "What colour is the sky?", "answer": "green"},
            {"context": "A is 1. B is 2.", "question": "What are A and B?", "answer": ["1", "2"],
             "answer_prefix": "They are", "max_new_tokens": 8, "source": "hand"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    a, b = load_jsonl(path, tok)
    assert (a.task, a.answers, a.answer_prefix) == ("my_task", ["green"], "")
    assert a.n_tokens == count(tok, rows[0]["context"]) and a.meta["line"] == 1
    assert (b.answers, b.answer_prefix, b.max_new_tokens, b.meta["source"]) == (["1", "2"], "They are", 8, "hand")
    assert score(b, "They are 1 and 2") == 1.0
    assert load_jsonl(path)[0].n_tokens == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"context": "x", "answer": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'question'"):
        load_jsonl(bad)
    bad.write_text(json.dumps(rows[0]) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        load_jsonl(bad)
    bad.write_text(json.dumps({**rows[0], "answer": []}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'answer'"):
        load_jsonl(bad)


@pytest.mark.parametrize("task", OWN_TASKS)
def test_chat_ids(tok, task):
    s = TASKS[task](tok, 500, seed=1)
    ctx, question = chat_ids(tok, s)
    assert ctx.shape[0] == question.shape[0] == 1 and ctx.dtype == question.dtype == torch.long
    full = tok.apply_chat_template([{"role": "user", "content": s.context + "\n\n" + s.question}], tokenize=False,
                                   add_generation_prompt=True) + s.answer_prefix
    assert tok.decode(torch.cat([ctx, question], dim=1)[0]) == full
    assert tok.decode(ctx[0]).endswith(s.context)
    assert tok.decode(question[0]).startswith("\n\n" + s.question)
    assert tok.decode(question[0]).endswith(s.answer_prefix) and s.answer_prefix


def test_chat_ids_without_template(tok):
    class NoTemplate:
        chat_template = None

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

    s = T.niah_single(tok, 300, seed=2)
    ctx, question = chat_ids(NoTemplate(), s)
    assert tok.decode(ctx[0]) == s.context
    assert tok.decode(question[0]) == f"\n\n{s.question}\nAnswer: {s.answer_prefix}"


@pytest.mark.parametrize("task", OWN_TASKS)
def test_answer_ids_continue_the_prompt(tok, task):
    """The likelihood metric's tokens: the answers joined as the task expects them, tokenized exactly as the whole
    prompt + answer text would be (no token merges across the boundary)."""
    s = TASKS[task](tok, 500, seed=1)
    _, question = chat_ids(tok, s)
    answer = T.answer_ids(tok, s)
    text = T.answer_text(tok, s)
    assert text == " " + ", ".join(s.answers) and tok.decode(answer[0]) == text
    joint = tok(tok.decode(question[0]) + text, add_special_tokens=False).input_ids
    assert joint == question[0].tolist() + answer[0].tolist()
    assert score(s, text) == 1.0


def test_answer_text_after_template_without_prefix(tok):
    s = Sample("mine", "ctx", "q?", ["red", "blue"])
    assert T.answer_text(tok, s) == "red, blue"  # straight after the assistant header
    assert T.answer_text(tok, Sample("mine", "ctx", "q?", ["red"], "Colour: ")) == "red"
