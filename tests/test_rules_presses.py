"""kvpress's training-free presses added in issue 43 (`criticalkv`, `simlayerkv`, `finch`, `non_causal_attention`, the
`Chunk` wrapper):
float64 references written from each press's formula over one prompt (a one-call prefill, positions 0..L-1),
independently of the rules' code, compared with the rule's score on the kernel's signals of the same call (empty
slots present); bad hyperparameters and unwrappable rules refused in one line; a real model evicting to the budget.
The combination matrix, the exactness tests and the rules table pick the rules up from the registry."""

import math

import pytest
import torch
import torch.nn.functional as F

import fxbudget
from conftest import chunked_prefill_then_decode, fresh, tiny_model
from fxbudget import rules
from fxbudget.cli.rules_table import rules_table
from fxbudget.kernel import LayerConstants, LayerSlots, NewTokens, measure
from fxbudget.kernel.signals import out_projection_factors, unknown_wo
from fxbudget.rules.base import Signals
from test_rules_reference import DT, EMPTY, D, G, H, _causal_probs, _noncausal_ref, _prompt, _rot
from test_rules_reference import assert_score_follows_slots

NEW = ("criticalkv", "simlayerkv", "finch", "non_causal_attention", "capkv")
HIDDEN = 24


def _signals(k, v, q, inv_freq, window, budget, wo=None):
    """The kernel's float64 signals of one call (the prompt's tokens) over `EMPTY` empty slots; `wo` the layer's
    output-projection weight `[HIDDEN, H * G * D]` (None: unknown)."""
    L = k.shape[1]
    slot_pos = torch.full((1, H, EMPTY), -1)
    z = torch.zeros(1, H, EMPTY, D, dtype=DT)
    slots = LayerSlots(z, z, slot_pos, torch.zeros(1, H, EMPTY, dtype=DT), torch.zeros(1, H, EMPTY, 3, dtype=DT),
                       None, None)
    new = NewTokens(k.unsqueeze(0), v.unsqueeze(0), torch.arange(L).unsqueeze(0))
    factors = unknown_wo(H, G, D, "cpu") if wo is None else out_projection_factors(wo, H, D)
    _, _, sig = measure(q.unsqueeze(0), slots, new, LayerConstants(inv_freq, factors), window=window, sliding=0,
                        scale=None)
    return Signals(**sig, budget=budget, window=min(window, L))


def _kvpress_snapkv(q, k, w, kernel=5):
    """kvpress's SnapKVPress.score: mean window attention on the context, avg-pooled, the window at max + 1."""
    att = _causal_probs(q, k)[:, :, -w:, :-w].mean(2)  # [H, G, L - w]
    pooled = F.avg_pool1d(att.reshape(H * G, 1, -1), kernel, stride=1, padding=kernel // 2).view(H, G, -1).mean(1)
    return F.pad(pooled, (0, w), value=pooled.max().item() + 1)  # [H, L]


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_criticalkv_two_stages_with_the_wo_weighted_norm(ratio):
    L, w, budget = 60, 8, 20
    _, k, v, q, inv = _prompt(L, seed=3)
    wo = torch.randn(HIDDEN, H * G * D, generator=torch.Generator().manual_seed(4), dtype=DT)
    rule = rules.get("criticalkv", window=w, first_stage_ratio=ratio)
    got = rule.score(_signals(k, v, q, inv, w, budget, wo))[0, :, EMPTY:]
    base = _kvpress_snapkv(q, k, w)
    # ||W_o^(j) v||_2 per query head j of each KV group, averaged over the group (kvpress: the L1 norm).
    wov = torch.stack([(v[h] @ wo[:, j * D:(j + 1) * D].T).norm(dim=-1)
                       for h in range(H) for j in range(h * G, (h + 1) * G)]).view(H, G, L).mean(1)
    ref = (base + 1e-4) * wov
    n1 = int(ratio * budget)
    # stage 1's ties (the window's tokens all score max + 1: with n1 < w some of them) go to the older position
    order = torch.argsort(base, dim=-1, descending=True, stable=True)
    first = torch.zeros(H, L, dtype=torch.bool).scatter(-1, order[:, :n1], True)
    ref = torch.where(first, torch.finfo(torch.float64).max, ref)
    torch.testing.assert_close(got, ref)
    kept = got.topk(budget, dim=-1).indices.sort(-1).values  # what the kernel keeps (no ties at these scores)
    assert first.gather(-1, kept).sum(-1).tolist() == [n1] * H


def test_criticalkv_needs_wo_and_adakv_composes():
    assert rules.get("criticalkv").needs_wo and rules.get("adakv:criticalkv").needs_wo
    ada = rules.get("adakv:criticalkv", alpha=0.1, window=16, first_stage_ratio=0.25)
    assert ada.head_adaptive and ada.rule.window == 16 and ada.rule.first_stage_ratio == 0.25 and ada.alpha == 0.1


@pytest.mark.parametrize("threshold, lazy", [(0.05, True), (0.999, False)])
def test_simlayerkv_lazy_layers_keep_sinks_and_recent(threshold, lazy):
    L, w, budget, n_initial = 50, 8, 20, 4
    _, k, v, q, inv = _prompt(L, seed=5)
    rule = rules.get("simlayerkv", lazy_threshold=threshold, n_initial=n_initial, window=w)
    s = _signals(k, v, q, inv, w, budget)
    got, protected = rule.score(s)[0, :, EMPTY:], rule.protect(s)[0, :, EMPTY:]
    # kvpress's is_lazy: the last query's attention over the keys before it, mean over every query head, on the first
    # n_initial and the last n_recent of those keys (n_recent = budget - n_initial + 1: the lazy layer then keeps B).
    n_recent = budget - n_initial + 1
    last = _causal_probs(q, k)[:, :, -1, :-1].mean((0, 1))  # [L - 1]
    mass = last[:n_initial].sum() + last[-n_recent:].sum()
    assert bool(mass > threshold) == lazy
    if lazy:
        torch.testing.assert_close(got, torch.arange(L, dtype=DT).expand(H, L))
        assert protected[:, :n_initial].all() and not protected[:, n_initial:].any()
        # what the kernel keeps: the sinks, then the newest
        keep = torch.where(protected, math.inf, got).topk(budget, dim=-1).indices.sort(-1).values
        assert keep.tolist() == [list(range(n_initial)) + list(range(L - budget + n_initial, L))] * H
    else:
        torch.testing.assert_close(got, _kvpress_snapkv(q, k, w))
        assert not protected.any()


@pytest.mark.parametrize("chunk_length", [None, 16])
def test_finch_question_attention_and_chunk_shares(chunk_length):
    L, w, budget = 64, 6, 24
    _, k, v, q, inv = _prompt(L, seed=6)
    rule = rules.get("finch", window=w, chunk_length=chunk_length)
    s = _signals(k, v, q, inv, w, budget)
    got, protected = rule.score(s)[0, :, EMPTY:], rule.protect(s)[0, :, EMPTY:]
    assert protected[:, L - w:].all() and not protected[:, :L - w].any()
    att = _causal_probs(q, k)[:, :, -w:, :].mean((1, 2))  # [H, L]: mean over the window's queries and the group
    if chunk_length is None:
        torch.testing.assert_close(got[:, :L - w], att[:, :L - w])
        return
    # kvpress's chunked mode: every chunk keeps its own top share. Here: the kept set (the window protected, then
    # the top of the quantile scores) holds, in every chunk, that chunk's best candidates by the attention, and the
    # chunks' counts of kept candidates differ by at most one where their sizes are equal.
    keep = torch.where(protected, math.inf, got).topk(budget, dim=-1).indices
    kept = torch.zeros(H, L, dtype=torch.bool).scatter(-1, keep, True)
    for h in range(H):
        counts = []
        for a in range(0, L, chunk_length):
            sl = slice(a, a + chunk_length)
            n = int(kept[h, sl].sum())
            ctx = torch.where(protected[h, sl], math.inf, att[h, sl])
            assert set(ctx.topk(n).indices.tolist()) == set(kept[h, sl].nonzero().flatten().tolist()), (h, a)
            counts.append(n)
        assert max(counts[:-1]) - min(counts[:-1]) <= 1, counts  # the last chunk also holds the window


@pytest.mark.parametrize("L, chunk", [(90, 16), (64, 32)])
def test_non_causal_attention_is_kvpress_chunked_attention(L, chunk):
    _, k, v, q, inv = _prompt(L, seed=8)
    got = rules.get("non_causal_attention", chunk_size=chunk).score(_signals(k, v, q, inv, 8, 16))[0, :, EMPTY:]
    torch.testing.assert_close(got, _noncausal_ref(q, k, v, chunk))  # z-scored over all the layer's KV heads


@pytest.mark.parametrize("tau, n_future", [(5.0, 16), (1.0, 512)])
def test_capkv_is_kvpress_cap_press(tau, n_future):
    L, n_sink, eps = 40, 4, 1e-6
    _, k, v, q, inv = _prompt(L, seed=9)
    rule = rules.get("capkv", tau=tau, n_future_positions=n_future)
    s = _signals(k, v, q, inv, 8, 16)
    got, protected = rule.score(s)[0, :, EMPTY:], rule.protect(s)[0, :, EMPTY:]
    assert protected[:, :n_sink].all() and not protected[:, n_sink:].any()
    q0 = _rot(q, -torch.arange(L), inv)  # the queries before RoPE
    mu = q0[:, n_sink:].mean(1)  # [H*G, D]: the anchor, sinks left out
    M = torch.stack([_rot(torch.eye(D, dtype=DT), torch.full((D,), p), inv) for p in range(L, L + n_future)]).mean(0)
    anchor = F.normalize(mu @ M, dim=-1).view(H, G, D)  # x @ M: x rotated by the averaged future RoPE
    kk, vv = F.normalize(k[:, n_sink:], dim=-1), v[:, n_sink:]
    stat = torch.einsum("hgd,htd->hgt", anchor, kk).clamp(-1, 1)
    w = (tau * (stat - stat.amax(-1, keepdim=True))).exp()  # [H, G, T]
    A = torch.eye(D, dtype=DT) + torch.einsum("hgt,htd,hte->hgde", w + eps, vv, vv)
    lev = torch.einsum("htd,hgde,hte->hgt", vv, torch.linalg.inv(A), vv)
    torch.testing.assert_close(got[:, n_sink:], (w * lev).mean(1))


@pytest.mark.parametrize("name, params", [
    ("simlayerkv", {"window": 8, "lazy_threshold": 0.0}),  # lazy
    ("simlayerkv", {"window": 8, "lazy_threshold": 0.99}),  # not lazy
    ("finch", {"window": 8}), ("finch", {"window": 8, "chunk_length": 6}), ("non_causal_attention", {"chunk_size": 8}),
    ("capkv", {"n_future_positions": 16})])
def test_score_ignores_the_slot_layout(name, params):
    """A second call over cached entries: permuting the slots permutes the real candidates' scores with them (empty
    slots' scores are meaningless, the kernel overrides them; criticalkv: its reference above, as this check's
    signals have no W_o)."""
    assert_score_follows_slots(rules.get(name, **params), real_only=True)


def test_chunk_wraps_a_rule_and_refuses_what_it_cannot():
    c = rules.Chunk(rules.get("knorm"), chunk_length=10)
    L, budget = 40, 12
    _, k, v, q, inv = _prompt(L, seed=7)
    s = _signals(k, v, q, inv, 4, budget)
    keep = c.score(s)[0, :, EMPTY:].topk(budget, dim=-1).indices
    kept = torch.zeros(H, L, dtype=torch.bool).scatter(-1, keep, True)
    norm = k.norm(dim=-1)
    for h in range(H):
        for a in range(0, L, 10):
            n = int(kept[h, a:a + 10].sum())
            assert n == 3, (h, a, n)  # 12 of 40: 3 per chunk of 10
            assert set((-norm[h, a:a + 10]).topk(n).indices.tolist()) == \
                set(kept[h, a:a + 10].nonzero().flatten().tolist())
    for inner, why in (("full", "it never evicts"), ("adakv:snapkv", "spreads the budget over heads"),
                       ("kvzip", "in its own replay protocol")):
        with pytest.raises(ValueError, match=rf"^rule 'chunk\({inner}\)': Chunk cannot wrap '{inner}': .*{why}"):
            rules.Chunk(rules.get(inner))
    with pytest.raises(ValueError, match=r"^chunk\(snapkv\) chunk_length must be an int >= 1, got 0$"):
        rules.Chunk(rules.get("snapkv"), chunk_length=0)


def test_listed_with_their_defaults():
    table = rules_table()
    for name in NEW:
        assert f"| `{name}` |" in table
    assert "first_stage_ratio=0.5" in table and "lazy_threshold=0.9" in table and "chunk_length=None" in table


@pytest.mark.parametrize("name, params, match", [
    ("criticalkv", {"first_stage_ratio": 1.5}, "criticalkv first_stage_ratio must be a number in [0, 1], got 1.5"),
    ("criticalkv", {"epsilon": -1.0}, "criticalkv epsilon must be a number >= 0, got -1.0"),
    ("criticalkv", {"kernel": 4}, "criticalkv kernel must be a positive odd int, got 4"),
    ("simlayerkv", {"lazy_threshold": 2}, "simlayerkv lazy_threshold must be a number in [0, 1], got 2"),
    ("simlayerkv", {"n_recent": 0}, "simlayerkv n_recent must be an int >= 1, got 0"),
    ("simlayerkv", {"n_initial": -1}, "simlayerkv n_initial must be an int >= 0, got -1"),
    ("finch", {"window": 0}, "finch window must be an int >= 1, got 0"),
    ("finch", {"chunk_length": 0}, "finch chunk_length must be an int >= 1, got 0"),
    ("non_causal_attention", {"chunk_size": 0}, "non_causal_attention chunk_size must be an int >= 1, got 0"),
    ("capkv", {"tau": -1}, "capkv tau must be a number >= 0, got -1"),
    ("capkv", {"n_sink": -1}, "capkv n_sink must be an int >= 0, got -1"),
])
def test_bad_hyperparameters_are_refused(name, params, match):
    with pytest.raises(ValueError, match="^" + match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]") + "$"):
        rules.get(name, **params)


def test_simlayerkv_refuses_a_budget_its_sinks_fill():
    with pytest.raises(ValueError, match=r"^rule 'simlayerkv': budget 4 does not exceed n_initial=4"):
        rules.get("simlayerkv").check_budget([8, 4])


@pytest.mark.parametrize("rule", [("criticalkv", {"window": 8}), ("simlayerkv", {"window": 8, "lazy_threshold": 0.5}),
                                  ("finch", {"window": 8, "chunk_length": 16}),
                                  ("non_causal_attention", {"chunk_size": 16}), ("capkv", {}),
                                  ("chunk", {"chunk_length": 16})])
def test_chunked_prefill_and_decode_evict_to_the_budget(rule):
    """A real model, chunked prefill then decode: every layer holds exactly the budget, positions distinct, the
    output finite."""
    name, params = rule
    obj = rules.Chunk(rules.get("snapkv", window=8), **params) if name == "chunk" else rules.get(name, **params)
    m = fxbudget.compile(fresh(tiny_model("qwen2", layers=2)), rule=obj, budget=24, backend=None, chunk_size=16)
    logits, held, _ = chunked_prefill_then_decode(m)
    assert torch.isfinite(logits).all()
    for i, row in held:
        assert len(row) == 24 == len(set(row)) and max(row) <= 72, (i, sorted(row))


# kvpress 0.5.5's presses (`dir(kvpress)`, less BasePress and ScorerPress): docs/rules.md names each one, either as a
# FlexBudget rule or in its table of presses not in FlexBudget.
KVPRESS_PRESSES = (
    "AdaKVPress BlockPress CAMPress CURPress CapPress ChunkKVPress ChunkPress CompactorPress ComposedPress "
    "CompressionRatioDecodingPress CriticalAdaKVPress CriticalKVPress DMSPress DecodingPress DuoAttentionPress "
    "EntropyGatedChunkKVPress ExpectedAttentionPress ExpectedAttentionStatsPress FastKVzipPress FinchPress "
    "KVComposePress KVgradPress KVzapPress KVzipPress KeyDiffPress KeyRerotationPress KnormPress LUKVPress LagKVPress "
    "LeverageScorePress MergingPress NonCausalAttnPress ObservedAttentionPress PerLayerCompressionPress "
    "PrefillDecodingPress PyramidKVPress QFilterPress RandomPress RestoreKVPress SimLayerKVPress SnapKVPress "
    "StreamingLLMPress TOVAPress ThinKPress").split()


def test_docs_account_for_every_kvpress_press():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "rules.md").read_text()
    assert len(KVPRESS_PRESSES) == 44
    assert [p for p in KVPRESS_PRESSES if f"`{p}`" not in page and f"`{p}(" not in page] == []
