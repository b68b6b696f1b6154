"""A budget that covers the sequence reproduces the unmodified model, for every registered rule."""

import pytest
import torch

import fxbudget
from conftest import fresh, greedy, tiny_model
from fxbudget.cache.keyword import output_cache

# kvzip evicts only in its replay protocol: its covering budget is tested in tests/test_kvzip.py
RULES = [r for r in fxbudget.rules.available() if not fxbudget.rules.get(r).replay_only]
STEPS = 20


COVERING = 64  # a budget covering the 24 + STEPS tokens of every run below, the same for every rule


def _one_per_setup(rules: list[str]) -> list[str]:
    """The first rule (by name) of each way a rule changes what runs besides its score: the rotary inverse it needs,
    the output projection it needs, per-layer budgets, its own observation window, never evicting. At a covering
    budget the score selects nothing, so these are the rule-dependent parts of a covering run."""
    from fxbudget.rules.base import Rule

    def setup(name):
        r = fxbudget.rules.get(name)
        return (r.needs_rope, r.needs_wo, type(r).layer_budgets is not Rule.layer_budgets, r.window is not None,
                r.never_evicts)

    first: dict[tuple, str] = {}
    for name in sorted(rules):
        first.setdefault(setup(name), name)
    return sorted(first.values())


def _check_exact(arch: str, rule: str, backend, layers: int = 2, batch: int = 1, chunk_size=None, block=None):
    model = tiny_model(arch, layers=layers)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (batch, 24))
    with torch.no_grad():
        ref, _ = greedy(model, ids, STEPS)
        compiled = fxbudget.compile(fresh(model), rule=rule, budget=COVERING, backend=backend, chunk_size=chunk_size,
                                    block=block)
        got, cache = greedy(compiled, ids, STEPS)
    assert (got - ref).abs().max().item() <= 1e-4
    seq = 24 + STEPS
    for i, layer in enumerate(cache.layers):
        expect = list(range(seq - layer.sliding, seq)) if layer.sliding else list(range(seq))
        for row, heads in enumerate(cache.positions(i).tolist()):  # every batch row and KV head
            for head, kept in enumerate(heads):
                held = sorted(p for p in kept if p >= 0)
                assert held == expect, f"layer {i} (sliding={layer.sliding}) row {row} head {head} holds {held}"


@pytest.mark.newest
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_full_budget_reproduces_model_eager(arch, rule):
    _check_exact(arch, rule, backend=None)


@pytest.mark.parametrize("rule", ["snapkv", "pyramidkv"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_full_budget_batched_and_chunked_eager(arch, rule):
    _check_exact(arch, rule, backend=None, batch=2, chunk_size=7)


@pytest.mark.parametrize("arch, backend", [("llama", None), ("llama", "aot_eager"), ("qwen2", None)])
def test_pyramidkv_covering_budget_on_two_layers(arch, backend):
    """The issue's case: 2 layers, budget 128, 48 tokens. The prompt is shorter than the budget, so, as in the
    reference code, no layer evicts; every layer holds the whole sequence and the logits are the model's."""
    model = tiny_model(arch, layers=2)
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        ref, _ = greedy(model, ids, 8)
        got, cache = greedy(fxbudget.compile(fresh(model), rule="pyramidkv", budget=128, backend=backend), ids, 8)
    assert (got - ref).abs().max().item() <= 1e-4
    assert cache.layer_budgets == [128, 128] and all(int((cache.positions(i) >= 0).sum(-1).min()) == 48
                                                      for i in range(2))


# The compiled covering runs below take one rule per setup (`_one_per_setup`) or kind of signal, not every rule: only
# the rule region differs between rules (test_graph.py's fingerprint test proves the rest equal), and at a covering
# budget its score selects nothing. Every rule runs this test eagerly above, its region is compiled by Inductor with
# eviction in test_eviction.py::test_inductor_layer_evicts_like_eager, and its whole model evicts alike under
# aot_eager and eagerly in test_eviction.py::test_aot_eager_equals_eager.
@pytest.mark.parametrize("rule", _one_per_setup(RULES))
def test_full_budget_reproduces_model_aot_eager_gemma3(rule):
    # The graph pass on a model with sliding-window layers (cheap: no Inductor); blocks of 8 queries: the 24-token
    # prefill runs the traced scan over query blocks (the automatic block would take all 24 at once).
    _check_exact("gemma3", rule, backend="aot_eager", block=8)


def test_one_per_setup_keeps_each_setup():
    assert _one_per_setup(["snapkv", "knorm", "h2o", "pyramidkv", "expected_attention", "criticalkv", "full"]) == [
        "criticalkv", "expected_attention", "full", "h2o", "pyramidkv", "snapkv"]


# Inductor on the whole model for one rule per kind of signal (snapkv: the observation window's attention; knorm: a
# per-token signal cached with the entry). The head-pooled layout under Inductor: test_adakv.py.
@pytest.mark.inductor
@pytest.mark.parametrize("rule", ["snapkv", "knorm"])
def test_full_budget_reproduces_model_inductor(rule):
    # Blocks of 8: the 24-token prefill reaches the compiled scan over query blocks (three of them).
    _check_exact("llama", rule, backend="inductor", layers=1, block=8)


@pytest.mark.newest
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_generate_prefills_and_decodes_through_the_budget_cache(backend):
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 20))
    gen = dict(max_new_tokens=8, do_sample=False)
    ref = model.generate(ids, **gen)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=64, backend=backend, chunk_size=7)
    out = m.generate(ids, **gen, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values
    assert isinstance(cache, fxbudget.BudgetCache) and cache.tokens_seen == 27
    with pytest.raises(ValueError, match="left padding"):  # left padding works (tests/test_padding.py), holes do not
        m.generate(torch.randint(0, 96, (2, 5)), attention_mask=torch.tensor([[1, 0, 1, 1, 1], [1] * 5]), **gen)


@pytest.mark.newest
@pytest.mark.parametrize("arch, backend", [*[(arch, None) for arch in ("llama", "mistral", "qwen3", "phi3", "gemma3")],
                                           *[(arch, "aot_eager") for arch in ("llama", "qwen3", "gemma3")]])
def test_generate_on_each_architecture(arch, backend):
    """generate() on the installed transformers (5.24 renamed its cache argument): the unmodified model's tokens."""
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 12))
    gen = dict(max_new_tokens=4, do_sample=False)
    ref = model.generate(ids, **gen)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=64, backend=backend)
    out = m.generate(ids, **gen, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert isinstance(output_cache(out), fxbudget.BudgetCache) and output_cache(out).tokens_seen == 15


@pytest.mark.newest
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_cache_under_either_name(backend):
    """The cache is accepted as `cache=` (transformers >= 5.24) and as `past_key_values=`; never both at once."""
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        ref, _ = greedy(model, ids, 2)
        m = fxbudget.compile(fresh(model), rule="h2o", budget=64, backend=backend)
        for name in ("cache", "past_key_values"):
            cache = m.forward.new_cache()
            out = m(input_ids=ids, **{name: cache})
            assert output_cache(out) is cache and cache.tokens_seen == 10, name
            out = m(input_ids=ref[0].argmax(-1, keepdim=True), **{name: cache})
            assert cache.tokens_seen == 11 and (out.logits[:, -1] - ref[1]).abs().max() <= 1e-4, name
        with pytest.raises(TypeError, match="both cache= and past_key_values="):
            m(input_ids=ids, cache=m.forward.new_cache(), past_key_values=m.forward.new_cache())


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_chunked_prefill_loss_spans_chunks(backend):
    """`labels` with chunked prefill: one loss over every chunk's logits, each chunk's last position predicting the
    next chunk's first token; under a covering budget it is the unmodified model's loss."""
    model = tiny_model("qwen2")
    torch.manual_seed(2)
    ids = torch.randint(0, 96, (2, 20))
    labels = ids.clone()
    labels[0, 9] = -100  # an ignored label at a chunk boundary
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=COVERING, backend=backend, chunk_size=8, window=4)
    out = m(input_ids=ids, labels=labels)  # chunks of 8, 8, 4
    assert out.logits.shape == ref.logits.shape
    assert (out.logits - ref.logits).abs().max() <= 1e-4 and (out.loss - ref.loss).abs() <= 1e-5
    with pytest.raises(ValueError, match="labels with chunked prefill"):
        m(input_ids=ids, labels=labels, logits_to_keep=1)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_grad_mode_runs_without_autograd(backend):
    """`model(ids, labels=ids)` outside torch.no_grad() (perplexity): inference-only, the no-grad numbers."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        ref = fxbudget.compile(fresh(model), rule="snapkv", budget=12, backend=None, window=4)(input_ids=ids,
                                                                                             labels=ids)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=12, backend=backend, window=4)
    assert torch.is_grad_enabled()
    out = m(input_ids=ids, labels=ids)  # evicts: 20 tokens into 12 slots
    assert not out.logits.requires_grad and not out.loss.requires_grad
    assert (out.loss - ref.loss).abs() <= 1e-5 and (out.logits - ref.logits).abs().max() <= 1e-4
    cache = output_cache(out)
    step = m(input_ids=ids[:, :1], cache=cache)  # decode outside no_grad too
    assert not step.logits.requires_grad and cache.tokens_seen == 21
    assert not any(t.requires_grad for layer in cache.layers for t in (layer.keys, layer.values, layer.state))


def _forced_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits `[batch, len, vocab]` (float64) of a prefill of `ids[:, :prefill]` then one decode step per further token
    of `ids` (teacher-forced: every model sees the same tokens)."""
    out = model(input_ids=ids[:, :prefill], use_cache=True)
    logits, cache = [out.logits], output_cache(out)
    for i in range(prefill, ids.shape[1]):
        out = model(input_ids=ids[:, i:i + 1], use_cache=True, past_key_values=cache)
        logits.append(out.logits)
    return torch.cat(logits, dim=1).double()


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_covering_budget_in_bf16_is_as_close_to_fp32_as_the_model(arch, backend):
    """bf16 end to end: with a covering budget, the budgeted bf16 model is no further from the fp32 model than the
    unmodified bf16 model is (<= 1.1x, RMS over the logits of a prefill and 12 decode steps)."""
    model = tiny_model(arch)
    ids = torch.randint(0, 96, (1, 36), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = _forced_logits(model, ids, 24)
        plain = _forced_logits(fresh(model).to(torch.bfloat16), ids, 24)
        m = fxbudget.compile(fresh(model).to(torch.bfloat16), rule="snapkv", budget=COVERING, backend=backend)
        got = _forced_logits(m, ids, 24)
    rms = lambda x: ((x - ref) ** 2).mean().sqrt().item()  # noqa: E731
    assert rms(got) <= 1.1 * rms(plain), (rms(got), rms(plain))
