"""Left-padded batches (issue 10): each row runs as if alone; pads are never visible and never kept."""

import pytest
import torch

import fxbudget
from conftest import fresh, tiny_model

LENGTHS = (9, 17, 24)
STEPS = 6


def _padded(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 96, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), torch.ones(len(p), dtype=torch.long)])
                        for p in prompts])
    return prompts, ids, mask


def _greedy_masked(model, ids, mask, steps, chunk=None):
    """Prefill a left-padded batch, then `steps` greedy steps, passing the growing mask as generate() does."""
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, logits = out.past_key_values, [out.logits[:, -1]]
    for _ in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1), cache


def _alone(model, prompt, steps):
    out = model(input_ids=prompt[None], use_cache=True)
    cache, logits = out.past_key_values, [out.logits[:, -1]]
    for _ in range(steps):
        out = model(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)[0]


@pytest.mark.parametrize("rule", [r for r in fxbudget.rules.available()  # kvzip: its own protocol, one length
                                  if not fxbudget.rules.get(r).replay_only])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_padded_batch_equals_each_prompt_alone(arch, rule):
    model = tiny_model(arch)
    prompts, ids, mask = _padded()
    budget = max(LENGTHS) + STEPS  # covers every row
    with torch.no_grad():
        m = fxbudget.compile(fresh(model), rule=rule, budget=budget, backend=None, block=4,
                             **({"window": 4} if rule == "pyramidkv" else {}))  # pyramid needs budget > window
        got, cache = _greedy_masked(m, ids, mask, STEPS)
        for row, prompt in enumerate(prompts):
            ref = _alone(model, prompt, STEPS)
            assert (got[row] - ref).abs().max().item() <= 1e-4, row
    for i, layer in enumerate(cache.layers):
        for row, n in enumerate(LENGTHS):
            held = sorted(p for p in cache.positions(i)[row, 0].tolist() if p >= 0)
            total = n + STEPS
            assert held == (list(range(max(0, total - layer.sliding), total)) if layer.sliding else list(range(total)))


@pytest.mark.parametrize("rule", ["snapkv", "h2o", "expected_attention"])
def test_padded_batch_with_eviction_compiled_equals_eager(rule):
    model = tiny_model("llama")
    _, ids, mask = _padded(seed=1)
    kw = dict(rule=rule, budget=8, chunk_size=10, block=4, **({"window": 4} if rule == "snapkv" else {}))
    with torch.no_grad():
        ref, ref_cache = _greedy_masked(fxbudget.compile(fresh(model), backend=None, **kw), ids, mask, 3)
        got, cache = _greedy_masked(fxbudget.compile(fresh(model), backend="aot_eager", **kw), ids, mask, 3)
    assert (got - ref).abs().max().item() <= 1e-4
    for i in range(len(cache.layers)):
        assert torch.equal(cache.positions(i), ref_cache.positions(i)), i
        assert int((cache.positions(i) >= 0).sum(-1).max()) == 8  # it evicted down to the budget


def test_generate_left_padded_batch_matches_each_prompt():
    model = tiny_model("qwen2")
    prompts, ids, mask = _padded(seed=2)
    gen = dict(max_new_tokens=5, do_sample=False)
    m = fxbudget.compile(fresh(model), rule="snapkv", budget=64, backend=None)
    out = m.generate(ids, attention_mask=mask, **gen)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], **gen)[0, len(prompt):]
        assert torch.equal(out[row, ids.shape[1]:], alone), row


@pytest.mark.parametrize("mask, match", [
    ([[1, 0, 1, 1], [1, 1, 1, 1]], "left padding"),   # a hole
    ([[1, 1, 1, 0], [1, 1, 1, 1]], "left padding"),   # right padding
    ([[0, 1, 2, 1], [1, 1, 1, 1]], "left padding"),   # not 0/1
    ([[1, 1, 1], [1, 1, 1]], r"\[batch, past \+ new tokens\]"),
])
def test_bad_padding_mask_is_refused(mask, match):
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), budget=8, backend=None)
    cache = m.forward.new_cache(2)
    with pytest.raises(ValueError, match=match):
        m(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor(mask), past_key_values=cache)
    assert cache.tokens_seen == 0 and int((cache.positions(0) >= 0).sum()) == 0  # nothing changed


@pytest.mark.parametrize("width", [5, 6])  # the past part's 1s do not match row 0's pad; a mask of the wrong width
def test_mask_must_match_the_cache(width):
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), budget=8, backend=None)
    with torch.no_grad():
        out = m(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
        # A call of several tokens reads its mask back once and checks it whole.
        with pytest.raises(ValueError, match="does not match the cache"):
            m(input_ids=torch.ones(2, 2, dtype=torch.long), attention_mask=torch.ones(2, width, dtype=torch.long),
              past_key_values=out.past_key_values)


def test_decode_step_reads_only_the_new_mask_column():
    # A decode step reads nothing back (no host sync): its mask counts only in its new column, where a 0 masks the
    # token out (never visible, never kept, the row's positions do not advance), as transformers treats a 0 there.
    model = tiny_model("llama")
    m = fxbudget.compile(fresh(model), budget=16, backend=None)
    with torch.no_grad():
        out = m(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
        cache = out.past_key_values
        m(input_ids=torch.ones(2, 1, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]),
          past_key_values=cache)
    assert cache.next_pos.tolist() == [3, 3] and cache.tokens_seen == 4
    assert [sorted(p for p in cache.positions(0)[r, 0].tolist() if p >= 0) for r in range(2)] == [[0, 1, 2], [0, 1, 2]]
