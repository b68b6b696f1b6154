"""Float64 references for the scores of the kvpress-derived rules (`keydiff`, `observed_attention`, `cur`, `lagkv`,
`chunkkv`, `leverage`, `compactor`): each written from the reference press's formula over one prompt (a one-call
prefill, positions 0..L-1), independently of the rule's own code, and compared to the rule's score computed on the
kernel's signals of the same call (with empty slots present, which must not matter). Also: a rule's score of a
position does not depend on the slots' layout (slots are unordered)."""

import math

import pytest
import torch
import torch.nn.functional as F

from fxbudget import rules
from fxbudget.kernel import LayerConstants, LayerSlots, NewTokens, measure
from fxbudget.kernel.signals import unknown_wo
from fxbudget.rules.base import Signals
from fxbudget.rules.random import gaussian_sketch

B, H, G, D, EMPTY = 1, 2, 3, 16, 5
DT = torch.float64


def _rot(x, pos, inv_freq):
    theta = pos.to(DT).unsqueeze(-1) * inv_freq
    cos, sin = (torch.cat([f(theta)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def _prompt(L, seed=0):
    """Pre-RoPE keys, post-RoPE keys, values, post-RoPE queries `[H*G, L, D]`, inv_freq; batch 1 squeezed."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=DT) / D)
    pos = torch.arange(L)
    k0 = torch.randn(H, L, D, generator=gen, dtype=DT) + torch.randn(H, 1, D, generator=gen, dtype=DT)
    v = torch.randn(H, L, D, generator=gen, dtype=DT) * torch.rand(H, L, 1, generator=gen, dtype=DT)
    q = _rot(torch.randn(H * G, L, D, generator=gen, dtype=DT), pos, inv_freq)
    return k0, _rot(k0, pos, inv_freq), v, q, inv_freq


def _signals(k, v, q, inv_freq, window, budget=8, slot_pos=None, slot_k=None, slot_v=None, start=0):
    """The kernel's float64 signals of one call (the prompt's tokens) on slots at `slot_pos` (default: empty)."""
    L = k.shape[1]
    if slot_pos is None:
        slot_pos = torch.full((1, H, EMPTY), -1)
        slot_k = slot_v = torch.zeros(1, H, EMPTY, D, dtype=DT)
    S = slot_pos.shape[-1]
    norms = torch.stack([slot_k.norm(dim=-1), slot_v.norm(dim=-1), torch.zeros_like(slot_k[..., 0])], dim=-1)
    slots = LayerSlots(slot_k, slot_v, slot_pos, torch.zeros(1, H, S, dtype=DT), norms, None, None)
    new = NewTokens(k.unsqueeze(0), v.unsqueeze(0), torch.arange(start, start + L).unsqueeze(0))
    _, _, sig = measure(q.unsqueeze(0), slots, new, LayerConstants(inv_freq, unknown_wo(H, G, D, "cpu")),
                        window=window, sliding=0, scale=None)
    return Signals(**sig, budget=budget, window=min(window, L)), S


def _score(rule, L=70, window=32, budget=8, seed=0):
    k0, k, v, q, inv = _prompt(L, seed)
    s, S = _signals(k, v, q, inv, window, budget)
    return rule.score(s)[0, :, S:], (k0, k, v, q)


def _causal_probs(q, k):
    L = k.shape[1]
    lg = torch.einsum("hqd,hkd->hqk", q.view(H, G, L, D).reshape(H, G * L, D), k).view(H, G, L, L) / math.sqrt(D)
    lg = lg.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return lg.softmax(-1)  # [H, G, queries, keys]


def test_keydiff_anchor_is_the_mean_normalized_key():
    got, (_, k, _, _) = _score(rules.get("keydiff"))
    anchor = F.normalize(k, dim=-1).mean(dim=1, keepdim=True)
    ref = -(k * anchor).sum(-1) / (k.norm(dim=-1) * anchor.norm(dim=-1))
    torch.testing.assert_close(got, ref)
    raw = -F.cosine_similarity(k, k.mean(dim=1, keepdim=True), dim=-1)  # the old anchor: measurably another score
    assert (got - raw).abs().max() > 1e-3


def test_observed_attention_is_mean_attention_over_the_queries_that_see_a_key():
    L = 40
    got, (_, k, _, q) = _score(rules.get("observed_attention"), L)
    p = _causal_probs(q, k)
    ref = (p.sum(2) / torch.arange(L, 0, -1, dtype=DT)).mean(1)
    torch.testing.assert_close(got, ref * G)  # the kernel sums over the group: a constant factor G


@pytest.mark.parametrize("params", [{}, {"leverage_type": "kv_avg", "local_window_size": 7},
                                    {"use_local_approximation": False, "leverage_type": "key"},
                                    {"use_random_leverage": True, "seed": 3}])
def test_cur(params):
    rule = rules.get("cur", **params)
    got, (_, k, v, _) = _score(rule, L=70)
    if rule.use_random_leverage:
        g = gaussian_sketch(D, 20, rule.seed, "cpu", DT) / math.sqrt(20)
        k, v = k @ g, v @ g
    k2, v2 = k.square().sum(-1), v.square().sum(-1)
    if rule.use_local_approximation:
        w, n = rule.local_window_size, k2.shape[-1]
        def local(x):
            x = F.pad(x, (0, (w - n % w) % w)).reshape(H, -1, w)
            return (x / x.sum(-1, keepdim=True)).reshape(H, -1)[:, :n]
        k2, v2 = local(k2), local(v2)
    ref = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[rule.leverage_type]
    ref = ref / ref.sum(-1, keepdim=True)
    ref[:, :rule.num_sinks] = 1.0
    torch.testing.assert_close(got, ref)


def _lagkv_ref(k, v, n_sink, lag, cross):
    L = k.shape[1]
    if L < n_sink + 2 * lag:
        ref = torch.ones(H, L, dtype=DT)
        ref[:, n_sink:] = torch.arange(L - n_sink, dtype=DT) / (L - n_sink)
        return ref
    end = n_sink + (L - n_sink) // lag * lag

    def states(x):
        parts = x[:, n_sink:end].reshape(H, -1, lag, D)
        ref_, cur = parts[:, 1:], parts[:, :-1]
        lo, hi = ref_.amin(2, keepdim=True), ref_.amax(2, keepdim=True)
        return ((cur - lo) / (hi - lo)).std(-1).softmax(-1)

    score = (states(k) + states(v)) / 2
    if not cross:
        score = score.argsort(-1).argsort(-1).to(DT) / lag
    return torch.cat([torch.ones(H, n_sink, dtype=DT), score.reshape(H, -1), torch.ones(H, L - end + lag, dtype=DT)],
                     -1)


@pytest.mark.parametrize("L, params", [(75, {"lag_size": 16}), (75, {"lag_size": 16, "cross_scoring": True}),
                                       (68, {"lag_size": 16, "n_sink": 2}), (30, {"lag_size": 16})])
def test_lagkv(L, params):
    rule = rules.get("lagkv", **params)
    got, (_, k, v, _) = _score(rule, L)
    torch.testing.assert_close(got, _lagkv_ref(k, v, rule.n_sink, rule.lag_size, rule.cross_scoring))


@pytest.mark.parametrize("L", [90, 100])
def test_chunkkv_scores_whole_chunks_by_kvpress_snapkv(L):
    rule = rules.get("chunkkv", window=16, kernel=5, chunk_length=20)
    got, (_, k, _, q) = _score(rule, L, window=16)
    w = rule.window
    att = _causal_probs(q, k)[:, :, -w:, :-w].mean(2)  # [H, G, L - w]: kvpress: mean over window queries ...
    pooled = F.avg_pool1d(att.reshape(H * G, 1, -1), 5, stride=1, padding=2).view(H, G, -1).mean(1)  # ... group
    snap = F.pad(pooled, (0, w), value=pooled.max().item() + 1).sum(0)  # summed over the KV heads
    c = rule.chunk_length
    chunks = [snap[i:i + c].mean() for i in range(0, L, c)]
    ref = torch.stack([chunks[i // c] for i in range(L)]).expand(H, L)
    torch.testing.assert_close(got, ref)


def _leverage_ref(k0, sketch, seed):
    x = k0 - k0.mean(1, keepdim=True)
    phi = gaussian_sketch(H * D, sketch, seed, "cpu", DT).view(H, D, sketch) / math.sqrt(sketch)
    x = x @ phi
    inv = torch.linalg.inv(x.transpose(-1, -2) @ x + 1e-2 * torch.eye(sketch, dtype=DT))
    lev = torch.einsum("hnk,hkj,hnj->hn", x, inv, x).clamp_min(0)
    return (lev - lev.mean()) / lev.std()


@pytest.mark.parametrize("sketch", [8, 48])
def test_leverage(sketch):
    got, (k0, *_) = _score(rules.get("leverage", sketch_dimension=sketch), 60)
    torch.testing.assert_close(got, _leverage_ref(k0, sketch, 0))


def test_leverage_wide_sketch_is_the_exact_leverage():
    got, (k0, *_) = _score(rules.get("leverage", sketch_dimension=2 * D), 60)
    x = k0 - k0.mean(1, keepdim=True)
    lev = torch.einsum("hnk,hkj,hnj->hn", x, torch.linalg.inv(x.transpose(-1, -2) @ x), x)
    exact = (lev - lev.mean()) / lev.std()
    torch.testing.assert_close(got, exact, rtol=0, atol=1e-2)  # only the 1e-2 jitter of the Gram matrix differs
    narrow, _ = _score(rules.get("leverage", sketch_dimension=D // 2), 60)
    assert (narrow - exact).abs().max() > 0.1  # a narrower sketch is an approximation


def _noncausal_ref(q, k, v, chunk):
    """kvpress's NonCausalAttnPress.score on the middle tokens (q [H*G, M, D], k, v [H, M, D])."""
    M = k.shape[1]
    pad = -(-M // chunk) * chunk - M
    qp = torch.cat([q, torch.zeros(H * G, pad, D, dtype=DT)], 1).view(H * G, -1, chunk, D)
    kp = torch.cat([k.repeat_interleave(G, 0), torch.zeros(H * G, pad, D, dtype=DT)], 1).view(H * G, -1, chunk, D)
    dots = qp @ kp.transpose(-1, -2)
    if pad:
        is_pad = torch.arange(M + pad - chunk, M + pad) >= M
        dots[:, -1].masked_fill_(is_pad.view(-1, 1), 0)
        dots[:, -1].masked_fill_(is_pad.view(1, -1), -1e-9)
    a = dots.softmax(-1).sum(-2).reshape(H * G, -1)[:, :M].view(H, G, M).mean(1)
    scores = F.avg_pool1d((a * v.norm(dim=-1)).unsqueeze(1), 3, stride=1, padding=1).squeeze(1)
    return (scores - scores.mean()) / scores.std()


@pytest.mark.parametrize("L, params", [(90, {"chunk_size": 16}), (92, {"chunk_size": 21, "blending": 0.7}),
                                       (60, {"chunk_size": 256, "sink_size_end": 0})])
def test_compactor(L, params):
    rule = rules.get("compactor", sketch_dimension=8, **params)
    budget = 20
    got, (k0, k, v, q) = _score(rule, L, budget=budget)
    a, e = rule.sink_size_start, L - rule.sink_size_end
    blend = rule.blending if rule.blending is not None else 1 - budget / L
    ref = blend * _leverage_ref(k0[:, a:e], 8, 0) + _noncausal_ref(q[:, a:e], k[:, a:e], v[:, a:e], rule.chunk_size)
    torch.testing.assert_close(got[:, a:e], ref)
    s, S = _signals(k, v, q, _prompt(L)[4], 32, budget)
    protected = rule.protect(s)[0, :, S:]
    assert protected[:, :a].all() and protected[:, e:].all() and not protected[:, a:e].any()


@pytest.mark.parametrize("name, params", [
    ("keydiff", {}), ("observed_attention", {}), ("cur", {}), ("lagkv", {"lag_size": 8}),
    ("chunkkv", {"window": 8, "chunk_length": 6}), ("leverage", {"sketch_dimension": 8}),
    ("compactor", {"chunk_size": 8, "sketch_dimension": 8})])
def test_score_ignores_the_slot_layout(name, params):
    """A second call over cached entries: permuting the slots permutes the scores with them."""
    # chunkkv: heads hold the same positions (its own invariant)
    assert_score_follows_slots(rules.get(name, **params), same_positions=name == "chunkkv")


def assert_score_follows_slots(rule, same_positions: bool = False, real_only: bool = False) -> None:
    """Score 28 cached slots (24 real with gaps, 4 empty) then the same slots permuted: the scores permute with
    them. `real_only`: compare the real candidates' scores only (empty slots' scores are meaningless, the kernel
    overrides them)."""
    _, k, v, q, inv = _prompt(30, seed=1)
    gen = torch.Generator().manual_seed(2)
    keep = torch.stack([torch.randperm(40, generator=gen)[:24].sort().values for _ in range(H)])  # gaps
    slot_pos = torch.cat([keep, torch.full((H, 4), -1)], -1).unsqueeze(0)
    sk = torch.randn(1, H, 28, D, generator=gen, dtype=DT)
    sv = torch.randn(1, H, 28, D, generator=gen, dtype=DT)
    if same_positions:
        slot_pos = slot_pos[:, :1].expand(1, H, -1).clone()
    s, S = _signals(k, v, q, inv, 8, 16, slot_pos, sk, sv, start=40)
    perm = torch.randperm(28, generator=gen)
    s2, _ = _signals(k, v, q, inv, 8, 16, slot_pos[..., perm], sk[:, :, perm], sv[:, :, perm], start=40)
    a, b = rule.score(s), rule.score(s2)
    assert torch.isfinite(a[s.pos >= 0]).all()
    compared = slot_pos[..., perm] >= 0 if real_only else torch.ones(slot_pos.shape, dtype=torch.bool)
    torch.testing.assert_close(b[..., :S][compared], a[..., :S][..., perm][compared])
    torch.testing.assert_close(b[..., S:], a[..., S:])
