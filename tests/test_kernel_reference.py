"""The kernel against an independent float64 reference: a per-token, per-head simulation of a budgeted cache.

The reference keeps a Python list of (position, key, value, accumulated attention) per batch row and KV head, attends
query by query with explicit softmax over the visible entries, scores with each paper's formula written directly, and
keeps the best `budget` entries (protected first, then score; ties go to the newer position).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxbudget import rules
from fxbudget.kernel import budget_attention
from fxbudget.kernel import TOTALED

# `full` is left out: it never evicts (a call that would is refused before it runs).
RULES = ["window", "streamingllm", "knorm", "h2o", "snapkv", "pyramidkv", "tova", "keydiff", "random",
         "expected_attention"]
N_FUTURE = 16  # expected_attention's future positions, small for the test
WINDOW = 4  # small observation window so chunks are longer than it
# Variants beyond the defaults: name -> (the kernel's rule, the reference's rule name, the reference's parameters).
VARIANTS = {
    "snapkv_avg": (lambda: rules.get("snapkv", window=WINDOW, pooling="avg"), "snapkv", {"pooling": "avg"}),
    "expected_attention_plain": (
        lambda: rules.get("expected_attention", n_future_positions=N_FUTURE, n_sink=2, use_covariance=False,
                          use_vnorm=False),
        "expected_attention", {"n_sink": 2, "use_covariance": False, "use_vnorm": False}),
    "expected_attention_epsilon": (
        lambda: rules.get("expected_attention", n_future_positions=N_FUTURE, epsilon=0.25),
        "expected_attention", {"epsilon": 0.25}),
    "pyramid_h2o": (lambda: rules.Pyramid(rules.get("h2o")), "h2o", {}),  # the wrapper at one layer: its rule
}


def ref_expected_attention(entries, q_rot, qpos, step, inv_freq, n_sink=4, use_covariance=True, use_vnorm=True,
                           epsilon=0.0):
    """kvpress's formula, written out per query head: statistics of the un-rotated queries, the rotation matrix
    averaged over the next N_FUTURE positions, a softmax over the non-sink keys, times the value norms (+ epsilon)."""
    g, n, d = q_rot.shape
    half = d // 2

    def rotation(theta):  # the RoPE matrix of one position: (x_i, x_i+half) rotated by theta_i
        R = torch.zeros(d, d, dtype=torch.float64)
        for i in range(half):
            c, s = math.cos(theta[i]), math.sin(theta[i])
            R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
        return R

    used = [i for i in range(n) if qpos[i] >= n_sink] or list(range(n))
    R_future = sum(rotation([(step + f) * w for w in inv_freq]) for f in range(N_FUTURE)) / N_FUTURE
    scoreable = [c for c, e in enumerate(entries) if e["pos"] >= n_sink]
    total = torch.zeros(len(entries), dtype=torch.float64)
    for j in range(g):
        pre = torch.stack([rotation([qpos[i] * w for w in inv_freq]).T @ q_rot[j, i] for i in used])
        mu = pre.mean(0)
        cov = (pre - mu).T @ (pre - mu) / len(used)
        mu, cov = R_future @ mu, R_future @ cov @ R_future.T
        if not scoreable:
            continue
        z = torch.stack([mu @ entries[c]["k"] / math.sqrt(d)
                         + (entries[c]["k"] @ cov @ entries[c]["k"] / (2 * d) if use_covariance else 0.0)
                         for c in scoreable])
        total[scoreable] += torch.softmax(z, 0)
    return [((total[c] / g + epsilon) * entries[c]["v"].norm() if use_vnorm else total[c] / g).item()
            for c in range(len(entries))]


def ref_random(pos: int, head: int, seed: int = 0) -> float:
    m, a = 2**31, 739982445
    x = (pos + 1 + head * 1000003 + seed * 7919) % m
    for _ in range(3):
        x ^= x >> 15
        x = x * a % m
        x ^= x >> 12
    return float(x >> 7)


def ref_score(rule: str, entries, window_mass, last_mass, budget, step, window, head, ea=None, pooling="max",
              n_sink=4):
    """(protected, score) per entry, from the papers' formulas."""
    out = []
    order = sorted(range(len(entries)), key=lambda i: entries[i]["pos"])
    pooled = {}
    if rule == "keydiff":
        mean = torch.stack([e["k"] for e in entries]).mean(0)
    if rule in ("snapkv", "pyramidkv"):  # pool (kernel 7) of observation-window attention along the sequence
        seq = [window_mass[i] for i in order]
        for j, i in enumerate(order):  # avg: zero padding counts, as avg_pool1d's default (and kvpress's) does
            pooled[i] = max(seq[max(0, j - 3): j + 4]) if pooling == "max" else sum(seq[max(0, j - 3): j + 4]) / 7
    for i, e in enumerate(entries):
        p = e["pos"]
        if rule == "window":
            out.append((False, float(p)))
        elif rule == "streamingllm":
            out.append((p < 4, float(p)))
        elif rule == "knorm":
            out.append((False, -e["k"].norm().item()))
        elif rule == "h2o":
            out.append((p >= step - budget // 2, e["acc"]))
        elif rule in ("snapkv", "pyramidkv"):  # one layer: pyramidkv is snapkv at that layer's budget
            out.append((p >= step - window, pooled[i]))
        elif rule == "tova":
            out.append((False, last_mass[i]))
        elif rule == "keydiff":
            out.append((False, -torch.nn.functional.cosine_similarity(e["k"], mean, dim=0).item()))
        elif rule == "random":
            out.append((False, ref_random(p, head)))
        elif rule == "expected_attention":
            out.append((p < n_sink, ea[i]))
    return out


def ref_call(entries, q, k_new, v_new, pos0, rule, budget, scale, window, head, inv_freq, params=None):
    """One call for one (row, KV head): q `[g, n, d]`; returns (output `[g, n, d]`, surviving entries)."""
    g, n, _ = q.shape
    cands = entries + [{"pos": pos0 + i, "k": k_new[i], "v": v_new[i], "acc": 0.0} for i in range(n)]
    out = torch.zeros(g, n, v_new.shape[-1], dtype=torch.float64)
    mass = [0.0] * len(cands)
    wmass = [0.0] * len(cands)
    lmass = [0.0] * len(cands)
    for j in range(g):
        for i in range(n):
            vis = [c for c, e in enumerate(cands) if e["pos"] <= pos0 + i]
            logits = torch.stack([q[j, i] @ cands[c]["k"] * scale for c in vis])
            p = torch.softmax(logits, 0)
            out[j, i] = sum(p[t] * cands[c]["v"] for t, c in enumerate(vis))
            for t, c in enumerate(vis):
                mass[c] += p[t].item()
                if i >= n - min(window, n):
                    wmass[c] += p[t].item()
                if i == n - 1:
                    lmass[c] += p[t].item()
    for c, e in enumerate(cands):
        e["acc"] = e["acc"] + mass[c]
    step = pos0 + n
    params = params or {}
    ea = ref_expected_attention(cands, q, list(range(pos0, pos0 + n)), step, inv_freq, **params) \
        if rule == "expected_attention" else None
    scored = ref_score(rule, cands, wmass, lmass, budget, step, min(window, n), head, ea,
                       pooling=params.get("pooling", "max"), n_sink=params.get("n_sink", 4))
    # Protected entries outrank all others and, among themselves, the newer wins (their score is +inf).
    key = {c: (math.inf if prot else score, cands[c]["pos"]) for c, (prot, score) in enumerate(scored)}
    ranked = sorted(range(len(cands)), key=key.__getitem__, reverse=True)
    return out, [cands[c] for c in ranked[:budget]]


def _rule(name):
    """(kernel rule, reference rule name, reference parameters) for a rule name or a `VARIANTS` key."""
    if name in VARIANTS:
        make, ref, params = VARIANTS[name]
        return make(), ref, params
    params = {"snapkv": {"window": WINDOW}, "pyramidkv": {"window": WINDOW},
              "expected_attention": {"n_future_positions": N_FUTURE}}
    return rules.get(name, **params.get(name, {})), name, {}


@settings(max_examples=60, deadline=None)
@given(
    rule=st.sampled_from(RULES + sorted(VARIANTS)),
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.integers(1, 3), head_dim=st.sampled_from([4, 8]),
    budget=st.integers(1, 10), calls=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 2**16),
    block=st.integers(2, 6),  # calls of up to 9 tokens span several query blocks, the last one partly filled
)
def test_kernel_matches_float64_reference(rule, batch, kv_heads, group, head_dim, budget, calls, seed, block):
    check_against_reference(rule, batch, kv_heads, group, head_dim, budget, calls, seed, block)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_float64_reference(variant):
    # Each variant on a fixed case that evicts in every call (chunks longer than the window, then a decode step).
    check_against_reference(variant, batch=2, kv_heads=2, group=2, head_dim=8, budget=6, calls=[7, 5, 1, 3], seed=3,
                            block=3)


def check_against_reference(rule, batch, kv_heads, group, head_dim, budget, calls, seed, block):
    gen = torch.Generator().manual_seed(seed)
    b, h, g, d = batch, kv_heads, group, head_dim
    f64 = dict(dtype=torch.float64)
    k_slots, v_slots = torch.zeros(b, h, budget, d, **f64), torch.zeros(b, h, budget, d, **f64)
    pos_slots = torch.full((b, h, budget), -1, dtype=torch.long)
    state = torch.zeros(b, h, budget, **f64)
    norms = torch.zeros(b, h, budget, 3, **f64)
    totals = torch.zeros(b, h, len(TOTALED), **f64)
    window = WINDOW
    rule_obj, ref_rule, ref_params = _rule(rule)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    scale = 1 / math.sqrt(d)
    ref = [[[] for _ in range(h)] for _ in range(b)]
    pos0 = 0
    for n in calls:
        q = torch.randn(b, h * g, n, d, generator=gen, **f64)
        k_new = torch.randn(b, h, n, d, generator=gen, **f64)
        v_new = torch.randn(b, h, n, d, generator=gen, **f64)
        new_pos = torch.arange(pos0, pos0 + n)
        out = budget_attention(q, k_slots, v_slots, pos_slots, state, norms, totals, k_new, v_new, new_pos, inv_freq,
                               rule=rule_obj, budget=budget, window=window, block=block)
        for bi in range(b):
            for hi in range(h):
                qh = q[bi, hi * g:(hi + 1) * g]
                ref_out, ref[bi][hi] = ref_call(ref[bi][hi], qh, k_new[bi, hi], v_new[bi, hi], pos0, ref_rule,
                                                budget, scale, window, hi, inv_freq.tolist(), ref_params)
                torch.testing.assert_close(out[bi, hi * g:(hi + 1) * g], ref_out, rtol=1e-9, atol=1e-9)
                # The stored total of attention mass: every query distributes exactly 1.
                assert abs(totals[bi, hi, 0].item() - g * n) < 1e-9
                kept = {e["pos"]: e for e in ref[bi][hi]}
                got = {p: s for s, p in enumerate(pos_slots[bi, hi].tolist()) if p >= 0}
                assert sorted(got) == sorted(kept), f"call n={n}: kernel kept {sorted(got)}, reference {sorted(kept)}"
                for p, s in got.items():  # the slot holds that token's key, value and accumulated attention
                    torch.testing.assert_close(k_slots[bi, hi, s], kept[p]["k"])
                    torch.testing.assert_close(v_slots[bi, hi, s], kept[p]["v"])
                    assert abs(state[bi, hi, s].item() - kept[p]["acc"]) < 1e-9
                    assert abs(norms[bi, hi, s, 0].item() - kept[p]["k"].norm().item()) < 1e-9
        pos0 += n


def test_no_visible_candidate_gives_zeros_not_nan():
    b, h, d = 1, 1, 4
    z = torch.zeros(b, h, 3, d)
    out = budget_attention(torch.randn(b, h, 1, d), z, z, torch.full((b, h, 3), -1), torch.zeros(b, h, 3),
                           torch.zeros(b, h, 3, 3), torch.zeros(b, h, len(TOTALED)), torch.randn(b, h, 1, d),
                           torch.randn(b, h, 1, d), torch.tensor([-1]), rule=rules.get("h2o"), budget=3)
    assert not out.isnan().any() and torch.equal(out, torch.zeros_like(out))


def test_decode_writes_one_row_per_head():
    # Write-back touches only the freed slot: every other slot's key/value is bit-for-bit unchanged.
    torch.manual_seed(0)
    b, h, S, d = 2, 2, 16, 8
    k_slots, v_slots = torch.randn(b, h, S, d), torch.randn(b, h, S, d)
    pos = torch.arange(S).expand(b, h, S).clone()
    state = torch.rand(b, h, S)
    k0, v0, p0 = k_slots.clone(), v_slots.clone(), pos.clone()
    norms = torch.stack([k_slots.norm(dim=-1), v_slots.norm(dim=-1), torch.zeros(b, h, S)], dim=-1)
    budget_attention(torch.randn(b, h * 2, 1, d), k_slots, v_slots, pos, state, norms, torch.zeros(b, h, len(TOTALED)),
                     torch.randn(b, h, 1, d) * 0.1, torch.randn(b, h, 1, d), torch.tensor([S]),
                     rule=rules.get("knorm"), budget=S)
    changed = (k_slots != k0).any(-1) | (v_slots != v0).any(-1)
    assert torch.equal(changed.sum(-1), torch.ones(b, h, dtype=torch.long))  # the small new key evicts one slot
    assert torch.equal(changed, pos != p0)


def _sdpa_reference_case(dtype, held: int, n: int, seed: int, b=1, h=2, g=4, d=64, budget=400):
    """One call on a cache holding positions 0..held-1 (slots) then `n` new tokens: the kernel's output in `dtype`,
    SDPA's in `dtype` (K/V repeated per query head, slots and new tokens in position order) and float64 SDPA."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    k, v = torch.randn(b, h, held + n, d, generator=gen, **f64) * 2, torch.randn(b, h, held + n, d, generator=gen, **f64)
    q = torch.randn(b, h * g, n, d, generator=gen, **f64) * 2
    mask = torch.arange(held + n).view(1, -1) <= torch.arange(held, held + n).view(-1, 1)  # causal over positions

    def sdpa(dt):
        return F.scaled_dot_product_attention(q.to(dt), k.repeat_interleave(g, 1).to(dt),
                                              v.repeat_interleave(g, 1).to(dt), attn_mask=mask)

    slots = lambda x: F.pad(x[:, :, :held], (0, 0, 0, budget - held)).to(dtype)  # noqa: E731
    pos = torch.full((b, h, budget), -1)
    pos[..., :held] = torch.arange(held)
    norms = torch.stack([k[:, :, :held].norm(dim=-1), v[:, :, :held].norm(dim=-1), torch.zeros(b, h, held, **f64)], -1)
    out = budget_attention(q.to(dtype), slots(k), slots(v), pos, torch.zeros(b, h, budget),
                           F.pad(norms, (0, 0, 0, budget - held)).float(), torch.zeros(b, h, len(TOTALED)),
                           k[:, :, held:].to(dtype), v[:, :, held:].to(dtype), torch.arange(held, held + n),
                           rule=rules.get("h2o"), budget=budget, block=64)
    return out, sdpa(dtype), sdpa(torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("held, n", [(0, 256), (128, 128), (300, 1)])  # a prefill, a chunk on slots, a decode step
def test_reduced_precision_error_is_sdpa_s(dtype, held, n):
    """bf16/fp16: the logits accumulate in fp32 (as flash attention's do), so the kernel's error against float64 is
    at most 1.1x SDPA's in the same dtype (RMS over a layer's outputs; rounded logits gave 1.8x)."""
    errs = []
    for seed in range(3):
        out, sdpa, ref = _sdpa_reference_case(dtype, held, n, seed)
        assert out.dtype == dtype
        errs.append([((x.double() - ref) ** 2).mean().sqrt().item() for x in (out, sdpa)])
    kernel_err, sdpa_err = (sum(e) for e in zip(*errs))
    assert kernel_err <= 1.1 * sdpa_err, (kernel_err, sdpa_err)
