"""`kvzip` (issue 23): the replay's score against a float64 plain-Python reference (the kernel's kept sets, and on a
model against its own attention), the protocol (replay tokens never cached, positions rewound, a covering budget is
the unmodified model), bad hyperparameters, the refusal outside the protocol, and `compare --rules kvzip`."""

import math

import pytest
import torch

import fxbudget
from conftest import fresh, tiny_model
from fxbudget import kernel_fingerprint, rules
from fxbudget.kernel import budget_attention
from fxbudget.harness.kvzip_protocol import REPEAT_PROMPT, compress, replay_ids, template_parts

H, G, D = 2, 3, 8
DT = torch.float64


def _reference_kept(k, q, slot_pos, budget, n_sink, prefix=0):
    """Plain Python, float64. `k` `[H, S + m, D]`: the cached keys (slot order) then the replay's; `q` `[H * G, m, D]`
    the replay's queries. Per KV head, each cached token's largest attention probability over the replay's queries
    (causal among the replay, every cached token visible) and the group's query heads; sinks first; returns the top
    `budget` positions per head, sorted. The header (positions n_sink..prefix) scores 0."""
    m = q.shape[1]
    S = k.shape[1] - m
    kept = []
    for h in range(H):
        best = [0.0] * S
        for j in range(G):
            for t in range(m):
                qv = q[h * G + j, t].tolist()
                logits = [sum(a * b for a, b in zip(qv, k[h, c].tolist())) / math.sqrt(D) for c in range(S + t + 1)]
                top = max(logits)
                ex = [math.exp(x - top) for x in logits]
                total = sum(ex)
                for c in range(S):
                    best[c] = max(best[c], ex[c] / total)
        score = {int(slot_pos[h, c]): (math.inf if slot_pos[h, c] < n_sink else 0.0 if slot_pos[h, c] < prefix
                                       else best[c]) for c in range(S)}
        kept.append(sorted(sorted(score, key=lambda p: (score[p], p))[-budget:]))
    return kept


@pytest.mark.parametrize("L, m, budget, n_sink, prefix", [(20, 6, 8, 4, 0), (24, 9, 5, 0, 0), (16, 4, 12, 2, 0),
                                                          (20, 6, 8, 2, 7)])
def test_kernel_keeps_the_reference_top_budget(L, m, budget, n_sink, prefix):
    """The replay call on a full cache of `L` context tokens (slots in shuffled order): the kernel keeps exactly the
    reference's top `budget` and none of the replay's tokens."""
    gen = torch.Generator().manual_seed(L + m)
    k_new = torch.randn(1, H, m, D, generator=gen, dtype=DT)
    v_new = torch.randn(1, H, m, D, generator=gen, dtype=DT)
    q = torch.randn(1, H * G, m, D, generator=gen, dtype=DT) * 2
    ks = torch.randn(1, H, L, D, generator=gen, dtype=DT)
    vs = torch.randn(1, H, L, D, generator=gen, dtype=DT)
    slot_pos = torch.stack([torch.randperm(L, generator=gen) for _ in range(H)]).unsqueeze(0)  # unordered slots
    k_ref = torch.cat([ks, k_new], dim=2)[0].clone()
    pos = slot_pos.clone()
    rule = rules.get("kvzip", n_sink=n_sink, prefix_length=prefix)
    budget_attention(q, ks, vs, pos, torch.zeros(1, H, L), torch.zeros(1, H, L, 3), torch.zeros(1, H, 9),
                     k_new, v_new, torch.arange(L, L + m), rule=rule, budget=budget, window=rule.window)
    got = [sorted(p for p in row if p >= 0) for row in pos[0].tolist()]
    assert got == _reference_kept(k_ref, q[0], slot_pos[0], budget, n_sink, prefix)


def _model_reference_kept(model, ctx, replay, budget, n_sink):
    """The unmodified model (eager attention, float64) on context + replay in one call: per layer and KV head, the
    top `budget` context positions by the max over replay queries and the group of its attention probabilities."""
    eager = fresh(model)
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        att = eager(input_ids=torch.cat([ctx, replay], dim=1), output_attentions=True).attentions
    kv = model.config.num_key_value_heads
    g = model.config.num_attention_heads // kv
    L, m = ctx.shape[1], replay.shape[1]
    out = []
    for a in att:
        score = a[0, :, L:, :L].reshape(kv, g * m, L).amax(dim=1)
        score[:, :n_sink] = math.inf
        out.append([sorted(torch.topk(row, budget).indices.tolist()) for row in score])
    return out


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_protocol_keeps_the_models_own_top_budget(backend):
    """On a model (float64): the kept sets after `compress` are the top budget by the model's own replay attention;
    no replay token is cached; the positions are rewound, so the question follows the context."""
    model = tiny_model("llama", layers=2).double()
    gen = torch.Generator().manual_seed(0)
    ctx, replay, question = (torch.randint(0, 96, (1, n), generator=gen) for n in (40, 12, 5))
    m = fxbudget.compile(fresh(model), rule="kvzip", budget=16, backend=backend, chunk_size=16)
    done = compress(m, ctx, replay, headroom=8)
    assert done.replay_tokens == 12 and done.prefill_s >= done.replay_s > 0
    ref = _model_reference_kept(model, ctx, replay, 16, 4)
    for i in range(2):
        got = [sorted(p for p in row if p >= 0) for row in done.cache.positions(i)[0].tolist()]
        assert got == ref[i], i
    assert int(done.cache.get_seq_length()) == 40 and done.cache.next_pos.tolist() == [40]
    with done.cache.frozen(), torch.no_grad():
        m(input_ids=question, cache=done.cache)
    for i in range(2):
        for row, kept in zip(done.cache.positions(i)[0].tolist(), ref[i]):
            assert sorted(p for p in row if p >= 0) == kept + list(range(40, 45))


def test_replay_tokens_would_be_kept_by_their_attention():
    """The -inf on the call's own tokens is what keeps the replay out: scored by `window_max_attn` like the cached
    tokens, replay tokens are kept (so the protocol's check can fail)."""
    model = tiny_model("llama", layers=2)
    gen = torch.Generator().manual_seed(3)
    ctx, replay = torch.randint(0, 96, (1, 30), generator=gen), torch.randint(0, 96, (1, 10), generator=gen)

    class Leaky(type(rules.get("kvzip"))):
        def score(self, s):
            return s.window_max_attn

    m = fxbudget.compile(fresh(model), rule=Leaky(), budget=12, backend=None)
    with pytest.raises(RuntimeError, match="kept a replay token"):
        compress(m, ctx, replay)


def test_covering_budget_reproduces_the_model():
    """A budget covering the context: nothing is evicted (no replay, as the reference at ratio 0), and the question
    and three greedy steps give the unmodified model's logits and tokens."""
    model = tiny_model("qwen2", layers=2).double()
    gen = torch.Generator().manual_seed(1)
    ctx, replay, question = (torch.randint(0, 96, (1, n), generator=gen) for n in (24, 8, 4))
    m = fxbudget.compile(fresh(model), rule="kvzip", budget=24, backend=None)
    done = compress(m, ctx, replay, headroom=16)
    assert done.replay_tokens == 0 and done.replay_s == 0
    ids, got = torch.cat([ctx, question], dim=1), []
    with torch.no_grad(), done.cache.frozen():
        out = m(input_ids=question, cache=done.cache)
        got.append(out.logits[:, -1])
        for _ in range(3):
            out = m(input_ids=got[-1].argmax(-1, keepdim=True), cache=done.cache)
            got.append(out.logits[:, -1])
        ref = fresh(model)
        want = []
        for _ in range(4):
            want.append(ref(input_ids=ids).logits[:, -1])
            ids = torch.cat([ids, want[-1].argmax(-1, keepdim=True)], dim=1)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-10, atol=1e-10)
    assert [x.argmax().item() for x in got] == [x.argmax().item() for x in want]


def test_same_kernel_fingerprint_as_every_rule():
    model = tiny_model("llama", layers=2)
    assert kernel_fingerprint(model, rule="kvzip", budget=16) == kernel_fingerprint(model, rule="snapkv", budget=16)


@pytest.mark.parametrize("params, match", [
    ({"n_sink": -1}, "kvzip n_sink must be an int >= 0, got -1"),
    ({"chunk_size": 0}, "kvzip chunk_size must be an int >= 1, got 0"),
    ({"prefix_length": -1}, "kvzip prefix_length must be an int >= 0, got -1"),
    ({"chunk_size": 2.5}, "kvzip chunk_size must be an int >= 1, got 2.5"),
    ({"kvzip_plus_normalization": 1}, "kvzip kvzip_plus_normalization must be a bool, got 1"),
    ({"kvzip_plus_normalization": True}, "kvzip kvzip_plus_normalization=True is not supported: KVzip+ weighs each "
                                         "replay query by 1/||h|| and each candidate by its per-query-head "
                                         "||W_o v||_2 inside the max, signals the shared kernel does not measure"),
])
def test_bad_hyperparameters_are_refused(params, match):
    with pytest.raises(ValueError) as e:
        rules.get("kvzip", **params)
    assert str(e.value) == match


def test_defaults_are_the_references():
    rule = rules.get("kvzip")
    assert rule.params() == {"n_sink": 4, "kvzip_plus_normalization": False, "chunk_size": 2048, "prefix_length": 0}
    assert rule.window == 2048 + 64
    from fxbudget.cli.rules_table import rules_table

    assert "| `kvzip` |" in rules_table()
    assert "n_sink=4, kvzip_plus_normalization=False, chunk_size=2048, prefix_length=0" in rules_table()


def test_refused_outside_its_protocol():
    """Plain calls and generate() are refused with the protocol named; frozen calls are allowed; compress refuses a
    model compiled with another rule, too long a context or replay, and sliding-window models."""
    model = tiny_model("llama", layers=2)
    m = fxbudget.compile(fresh(model), rule="kvzip", budget=8, backend=None)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    msg = "rule 'kvzip' scores a replay of the context and evicts only in its protocol: use fxbudget.harness.kvzip_protocol"
    with pytest.raises(ValueError, match=msg), torch.no_grad():
        m(input_ids=ids)
    with pytest.raises(ValueError, match=msg), torch.no_grad():
        m.generate(ids, max_new_tokens=2, do_sample=False)
    cache = m.forward.new_cache(1, headroom=16)
    with cache.frozen(), torch.no_grad():
        m(input_ids=ids, cache=cache)
    with pytest.raises(ValueError, match="needs a model compiled by fxbudget.compile\\(model, rule='kvzip'"):
        compress(fxbudget.compile(fresh(model), rule="snapkv", budget=8, backend=None), ids, ids)
    # (`chunk_size` of compile() is its prefill chunking: the rule's own is set on the instance)
    short = fxbudget.compile(fresh(model), rule=rules.get("kvzip", chunk_size=10), budget=8, backend=None)
    with pytest.raises(ValueError, match="kvzip: a context of 12 tokens exceeds chunk_size=10; .* chunk_size >= 12"):
        compress(short, ids, ids[:, :4])
    with pytest.raises(ValueError, match="kvzip: the replay of 75 tokens exceeds the kernel window 74"):
        compress(short, ids[:, :8], torch.zeros(1, 75, dtype=torch.long))
    gemma = fxbudget.compile(tiny_model("gemma3", layers=3), rule="kvzip", budget=8, backend=None)
    with pytest.raises(ValueError, match="kvzip: models with sliding-window layers are not supported"):
        compress(gemma, ids, ids)


class _Tok:
    """A tokenizer stand-in: one id per character; a chat template wrapping the user text as `<u>...</u><a>`."""

    def __init__(self, template: bool):
        self.chat_template = "x" if template else None

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return type("Enc", (), {"input_ids": torch.tensor([[ord(c) for c in text]])})()

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking=True):
        return f"<u>{messages[0]['content']}</u><a>"


@pytest.mark.parametrize("template", [False, True])
def test_replay_ids_follow_the_reference(template):
    """The repeat prompt, the assistant header (or "\\n" without a template), then the context after the template's
    user header."""
    tok = _Tok(template)
    text = "<u>the context" if template else "the context"
    ctx = tok(text).input_ids
    assert template_parts(tok)[0] == (3 if template else 0)
    want = REPEAT_PROMPT + ("</u><a>" if template else "\n") + "the context"
    assert "".join(map(chr, replay_ids(tok, ctx)[0].tolist())) == want


def test_compare_runs_the_protocol(tiny_dir, tmp_path):
    """`compare --rules full,snapkv,kvzip`: kvzip's rows ran the replay (its time part of the prefill), record the
    replay's window and the shared kernel fingerprint; at a covering budget kvzip answers as the reference."""
    from transformers import AutoTokenizer

    from fxbudget.cli import main
    from fxbudget.harness.report import load_rows

    out = tmp_path / "run"
    assert main(["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--rules",
                 "full,snapkv,kvzip", "--budgets", "48,4096", "--samples", "1", "--max-new-tokens", "4", "--quiet",
                 "--out", str(out)]) == 0
    rows = {(r["rule"], r["budget"]): r for r in load_rows([out])}
    small, big, full = rows["kvzip", 48], rows["kvzip", 4096], rows["full", None]
    assert small["replay_tokens"] > small["context_tokens"] // 2 and 0 < small["replay_s"] <= small["prefill_s"]
    assert big["replay_tokens"] == 0 and big["prediction"] == full["prediction"]
    assert big["answer_logprob"] == pytest.approx(full["answer_logprob"], abs=1e-4)
    assert small["window"] == 2112 and rows["snapkv", 48]["window"] == 32
    assert small["rule_params"]["prefix_length"] == template_parts(AutoTokenizer.from_pretrained(tiny_dir))[0] > 0
    assert small["kernel_fingerprint"] == rows["snapkv", 48]["kernel_fingerprint"]
    assert small["kv_held_bytes"] == rows["snapkv", 48]["kv_held_bytes"]


def test_compare_refuses_other_protocols(tiny_dir, tmp_path, capsys):
    from fxbudget.cli import main

    code = main(["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--rules", "kvzip",
                 "--budgets", "48", "--protocol", "query-agnostic,query-aware", "--quiet", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "kvzip runs its own replay protocol, a query-agnostic one: run it with --protocol query-agnostic" in err
