"""Speculative decoding on a budgeted model (`fxbudget.cache.speculative`): assisted generation with a draft model and
prompt lookup are exact where eviction is frozen or never runs, and refused in one line where decoding evicts.

Oracles: the unmodified model's greedy `generate()` (a covering budget), and the budgeted model's own
non-speculative greedy `generate()` (a small budget, eviction frozen after a prefill that evicted). Every test checks
that drafts were rejected and cropped (`crops`), so the crop is exercised, not skipped."""

from __future__ import annotations

import pytest
import torch

import fxbudget
from fxbudget.cache.budget_cache import BudgetCache
from fxbudget.cache.keyword import cache_kwargs, output_cache

from conftest import fresh, tiny_model

GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
WAYS = ("assistant", "lookup")


def draft_model(arch: str, tokens: int = 4):
    """A second tiny model with the target's vocab, drafting `tokens` tokens every round (random weights: most are
    rejected, which is what the crop is tested on)."""
    draft = tiny_model(arch, layers=1, seed=1)
    cfg = draft.generation_config
    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = tokens, "constant"
    cfg.assistant_confidence_threshold = 0  # draft all `tokens`, however unsure
    return draft


def speculative(way: str, draft) -> dict:
    return {"assistant_model": draft} if way == "assistant" else {"prompt_lookup_num_tokens": 3}


class Crops(list):
    """Every `BudgetCache.crop` argument of a test, in order; `caches`: the ids of the caches cropped."""

    caches: set


@pytest.fixture
def crops(monkeypatch):
    seen = Crops()
    seen.caches = set()
    crop = BudgetCache.crop

    def spy(self, tokens_to_remove):
        seen.append(tokens_to_remove)
        seen.caches.add(id(self))
        return crop(self, tokens_to_remove)

    monkeypatch.setattr(BudgetCache, "crop", spy)
    return seen


def prompt(n: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))  # no pad / bos / eos ids


def generate(model, ids, n: int = 12, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, **GREEDY, **kwargs)


def held(cache: BudgetCache) -> list[list[int]]:
    """Each (layer, KV head)'s held positions, sorted."""
    return [sorted(p for p in row if p >= 0) for i in range(len(cache.layers))
            for row in cache.head_positions(i)[0].tolist()]


def assert_emptied(cache: BudgetCache) -> None:
    """Slots left empty (by a crop or never filled) hold nothing: zero state, per-token signals, keys and values."""
    for layer in cache.layers:
        empty = layer.pos < 0
        assert not layer.state[empty].any() and not layer.norms[empty].any()
        assert not layer.keys[empty].any() and not layer.values[empty].any()


@pytest.mark.newest
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("way", WAYS)
def test_covering_budget_equals_the_unmodified_model(arch, way, crops):
    target, draft = tiny_model(arch), draft_model(arch)
    ids = prompt()
    ref = generate(target, ids)
    m = fxbudget.compile(fresh(target), rule="snapkv", budget=64, backend=None)
    out = generate(m, ids, **speculative(way, draft), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert any(r <= -2 for r in crops), crops  # drafts were rejected and dropped
    # The cache holds each position of the sequence once (no rejected draft left) and its counts agree.
    cache = output_cache(out)
    n = ref.shape[1] - 1  # the last token is never fed
    assert cache.tokens_seen == n and cache.next_pos.tolist() == [n]
    assert all(h == list(range(n)) for h in held(cache))
    assert_emptied(cache)


@pytest.mark.parametrize("rule, backend", [("h2o", "eager"), ("adakv:snapkv", None)])
@pytest.mark.parametrize("way", WAYS)
def test_covering_budget_compiled_and_pooled(rule, backend, way, crops):
    # The compiled forward (Dynamo, eager backend: bucketed verification calls) and the head-pooled layout.
    target, draft = tiny_model("llama"), draft_model("llama")
    ids = prompt()
    ref = generate(target, ids)
    m = fxbudget.compile(fresh(target), rule=rule, budget=64, backend=backend)
    assert torch.equal(generate(m, ids, **speculative(way, draft)), ref)
    assert any(r <= -2 for r in crops), crops


def test_budgeted_draft_model(crops):
    # The draft compiled too: transformers crops its cache as well (5.23: by a count computed from get_seq_length(),
    # a tensor here).
    target, draft = tiny_model("qwen2"), draft_model("qwen2")
    ids = prompt()
    ref = generate(target, ids)
    m = fxbudget.compile(fresh(target), rule="snapkv", budget=64, backend=None)
    fxbudget.compile(draft, rule="h2o", budget=64, backend=None)
    assert torch.equal(generate(m, ids, assistant_model=draft), ref)
    assert any(r <= -2 for r in crops), crops
    assert len(crops.caches) == 2  # the target's cache and the draft's


def frozen_answer(m, ctx, question, n: int = 16, **kwargs):
    """The query-agnostic protocol through `generate()`: the context prefilled with eviction, then the question and
    the answer under `cache.frozen()` (transformers re-feeds `input_ids` in assisted decoding's first call, so the
    question goes in alone, its positions given by a mask over context and question). Returns the answer, the
    cache."""
    cache = m.forward.new_cache(1)
    mask = torch.ones(1, ctx.shape[1] + question.shape[1], dtype=torch.long)
    with torch.no_grad():
        m(input_ids=ctx, past_key_values=cache)
        assert all(len(h) < ctx.shape[1] for h in held(cache))  # the budget evicted
        with cache.frozen():
            out = m.generate(question, attention_mask=mask, **cache_kwargs(m.forward.original, cache),
                             max_new_tokens=n, **GREEDY, **kwargs)
    return out[0, question.shape[1]:], cache


@pytest.mark.newest
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rule", ["snapkv", "h2o"])
@pytest.mark.parametrize("way", WAYS)
def test_small_budget_frozen_equals_the_budgeted_greedy_output(arch, rule, way, crops):
    target, draft = tiny_model(arch), draft_model(arch)
    ctx, question = prompt(40), prompt(4, seed=1)
    question = torch.cat([question, question[:, :2]], 1)  # ends with a bigram seen before: lookup drafts at once
    m = fxbudget.compile(fresh(target), rule=rule, budget=12, backend=None, headroom=24)
    ref, ref_cache = frozen_answer(m, ctx, question)
    assert not crops
    got, cache = frozen_answer(m, ctx, question, **speculative(way, draft))
    assert torch.equal(got, ref), (got.tolist(), ref.tolist())
    assert any(r <= -2 for r in crops), crops
    # The same cache as the non-speculative run's: the same entries (keys to float rounding: a verification call
    # computes them in one matmul), counts and head-room used.
    assert held(cache) == held(ref_cache)
    assert cache.tokens_seen == ref_cache.tokens_seen and torch.equal(cache.next_pos, ref_cache.next_pos)
    assert cache._held == ref_cache._held
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        order, ref_order = layer.pos.argsort(-1), ref_layer.pos.argsort(-1)
        keys = layer.keys.gather(2, order[..., None].expand_as(layer.keys))
        ref_keys = ref_layer.keys.gather(2, ref_order[..., None].expand_as(ref_layer.keys))
        assert (keys - ref_keys).abs().max().item() <= 1e-5
    assert_emptied(cache)


def assert_one_line_refusal(info, *words) -> None:
    msg = str(info.value)
    assert "\n" not in msg and "use the query-agnostic protocol" in msg, msg
    assert all(w in msg for w in words), msg


@pytest.mark.newest
@pytest.mark.parametrize("way", WAYS)
def test_streaming_is_refused(way):
    # Plain generate() past the budget evicts in every call: the first verification call (prompt + drafts) evicted.
    target, draft = tiny_model("llama"), draft_model("llama")
    m = fxbudget.compile(fresh(target), rule="snapkv", budget=8, backend=None)
    with pytest.raises(ValueError, match="streaming protocol") as info:
        generate(m, prompt(), **speculative(way, draft))
    assert_one_line_refusal(info, "budget 8", "the verification call evicted", "without assistant_model")


def test_decode_interval_is_refused_and_exact_when_covering(crops):
    target, draft = tiny_model("llama"), draft_model("llama")
    ids = prompt()
    m = fxbudget.compile(fresh(target), rule="snapkv", budget=8, backend=None, interval=4)
    with pytest.raises(ValueError, match="decode interval 4") as info:
        generate(m, ids, assistant_model=draft)
    assert_one_line_refusal(info)
    m.forward.restore()
    m = fxbudget.compile(m, rule="snapkv", budget=64, backend=None, interval=4)  # nothing evicted: exact
    assert torch.equal(generate(m, ids, assistant_model=draft), generate(target, ids))
    assert any(r <= -2 for r in crops)


def test_full_cache_is_refused_before_any_draft():
    # A cache handed to generate() that is full with eviction on is refused before the first call (nothing runs).
    target, draft = tiny_model("llama"), draft_model("llama")
    m = fxbudget.compile(fresh(target), rule="snapkv", budget=8, backend=None)
    cache = m.forward.new_cache(1)
    ctx, question = prompt(20), prompt(4, seed=1)
    with torch.no_grad():
        m(input_ids=ctx, past_key_values=cache)
    with pytest.raises(ValueError, match="the cache is full") as info:
        generate(m, question, attention_mask=torch.ones(1, 24, dtype=torch.long),
                 **cache_kwargs(m.forward.original, cache), assistant_model=draft)
    assert_one_line_refusal(info)
    assert cache.tokens_seen == 20


def test_evicting_after_a_crop_is_refused(crops):
    # After speculative decoding, the kept entries' accumulated attention holds the rejected drafts' attention: a
    # later call that evicts would rank by it, so it is refused (reset or restore clears it).
    target, draft = tiny_model("llama"), draft_model("llama")
    m = fxbudget.compile(fresh(target), rule="h2o", budget=12, backend=None, headroom=24)
    ctx, question = prompt(40), prompt(4, seed=1)
    snap = None
    cache = m.forward.new_cache(1)
    with torch.no_grad():
        m(input_ids=ctx, past_key_values=cache)
        snap = cache.snapshot()
        with cache.frozen():
            m.generate(question, attention_mask=torch.ones(1, 44, dtype=torch.long),
                       **cache_kwargs(m.forward.original, cache), max_new_tokens=8, assistant_model=draft, **GREEDY)
        assert crops
        seen = cache.tokens_seen
        with pytest.raises(ValueError, match="accumulated attention") as info:
            m(input_ids=prompt(1, seed=2), past_key_values=cache)
        assert_one_line_refusal(info, "cache.restore")
        assert cache.tokens_seen == seen  # refused before it ran
        cache.restore(snap)
        m(input_ids=prompt(1, seed=2), past_key_values=cache)  # evicts: fine on the restored cache


def test_sliding_layers_refuse_a_crop_of_several_tokens_and_take_one(crops):
    # Gemma 3's sliding layers (window 8) hold exactly their window: once full, a crop of r >= 2 drafts would leave
    # the next query without r - 1 tokens of its window; one draft per round is exact.
    target = tiny_model("gemma3")
    ids = prompt()
    m = fxbudget.compile(fresh(target), rule="snapkv", budget=64, backend=None)
    with pytest.raises(ValueError, match="sliding-window layer .window 8.") as info:
        generate(m, ids, assistant_model=draft_model("gemma3"))
    assert "\n" not in str(info.value) and "num_assistant_tokens=1" in str(info.value)
    crops.clear()
    assert torch.equal(generate(m, ids, assistant_model=draft_model("gemma3", tokens=1)), generate(target, ids))
    assert -1 in crops


def test_crop_takes_negative_counts_only():
    cache = BudgetCache(tiny_model("llama").config, 8)
    with pytest.raises(ValueError, match="negative integer"):
        cache.crop(3)
    with pytest.raises(TypeError):
        cache.crop(1.5)
    cache.crop(0)  # nothing to drop: a no-op
    assert cache.tokens_seen == 0
