"""RULER's 13 tasks (fxbudget/harness/tasks/ruler): each generated prompt against RULER's format written out by hand
from NVIDIA/RULER's scripts, kvpress's context / question split, the length fitter, the one-line refusals, and
RULER's metrics on hand-made predictions."""

import collections
import json
import re

import pytest
import torch

from fxbudget.harness.tasks import TASKS, chat_ids, make_samples, score
from fxbudget.harness.tasks.ruler import OFFLINE_TASKS, RULER_TASKS, expand_tasks, find_question, question_start
from fxbudget.harness.tasks.ruler.fit import fit
from fxbudget.harness.tasks.ruler.freq_words import counts, zeta

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NAMES = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]
# kvpress evaluation/benchmarks/ruler/create_huggingface_dataset.py ANSWER_PATTERNS: where its answer prefix starts.
KVPRESS_ANSWER = {"niah": "The special magic", "vt": "Answer:", "cwe": "Answer:", "fwe": "Answer:", "qa": "Answer:"}
GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}  # RULER constants.py tokens_to_generate




@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Small files in RULER's formats: an essay, SQuAD 2.0 (with an impossible question), HotpotQA."""
    d = tmp_path_factory.mktemp("ruler_data")
    essay = "".join(f"Essay sentence {i} is about startups.\n\nAnd   ideas {i}? Yes! " for i in range(1500))
    (d / "PaulGrahamEssays.json").write_text(json.dumps({"text": essay}))
    squad = {"data": [{"title": f"a{a}", "paragraphs": [
        {"context": f"Paragraph {a}-{p} of article {a} holds fact{a}x{p}. " * 6,
         "qas": [{"question": "Can it be answered?", "answers": [], "is_impossible": True},
                 {"question": f"What does paragraph {a}-{p} hold?", "is_impossible": False,
                  "answers": [{"text": f"fact{a}x{p}"}, {"text": f"the fact{a}x{p}"}]}]} for p in range(3)]}
        for a in range(40)]}
    (d / "squad.json").write_text(json.dumps(squad))
    hotpot = [{"question": f"Who wrote book {i}?", "answer": f"author{i}",
               "context": [[f"Title {i}-{j}", [f"Book {i}-{j} was written. ", f"By someone {j}."]] for j in range(10)]}
              for i in range(60)]
    (d / "hotpotqa.json").write_text(json.dumps(hotpot))
    return d


def count(tok, text):
    return len(tok(text, add_special_tokens=False).input_ids)


def prompt(s):
    return s.context + s.question + s.answer_prefix  # RULER's whole prompt (base template), kvpress's three fields


def gen(task, tok, n, data, seed=1):
    return TASKS[f"ruler:{task}"](tok, n, seed=seed, data_dir=data)


def test_find_question_without_the_family():
    assert find_question("no question here") == -1
    assert find_question("ctx Question: What are the 10 most common words in the above list? Answer: x") == 4


def test_registry_and_suite():
    assert list(RULER_TASKS) == [f"ruler:{n}" for n in NAMES] and set(RULER_TASKS) <= set(TASKS)
    assert expand_tasks(["ruler"]) == [f"ruler:{n}" for n in NAMES]
    assert expand_tasks(["passkey", "ruler:vt", "ruler"])[:3] == ["passkey", "ruler:vt", "ruler:niah_single_1"]
    assert len(expand_tasks(["ruler:vt", "ruler"])) == 13
    assert OFFLINE_TASKS == ("ruler:niah_single_1", "ruler:niah_multikey_2", "ruler:niah_multikey_3", "ruler:vt",
                             "ruler:cwe", "ruler:fwe")


@pytest.mark.parametrize("call", [lambda: expand_tasks(["ruler:niah_single_4"]),
                                  lambda: make_samples("ruler:niah_single_4", None, 4096, 1)])
def test_unknown_ruler_task_lists_them(call):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and "unknown RULER task 'ruler:niah_single_4'" in msg
    assert all(n in msg for n in NAMES)


@pytest.mark.parametrize("task,file", [("niah_single_2", "PaulGrahamEssays.json"), ("niah_multiquery",
                                                                                     "PaulGrahamEssays.json"),
                                       ("qa_1", "squad.json"), ("qa_2", "hotpotqa.json")])
def test_missing_files_are_one_line(tok, task, file, tmp_path, monkeypatch):
    monkeypatch.delenv("FXBUDGET_RULER_DATA", raising=False)
    with pytest.raises(ValueError, match=rf"^ruler:{task} needs RULER's {re.escape(file)}, which cannot be downloaded "
                                         r"here: set FXBUDGET_RULER_DATA to a folder holding it$"):
        make_samples(f"ruler:{task}", tok, 4096, 1)
    monkeypatch.setenv("FXBUDGET_RULER_DATA", str(tmp_path))
    with pytest.raises(ValueError, match=rf"^ruler:{task} needs RULER's {re.escape(file)}: .* is not there$"):
        make_samples(f"ruler:{task}", tok, 4096, 1)


def test_env_var_points_to_the_files(tok, data, monkeypatch):
    monkeypatch.setenv("FXBUDGET_RULER_DATA", str(data))
    s = make_samples("ruler:qa_2", tok, 2048, 1)[0]
    assert s.answers == ["author0"] and "Who wrote book 0?" in s.question


@pytest.mark.parametrize("task", NAMES)
def test_kvpress_split_and_length(tok, data, task):
    """Context + question + answer prefix is RULER's prompt; the question starts at kvpress's marker (its last match)
    and the answer prefix where kvpress's answer pattern first matches after it; the prompt plus RULER's generation
    allowance fits the length, and the sample records RULER's metric and generation length."""
    s = gen(task, tok, 4096, data)
    family = task.split("_")[0]
    full = prompt(s)
    assert question_start(full, s.meta["family"]) == len(s.context) == find_question(full)
    assert (s.question + s.answer_prefix).index(KVPRESS_ANSWER[family]) == len(s.question)
    assert s.question.endswith(" ") and not s.answer_prefix.startswith(" ")
    assert count(tok, full) + GENERATE[family] <= 4096 and count(tok, full) > 0.9 * 4096 - GENERATE[family]
    assert s.max_new_tokens == GENERATE[family] and s.n_tokens == count(tok, s.context)
    assert s.meta["metric"] == ("string_match_part" if family == "qa" else "string_match_all")
    assert s.task == f"ruler:{task}" and s.separator == "" and s.plain_suffix == ""


def _niah_parts(s, singular, kind):
    full = prompt(s)
    what = kind if not singular else kind[:-1]
    head = (f"A special magic {what} is hidden within the following text. Make sure to memorize it. I will quiz you "
            f"about the {what} afterwards.\n") if singular else \
        (f"Some special magic {what} are hidden within the following text. Make sure to memorize it. I will quiz you "
         f"about the {what} afterwards.\n")
    assert full.startswith(head)
    q = re.fullmatch(r"\nWhat (?:is|are all) the special magic \w+ for (.+) mentioned in the provided text\? "
                     r"The special magic \w+ for (.+) mentioned in the provided text (?:is|are)",
                     full[len(s.context) - 1:])
    assert q and q.group(1) == q.group(2)
    tail = (f"\nWhat is the special magic {what} for {q.group(1)} mentioned in the provided text? The special magic "
            f"{what} for {q.group(1)} mentioned in the provided text is") if singular else \
        (f"\nWhat are all the special magic {what} for {q.group(1)} mentioned in the provided text? The special magic "
         f"{what} for {q.group(1)} mentioned in the provided text are")
    assert full.endswith(tail)
    return s.context[len(head):-1], q.group(1)


def _needle(kind, key, value):
    return f"One of the special magic {kind} for {key} is: {value}."


WORD, NUMBER = r"[A-Za-z][a-z'A-Z-]*-[A-Za-z][a-zA-Z-]*", r"\d{7}"  # wonderwords: adjective-noun
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


def test_niah_single_1_noise(tok, data):
    s = gen("niah_single_1", tok, 2048, data)
    body, key = _niah_parts(s, True, "numbers")
    lines = body.split("\n")
    needle = _needle("numbers", key, s.answers[0])
    assert re.fullmatch(WORD, key) and re.fullmatch(NUMBER, s.answers[0])
    assert lines.count(needle) == 1 and lines.count(NOISE) == len(lines) - 1 == s.meta["n_haystack"]


@pytest.mark.parametrize("task,kind,key_re,value_re", [("niah_multikey_2", "numbers", WORD, NUMBER),
                                                         ("niah_multikey_3", "uuids", UUID, UUID)])
def test_niah_needle_haystack(tok, data, task, kind, key_re, value_re):
    s = gen(task, tok, 2048, data)
    body, key = _niah_parts(s, True, kind)
    lines = body.split("\n")
    pattern = re.compile(rf"One of the special magic {kind} for ({key_re}) is: ({value_re})\.")
    parsed = [pattern.fullmatch(line) for line in lines]
    assert all(parsed) and len(lines) == s.meta["n_haystack"] + 1
    assert [m.group(2) for m in parsed if m.group(1) == key] == s.answers  # the asked key: once, with its answer


@pytest.mark.parametrize("task,singular,nk,nv,nq", [
    ("niah_single_2", True, 1, 1, 1), ("niah_single_3", True, 1, 1, 1), ("niah_multikey_1", True, 4, 1, 1),
    ("niah_multivalue", False, 1, 4, 1), ("niah_multiquery", False, 4, 1, 4)])
def test_niah_essay(tok, data, task, singular, nk, nv, nq):
    s = gen(task, tok, 4096, data)
    kind = "uuids" if task == "niah_single_3" else "numbers"
    body, query = _niah_parts(s, singular, kind)
    value = UUID if kind == "uuids" else NUMBER
    needles = re.findall(rf"One of the special magic {kind} for ({WORD}) is: ({value})\.", body)
    assert len(needles) == nk * nv and len({k for k, _ in needles}) == nk
    keys = query.split(", and ")[0].split(", ") + query.split(", and ")[1:]
    assert len(keys) == nq  # each asked key's values, keys in the question's order (needles are shuffled)
    assert [sorted(v for kk, v in needles if kk == k) for k in keys] == \
        [sorted(s.answers[i * nv:(i + 1) * nv]) for i in range(nq)]
    # The essay's words in order, whitespace made single spaces, the needles between sentences.
    words = json.loads((data / "PaulGrahamEssays.json").read_text())["text"].split()
    rest = body
    for k, v in needles:
        rest = rest.replace(" " + _needle(kind, k, v), "").replace(_needle(kind, k, v) + " ", "")
    assert rest.split() == words[:s.meta["n_haystack"]]


def test_vt(tok, data):
    s = gen("vt", tok, 4096, data)
    full = prompt(s)
    header = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    assert full.startswith(header) and full.count(header) == 2  # RULER's solved example, then the task
    example, task = full[:full.rindex(header)], full[full.rindex(header):]
    value = s.question.split("the value ")[1].split(" ")[0]
    assert task.endswith(f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
                         f"Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                         f"are assigned the value {value}, they are: ")
    lines = task[len(header):].split("\n")[:-1]
    chain = [line for line in lines if line != NOISE]
    a = s.answers
    assert chain == [f"VAR {a[0]} = {value}"] + [f"VAR {a[j + 1]} = VAR {a[j]} " for j in range(4)]
    assert all(re.fullmatch(r"[A-Z]{5}", v) for v in a) and len(set(a)) == 5 and re.fullmatch(r"\d{5}", value)
    # The example: same template, 3-letter names, its answer after its prefix (RULER joins them with a space after
    # the prefix's own: two), then a blank line.
    m = re.fullmatch(r"(?s).*they are:  ((?:[A-Z]{3} ){4}[A-Z]{3})\n\n", example)
    assert m and count(tok, example) < 520
    names = m.group(1).split()
    ex_value = re.search(r"VAR [A-Z]{3} = (\d{5})\n", example).group(1)
    assert f"VAR {names[0]} = {ex_value}\n" in example and f"VAR {names[4]} = VAR {names[3]} \n" in example


@pytest.mark.parametrize("n,shot,repeats", [(2048, (20, 3, 1), (6, 1)), (4096, (40, 10, 3), (30, 3))])
def test_cwe(tok, data, n, shot, repeats):
    s = gen("cwe", tok, n, data)
    full = prompt(s)
    head = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
            "that appear most often.\n")
    q = "\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words that appear most " \
        "often in the list are:"
    shot_text, task = full.split("\n" + head)
    assert shot_text.startswith(head) and task.endswith(q)

    def listed(text):
        items = re.findall(r"(\d+)\. (\S+)", text)
        assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
        return collections.Counter(w for _, w in items)

    c = listed(task[:-len(q)])
    assert sorted(c.values(), reverse=True) == [repeats[0]] * 10 + [repeats[1]] * (len(c) - 10)
    assert {w for w, k in c.items() if k == repeats[0]} == set(s.answers) and len(s.answers) == 10
    ex_list, ex_answer = shot_text[len(head):].split(q)
    ce = listed(ex_list)
    assert len(ce) == shot[0] and sorted(ce.values(), reverse=True) == [shot[1]] * 10 + [shot[2]] * (shot[0] - 10)
    assert listed(ex_answer) == collections.Counter({w: 1 for w, k in ce.items() if k == shot[1]})


def test_fwe(tok, data):
    s = gen("fwe", tok, 4096, data)
    full = prompt(s)
    head = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
            "appeared coded words. ")
    q = "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most " \
        "frequently appeared words in the above coded text? Answer: According to the coded text above, the three " \
        "most frequently appeared words are:"
    assert full.startswith(head) and full.endswith(q)
    c = collections.Counter(full[len(head):-len(q)].split(" "))
    ranked = [w for w, _ in c.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.answers
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
    n = s.meta["n_words"]  # RULER's counts: int(n * k^-2 / zeta(2)) for rank k
    assert [c[w] for w in ranked[:4]] == [int(n * k ** -2 / (torch.pi ** 2 / 6)) for k in range(1, 5)]
    assert s.meta["vocab_size"] == (4096 - 50) // 50
    assert zeta(2.0) == pytest.approx(torch.pi ** 2 / 6, rel=1e-12) and zeta(3.0) == pytest.approx(1.2020569031595942)
    assert counts(100, 3, 2.0) == [60, 15, 6]


def test_qa_squad(tok, data):
    s = gen("qa_1", tok, 2048, data, seed=4)
    full = prompt(s)
    head = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
            "words.\n\nThe following are given documents.\n\n")
    tail = ("\n\nAnswer the question based on the given documents. Only give me the answer and do not output any "
            "other words.\n\nQuestion: What does paragraph 1-1 hold? Answer:")
    assert full.startswith(head) and full.endswith(tail)  # question 4 of the answerable ones: article 1, paragraph 1
    docs = re.split(r"(?:^|\n\n)Document \d+:\n", full[len(head):-len(tail)])[1:]
    assert re.findall(r"Document (\d+):\n", full) == [str(i) for i in range(1, len(docs) + 1)]
    assert len(docs) == s.meta["n_docs"] and len(set(docs)) == len(docs)
    own = {f"Paragraph 1-{p} of article 1 holds fact1x{p}. " * 6 for p in range(3)}
    assert own <= set(docs)  # its paragraph, then its article's others, before other articles'
    assert s.answers == ["fact1x1", "the fact1x1"]


def test_qa_hotpot(tok, data):
    s = gen("qa_2", tok, 2048, data, seed=7)
    assert s.question.endswith("Question: Who wrote book 7? ") and s.answers == ["author7"]
    assert all(f"Title 7-{j}\nBook 7-{j} was written. By someone {j}." in s.context for j in range(10))


@pytest.mark.parametrize("task", [t.split(":")[1] for t in OFFLINE_TASKS])
def test_deterministic_per_seed(tok, task):
    a, b, c = (TASKS[f"ruler:{task}"](tok, 2048, seed=seed) for seed in (3, 3, 4))
    assert prompt(a) == prompt(b) and a.answers == b.answers
    assert prompt(a) != prompt(c)


def test_fit_finds_the_largest_haystack():
    class Words:  # one token per space-separated word
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [t.split() for t in texts]}

    build = lambda k: "head " + "w " * k + "tail"  # noqa: E731
    for n in (30, 57, 100, 1000):
        k, text, tokens = fit(build, Words(), n, 7, 5, "t")
        assert tokens == k + 2 == n - 7 and text == build(k)
    with pytest.raises(ValueError, match=r"^too short for t: .* takes 14 tokens with this tokenizer; "
                                         r"give at least 14$"):
        fit(build, Words(), 13, 7, 5, "t")


@pytest.mark.parametrize("task", ["ruler:vt", "ruler:cwe", "ruler:fwe", "ruler:niah_single_1"])
def test_below_minimum_says_the_least_length(tok, task):
    with pytest.raises(ValueError, match=r"^too short for " + task + r": .*give at least (\d+)$") as e:
        make_samples(task, tok, 200, 1)
    least = int(re.search(r"give at least (\d+)$", str(e.value)).group(1))
    assert least > 200
    make_samples(task, tok, least, 1)  # the length it names works


def test_chat_ids_follow_kvpress(tok):
    """Chat template: the user turn is context + question (no separator: RULER's prompt), the answer prefix after the
    assistant header; without one: RULER's base prompt, trailing space dropped."""
    s = TASKS["ruler:vt"](tok, 1024, seed=2)
    ctx, question = chat_ids(tok, s)
    full = tok.apply_chat_template([{"role": "user", "content": s.context + s.question}], tokenize=False,
                                   add_generation_prompt=True) + s.answer_prefix
    assert tok.decode(torch.cat([ctx, question], dim=1)[0]) == full
    assert tok.decode(ctx[0]).endswith(s.context) and tok.decode(question[0]).startswith(s.question)

    class NoTemplate:
        chat_template = None

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

    ctx, question = chat_ids(NoTemplate(), s)
    assert tok.decode(ctx[0]) == s.context and tok.decode(question[0]) == (s.question + s.answer_prefix).rstrip(" ")


def _ruler_metric(name, preds, refs):
    """RULER's scripts/eval/synthetic/constants.py, written out: the task score over predictions, in percent."""
    if name == "string_match_part":
        v = sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs))
    else:
        v = sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref) for p, ref in zip(preds, refs))
    return round(v / len(preds) * 100, 2)


def test_scoring_matches_ruler(tok, data):
    mv = gen("niah_multivalue", tok, 4096, data)
    a = mv.answers
    preds = [f"{a[0]}, {a[1]}, {a[2]} and {a[3]}", f"{a[2]} then {a[0]}", "none", f"{a[3]}\n"]
    mine = [score(mv, p) for p in preds]
    assert mine == [1.0, 0.5, 0.0, 0.25]
    assert round(100 * sum(mine) / len(mine), 2) == _ruler_metric("string_match_all", preds, [a] * 4) == 43.75
    cwe = gen("cwe", tok, 2048, data)
    pred = " ".join(w.upper() for w in cwe.answers[:7])  # case-insensitive
    assert score(cwe, pred) == 0.7 == _ruler_metric("string_match_all", [pred], [cwe.answers]) / 100
    qa = gen("qa_1", tok, 2048, data, seed=4)  # answers: fact1x1, the fact1x1
    preds = ["It is the FACT1X1.", "fact1x1", "fact1x2", ""]
    mine = [score(qa, p) for p in preds]
    assert mine == [1.0, 1.0, 0.0, 0.0]
    assert round(100 * sum(mine) / len(mine), 2) == _ruler_metric("string_match_part", preds, [qa.answers] * 4) == 50.0
    # RULER's post-processing: control characters become newlines (a number split by one is not found).
    single = gen("niah_single_1", tok, 1024, data)
    n = single.answers[0]
    assert score(single, f"  {n}\x00 ") == 1.0 and score(single, f"{n[:3]}\x07{n[3:]}") == 0.0


@pytest.mark.parametrize("task", OFFLINE_TASKS)
def test_likelihood_answer_continues_the_prompt(tok, task):
    """The likelihood metric's gold continuation: RULER's answers joined, tokenized as the prompt + answer would be."""
    from fxbudget.harness.tasks import answer_ids, answer_text

    s = TASKS[task](tok, 1024, seed=1)
    _, question = chat_ids(tok, s)
    text = answer_text(tok, s)
    assert text.strip() == ", ".join(s.answers) and score(s, text) == 1.0
    if s.answer_prefix.endswith(" "):  # vt: RULER's prompt ends in a space, the model continues after that token
        assert text == ", ".join(s.answers) and tok.decode(question[0][-1:]) == " " and task == "ruler:vt"
        return
    joint = tok(tok.decode(question[0]) + text, add_special_tokens=False).input_ids
    assert joint == question[0].tolist() + answer_ids(tok, s)[0].tolist()
