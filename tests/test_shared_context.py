"""The shared-context protocols (`multi-request`, `multi-turn`; SCBench's setting) and their tasks: the unmodified
model reproduced at a covering budget, turn by turn; multi-request's cache put back bit-identically between requests;
multi-turn's turns seeing the earlier ones; the rows, the report's per-turn tables, resume, and the refusals."""

import json

import pytest
import torch

from fxbudget import compile as fx_compile
from fxbudget.cache.keyword import output_cache
from fxbudget.cli import main
from fxbudget.harness import shared_context as S
from fxbudget.harness.grid import Grid
from fxbudget.harness.report import load_rows, markdown
from fxbudget.harness.report_turns import decay, turn_table
from fxbudget.harness.tasks import (SHARED_TASKS, TASKS, answer_ids, answer_text, chat_ids, make_samples,
                                    requests, score)

from conftest import fails_in_one_line, greedy


# --- the tasks ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", sorted(SHARED_TASKS))
def test_shared_task_asks_each_needle_once(tok, task):
    s = TASKS[task](tok, 1000, seed=4)
    reqs = requests(s)
    k = SHARED_TASKS[task]
    assert len(reqs) == k == len(s.meta["needles"])
    # every needle asked exactly once, by a request whose answer is that needle's value and depth its depth
    asked = sorted((r.answers[0], r.depth) for r in reqs)
    assert asked == sorted((n["value"], n["depth"]) for n in s.meta["needles"])
    depths = sorted(n["depth"] for n in s.meta["needles"])
    assert all(abs(d - (i + 0.5) / k) < 0.06 for i, d in enumerate(depths))  # spread over the context
    assert [r.answers for r in reqs][0] == s.answers and reqs[0].question == s.question  # first request = sample's
    assert all(r.context == s.context and r.question != reqs[0].question for r in reqs[1:])
    for r in reqs:
        assert score(r, f"the key is {r.answers[0]}") == 1.0 and score(r, "I do not know") == 0.0
    assert TASKS[task](tok, 1000, seed=4) == s and TASKS[task](tok, 1000, seed=5).answers != s.answers
    # k consecutive samples ask every needle position at every turn once (a Latin square): turn is not depth
    samples = make_samples(task, tok, 600, k)
    for turn in range(k):
        positions = [sorted(n["depth"] for n in x.meta["needles"]).index(requests(x)[turn].depth) for x in samples]
        assert sorted(positions) == list(range(k)), (turn, positions)


def test_single_question_sample_is_its_own_request(tok):
    s = TASKS["passkey"](tok, 500, seed=1)
    assert requests(s) == [s]


def test_multi_turn_ids_are_the_chat_template_conversation(tok):
    """context + turn 1 + gold answer 1 + follow-up 2 + ... decodes to the template applied to the whole chat."""
    s = TASKS["shared_niah"](tok, 400, seed=2)
    reqs = requests(s)
    ctx, ts = S.turns(tok, s, "multi-turn")
    ids = [ctx, ts[0].prompt]
    messages = [{"role": "user", "content": s.context + s.separator + reqs[0].question}]
    for prev, r, t in zip(reqs, reqs[1:], ts[1:]):
        ids += [answer_ids(tok, prev), t.prompt]
        messages += [{"role": "assistant", "content": prev.answer_prefix + answer_text(tok, prev)},
                     {"role": "user", "content": r.question}]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + reqs[-1].answer_prefix
    assert tok.decode(torch.cat(ids, dim=1)[0]) == expected
    # multi-request: each request is the single-question prompt of its own question
    ctx2, tr = S.turns(tok, s, "multi-request")
    assert torch.equal(ctx2, ctx)
    for r, t in zip(reqs, tr):
        assert torch.equal(t.prompt, chat_ids(tok, r)[1]) and torch.equal(t.answer, answer_ids(tok, r))
    with pytest.raises(ValueError, match="asks one question per sample"):
        S.turns(tok, TASKS["passkey"](tok, 500), "multi-turn")


# --- the protocols on a tiny random model ---------------------------------------------------------------------------

def _turns(k=3, seed=0, q=5, m=3, max_new=4):
    g = torch.Generator().manual_seed(seed)
    return [S.Turn(None, torch.randint(3, 96, (1, q + i), generator=g), torch.randint(3, 96, (1, m), generator=g),
                   max_new) for i in range(k)]


CTX = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _budgeted(model, rule, budget, protocol, turns, headroom=32):
    fx_compile(model, rule=rule, budget=budget, backend=None, headroom=headroom)
    try:
        cache = model.forward.new_cache(1)
        model(input_ids=CTX, cache=cache, logits_to_keep=1)
        return list(S.RUN[protocol](model, cache, turns, eos=set())), cache
    finally:
        model.forward.restore()


@torch.no_grad()
def _reference(model, protocol, turns):
    cache = output_cache(model(input_ids=CTX, use_cache=True))
    return list(S.RUN[protocol](model, cache, turns, eos=set()))


@pytest.mark.parametrize("protocol", S.MULTI_PROTOCOLS)
@pytest.mark.parametrize("rule", ["snapkv", "h2o", "streamingllm"])
def test_covering_budget_is_the_unmodified_model_per_turn(llama, protocol, rule):
    turns = _turns()
    ref = _reference(llama, protocol, turns)
    got, _ = _budgeted(llama, rule, 512, protocol, turns)
    assert [r.turn for r in got] == [1, 2, 3]
    for a, b in zip(got, ref):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


@torch.no_grad()
def _plain(model, ids, answer, steps):
    """A plain run: `ids` in one call, then greedy; and the gold answer's log-probs teacher-forced in one call."""
    logits, _ = greedy(model, ids, steps - 1)
    out = logits.argmax(-1)[:, 0].tolist()
    full = model(input_ids=torch.cat([ids, answer[:, :-1]], dim=1)).logits[0, ids.shape[1] - 1:]
    lp = torch.log_softmax(full.float(), -1).gather(-1, answer[0, :, None])[:, 0].double()
    return out, lp


@pytest.mark.parametrize("protocol", S.MULTI_PROTOCOLS)
def test_unmodified_model_turns_are_plain_runs(llama, protocol):
    """The reference of each turn is a plain run of what the protocol puts before it: the context and the request
    (multi-request), the whole conversation with the earlier gold answers (multi-turn)."""
    turns = _turns()
    ref = _reference(llama, protocol, turns)
    prefix = CTX
    for i, (turn, r) in enumerate(zip(turns, ref)):
        if protocol == "multi-request":
            ids = torch.cat([CTX, turn.prompt], dim=1)
        else:
            prefix = torch.cat([prefix] + ([turns[i - 1].answer] if i else []) + [turn.prompt], dim=1)
            ids = prefix
        out, lp = _plain(llama, ids, turn.answer, turn.max_new)
        assert r.output_ids == out
        torch.testing.assert_close(r.logprobs, lp, atol=1e-4, rtol=0)


def _state(cache):
    return [t.clone() for layer in cache.layers for t in layer.tensors()] + [cache.next_pos.clone()]


def test_multi_request_restores_the_compressed_cache_bit_identically(llama):
    fx_compile(llama, rule="h2o", budget=24, backend=None, headroom=32)
    try:
        cache = llama.forward.new_cache(1)
        llama(input_ids=CTX, cache=cache, logits_to_keep=1)
        before, held = _state(cache), list(cache._held)
        seen = cache.tokens_seen
        results = []
        for res in S.multi_request(llama, cache, _turns(k=4), eos=set()):
            results.append(res)
            after = _state(cache)
            assert len(after) == len(before)
            assert all(torch.equal(a, b) for a, b in zip(after, before)), res.turn  # every layer tensor
            assert cache._held == held and cache.tokens_seen == seen
        # each request ran on the compressed context: it held more than the budget while answering (head-room)
        assert len(results) == 4 and all(r.kv["kv_held_bytes"] > 0 for r in results)
    finally:
        llama.forward.restore()


def test_multi_request_answers_each_request_as_if_first(llama):
    """Request 2 of multi-request is request 1 of a run whose only request it is: nothing of request 1 stays."""
    turns = _turns()
    got, _ = _budgeted(llama, "h2o", 24, "multi-request", turns)
    alone, _ = _budgeted(llama, "h2o", 24, "multi-request", turns[1:2])
    assert got[1].output_ids == alone[0].output_ids and torch.equal(got[1].logprobs, alone[0].logprobs)


def test_multi_turn_turns_see_the_earlier_turns(llama):
    turns = _turns()
    budget = 24
    got, cache = _budgeted(llama, "streamingllm", budget, "multi-turn", turns)
    # the cache saw the context and every call (turn t > 1 appends the previous gold answer and its prompt), and it
    # holds the budget: eviction ran through the conversation
    calls = [turns[0].prompt.shape[1]] + [p.answer.shape[1] + t.prompt.shape[1] for p, t in zip(turns, turns[1:])]
    assert [r.appended_tokens for r in got] == calls
    assert cache.tokens_seen == CTX.shape[1] + sum(calls)
    for i in range(len(cache.layers)):
        held = cache.head_positions(i)
        assert int((held >= 0).sum(-1).max()) == budget
        assert int(held.max()) == cache.tokens_seen - 1  # the last turn's prompt is held (streamingllm's window)
    # a covering budget: nothing evicted, the cache grows by each turn
    big, cache = _budgeted(llama, "streamingllm", 512, "multi-turn", turns)
    assert int((cache.head_positions(0) >= 0).sum(-1).max()) == CTX.shape[1] + sum(calls)
    # turn 2 on the conversation differs from turn 2's question asked of the context alone
    solo, _ = _budgeted(llama, "streamingllm", 512, "multi-request", turns)
    assert not torch.allclose(big[1].logprobs, solo[1].logprobs, atol=1e-3)


@pytest.mark.parametrize("protocol", S.MULTI_PROTOCOLS)
def test_small_budget_changes_later_turns(llama, protocol):
    turns = _turns(k=4)
    ref = _reference(llama, protocol, turns)
    got, _ = _budgeted(llama, "snapkv", 12, protocol, turns)
    assert any(not torch.allclose(a.logprobs, b.logprobs, atol=1e-3) for a, b in zip(got[1:], ref[1:]))


# --- the runner, report and CLI --------------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("shared_fingerprints")

RUN = ["--tasks", "shared_passkey", "--lengths", "300", "--samples", "2", "--rules", "full,streamingllm,h2o",
       "--budgets", "40,4096", "--max-new-tokens", "4", "--quiet"]


@pytest.fixture(scope="module")
def shared_run(tiny_dir, tmp_path_factory, shared_fingerprints):
    out = tmp_path_factory.mktemp("shared")
    assert main(["compare", "--model", tiny_dir, *RUN, "--protocol", "query-agnostic,multi-request,multi-turn",
                 "--out", str(out)]) == 0
    return out, load_rows([out])


def test_rows_one_per_request(shared_run):
    _, rows = shared_run
    multi = [r for r in rows if r["protocol"] != "query-agnostic"]
    # samples x protocols x (reference + rules x budgets) x 3 requests
    assert len(multi) == 2 * 2 * (1 + 2 * 2) * 3 and len({r["key"] for r in rows}) == len(rows)
    assert sorted({r["turn"] for r in multi}) == [1, 2, 3] and all(r["turns"] == 3 for r in multi)
    assert all("turn" not in r for r in rows if r["protocol"] == "query-agnostic")
    for r in multi:  # each request's own answer and score
        assert r["score"] == score(make_samples_cache(r), r["prediction"])
    turn = {(r["protocol"], r["sample"], r["turn"]): r for r in multi if r["rule"] == "full"}
    # multi-request: each request follows the context alone; multi-turn: the conversation grows
    for s in (0, 1):
        mr = [turn[("multi-request", s, t)]["prompt_tokens"] - turn[("multi-request", s, t)]["question_tokens"]
              for t in (1, 2, 3)]
        mt = [turn[("multi-turn", s, t)]["prompt_tokens"] for t in (1, 2, 3)]
        assert len(set(mr)) == 1 and mt[0] < mt[1] < mt[2]


_SAMPLES = {}


def make_samples_cache(row):
    from transformers import AutoTokenizer

    from fxbudget.models import default_cache_dir

    key = (row["task"], row["length"])
    if key not in _SAMPLES:
        tok = AutoTokenizer.from_pretrained(default_cache_dir())
        _SAMPLES[key] = make_samples(row["task"], tok, row["length"], 2)
    return requests(_SAMPLES[key][row["sample"]])[row["turn"] - 1]


def test_covering_budget_rows_equal_the_unmodified_rows_per_turn(shared_run):
    _, rows = shared_run
    ref = {(r["protocol"], r["sample"], r.get("turn")): r for r in rows if r["rule"] == "full"}
    checked = 0
    for r in rows:
        if r["budget"] == 4096:
            f = ref[(r["protocol"], r["sample"], r.get("turn"))]
            assert r["prediction"] == f["prediction"], r["key"]
            assert r["answer_logprob"] == pytest.approx(f["answer_logprob"], abs=1e-4)
            checked += 1
    assert checked == 2 * 2 * (1 + 2 * 3)


def test_multi_request_first_request_is_the_query_agnostic_row(shared_run):
    """Request 1 of multi-request runs exactly what query-agnostic runs on the same sample (the sample's question is
    its first request's). The unmodified model's row is the same computation split differently (query-agnostic's
    reference prefills context and question in one call, multi-request's in two), so its likelihood agrees to float
    rounding only: bitwise equality there depends on the CPU's matmul blocking."""
    _, rows = shared_run
    qa = {(r["rule"], r["budget"], r["sample"]): r for r in rows if r["protocol"] == "query-agnostic"}
    checked = 0
    for r in rows:
        if r["protocol"] == "multi-request" and r["turn"] == 1:
            q = qa[(r["rule"], r["budget"], r["sample"])]
            assert (r["prediction"], r["kv_held_bytes"]) == (q["prediction"], q["kv_held_bytes"])
            if r["rule"] == "full":
                assert r["answer_logprob"] == pytest.approx(q["answer_logprob"], abs=1e-4)
            else:
                assert r["answer_logprob"] == q["answer_logprob"], r["key"]
                checked += 1
    assert checked == 2 * 2 * 2  # samples x budgeted rules x budgets, bit for bit


def test_report_has_per_turn_tables(shared_run):
    out, rows = shared_run
    text = (out / "report.md").read_text()
    assert "### per request: shared_passkey" in text and "`multi-turn`: several requests over one context" in text
    section = text.split("## protocol: multi-turn")[1]
    assert "| rule | budget | turn 1 | turn 2 | turn 3 | later − turn 1 [95% CI] | p (Holm) |" in section
    assert "shared_passkey 300 #0 turn 2" in section  # the answers table names the turn
    summary = (out / "summary.csv").read_text()
    assert "multi-turn" in summary and "multi-request" in summary


def test_resume_runs_nothing(shared_run, tiny_dir, capsys):
    out, rows = shared_run
    assert main(["compare", "--model", tiny_dir, *RUN, "--protocol", "query-agnostic,multi-request,multi-turn",
                 "--out", str(out)]) == 0
    assert "nothing to run" in capsys.readouterr().err
    # a request's row missing: that configuration runs again (its rows rewritten, one per key)
    path = out / "results.jsonl"
    lines = path.read_text().splitlines()
    drop = next(i for i, line in enumerate(lines) if json.loads(line).get("turn") == 2)
    dropped = json.loads(lines[drop])
    path.write_text("\n".join(lines[:drop] + lines[drop + 1:]) + "\n")
    assert main(["compare", "--model", tiny_dir, *RUN, "--protocol", "query-agnostic,multi-request,multi-turn",
                 "--out", str(out)]) == 0
    again = {r["key"]: r for r in load_rows([out])}
    assert len(again) == len(rows) and again[dropped["key"]]["prediction"] == dropped["prediction"]


def test_decay_of_a_rule_that_fails_later_turns():
    rows = []
    for s in range(8):
        for t in (1, 2, 3):
            base = {"model": "m", "task": "shared_niah", "length": 1000, "sample": s, "seed": 0, "protocol":
                    "multi-turn", "turn": t, "turns": 3, "chunk_size": None, "backend": "none", "prefill_s": 0.0,
                    "decode_s": 0.0, "output_tokens": 3}
            rows.append({**base, "rule": "full", "budget": None, "score": 1.0})
            rows.append({**base, "rule": "snapkv", "budget": 64, "score": 1.0 if t == 1 else 0.0})
            rows.append({**base, "rule": "h2o", "budget": 64, "score": 1.0})
    d = decay([r for r in rows if r["rule"] == "snapkv"])
    assert d.mean == -1.0 and d.n == 8 and d.p < 0.01
    table = turn_table(rows)
    assert "later turns score lower than the first (Holm p < 0.05): **snapkv (B=64)**" in table
    assert "| snapkv | 64 | 1.00 [0.63, 1.00] (8) | 0.00 [0.00, 0.37] (8) | 0.00 [0.00, 0.37] (8) | -1.00" in table
    assert "h2o (B=64)" not in table.split("later turns score lower")[1]


def test_bad_input_refused_before_the_model(tiny_dir, tmp_path, capsys, no_model_load):
    out = str(tmp_path / "out")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--tasks", "passkey", "--protocol", "multi-turn",
                               "--out", out], r"--protocol multi-turn asks several questions of one context, and "
                                              r"task 'passkey' asks one per sample.*shared_niah, shared_passkey")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--tasks", "shared_niah,niah_single", "--protocol",
                               "query-agnostic,multi-request", "--out", out], r"task 'niah_single' asks one")
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"context": "a b c", "question": "q?", "answer": "x"}) + "\n")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--tasks", "", "--task-file", str(path),
                               "--protocol", "multi-request", "--out", out], r"task file .* asks one per sample")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--tasks", "shared_niah", "--rules", "full,kvzip",
                               "--protocol", "multi-turn", "--out", out], r"kvzip runs its own replay protocol")
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--tasks", "shared_niah", "--protocol", "multiturn",
                               "--out", out], r"multi-turn")
    assert not (tmp_path / "out").exists()
    Grid(tasks=["shared_niah"], rules=["full", "kvzip"], protocols=["multi-request"]).validate()  # kvzip applies


def test_kvzip_multi_request_covering_budget(tiny_dir, tmp_path):
    """kvzip's replay compresses the context once, query-agnostic: multi-request runs it, and at a covering budget
    it is the unmodified model on every request."""
    args = ["compare", "--model", tiny_dir, "--tasks", "shared_passkey", "--lengths", "300", "--samples", "1",
            "--rules", "full,kvzip", "--budgets", "100,4096", "--max-new-tokens", "3", "--protocol", "multi-request",
            "--quiet", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = load_rows([tmp_path])
    ref = {r["turn"]: r for r in rows if r["rule"] == "full"}
    kv = [r for r in rows if r["rule"] == "kvzip" and r["budget"] == 4096]
    small = [r for r in rows if r["rule"] == "kvzip" and r["budget"] == 100]
    assert len(kv) == len(small) == 3
    assert all(r["replay_tokens"] == 0 for r in kv) and all(r["replay_tokens"] > 0 for r in small)  # replayed once,
    assert len({r["replay_tokens"] for r in small}) == 1  # the same compressed context for every request
    for r in kv:
        assert r["prediction"] == ref[r["turn"]]["prediction"]
        assert r["answer_logprob"] == pytest.approx(ref[r["turn"]]["answer_logprob"], abs=1e-4)
    assert "per request: shared_passkey" in markdown(rows, [])


def test_compiled_backend_covering_budget_per_turn(tiny_dir, tmp_path):
    """Under a compiled forward (aot_eager) the requests' calls (multi-turn's evicting ones of every length included)
    run compiled, and a covering budget is still the unmodified model on every request."""
    assert main(["compare", "--model", tiny_dir, "--tasks", "shared_passkey", "--lengths", "300", "--samples", "1",
                 "--rules", "full,h2o", "--budgets", "4096", "--protocol", "multi-request,multi-turn", "--backend",
                 "aot_eager", "--max-new-tokens", "3", "--quiet", "--out", str(tmp_path)]) == 0
    rows = load_rows([tmp_path])
    ref = {(r["protocol"], r["turn"]): r for r in rows if r["rule"] == "full"}
    budgeted = [r for r in rows if r["rule"] == "h2o"]
    assert len(budgeted) == 2 * 3 and all(r["compiled_graphs"] for r in budgeted)
    for r in budgeted:
        f = ref[(r["protocol"], r["turn"])]
        assert r["prediction"] == f["prediction"]
        assert r["answer_logprob"] == pytest.approx(f["answer_logprob"], abs=1e-4)
