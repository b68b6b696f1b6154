"""The per-token signals (`TOKEN_SIGNALS`) and two signals of the shared kernel, measured for every rule (issue 23):

- `window_max_attn`: per candidate, the largest attention probability it gets from one query of the observation
  window and one query head of its KV group (DefensiveKV's max, where `window_attn` is the sum). It is read off the
  attention blocks' own softmax (`attention.Block.window_max`): the window's queries are the call's last `w` (pads
  come first, `check_left_padded`), so only the rows of the block(s) holding them are read once more. A traced call
  of several query blocks (a `scan`, whose body is the same for every block) attends its last `w` queries once more
  instead (`window_max`): O(w x candidates), against the call's O(n x candidates).
- `wov_norm` (`value_out_norms`): `||W_o^(j) v||_2`, the L2 norm of a value under query head `j`'s slice of the
  layer's output projection, averaged over the KV group (CriticalKV's weight, whose paper uses the L1 norm: see
  `docs/DESIGN.md`). `||W v||_2 = ||R v||_2` for `W = Q R`, so the kernel holds each query head's `R`
  (`v_head_dim x v_head_dim`, computed once when the weight is attached, `out_projection_factors`), never the
  `hidden x v_head_dim` slice: a call reads `q_heads x v_head_dim^2` numbers, not W_o (which an exact L1 norm needs
  in full, per call: the measured decode cost of that is in benchmarks/studies/results/signal_cost.md). Measured once per
  new token, stored with the norms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

def _key_norm(new, const, acc: torch.dtype) -> Tensor:
    return torch.linalg.vector_norm(new.keys, dim=-1, dtype=acc)


def _value_norm(new, const, acc: torch.dtype) -> Tensor:
    return torch.linalg.vector_norm(new.values, dim=-1, dtype=acc)


def _wov_norm(new, const, acc: torch.dtype) -> Tensor:
    return value_out_norms(new.values, const.wo, acc)


# The signals of a token alone (not of the attention it gets), `[b, h, n]` in `acc` from the call's `NewTokens` and
# `LayerConstants`: measured once when a token arrives and cached with its entry (`LayerSlots.norms`, one column
# each, in this order), so no call reads the whole K/V cache again. Adding one is a `Signals` field and an entry here.
TOKEN_SIGNALS = {"key_norm": _key_norm, "value_norm": _value_norm, "wov_norm": _wov_norm}

# R factors of attached output projections, per weight tensor (a model's caches share them): (version, shape) -> R.
_FACTORS = WeakIdKeyDictionary()


def unknown_wo(kv_heads: int, group: int, v_head_dim: int, device) -> Tensor:
    """The `wo` of a layer whose output projection is unknown: NaN factors (so `wov_norm` is NaN), the shape of
    known ones (`out_projection_factors`), so a layer's graph does not depend on it."""
    return torch.full((kv_heads, v_head_dim, group * v_head_dim), float("nan"), device=device)


def out_projection_factors(weight: Tensor, kv_heads: int, v_head_dim: int) -> Tensor:
    """The layer's `wo` tensor: for KV head `i`, `[v_head_dim, group * v_head_dim]` whose block `j` is `R_ij^T`,
    with `W_ij = Q R_ij` the QR factorization of query head `i * group + j`'s slice `[hidden, v_head_dim]` of
    `weight` (`o_proj.weight`, `[hidden, q_heads * v_head_dim]`). Float32 (float64 for a float64 weight), on the
    weight's device; computed once per weight (and recomputed if it is modified in place).

    Returns:
        `[kv_heads, v_head_dim, group * v_head_dim]`: `v @ wo[i]` is every `R_ij v` of the group side by side.
    """
    hidden, width = weight.shape
    if width % (kv_heads * v_head_dim):
        raise ValueError(f"output projection of width {width} is not q_heads x {v_head_dim} for {kv_heads} KV heads")
    group = width // (kv_heads * v_head_dim)
    key = (weight._version, kv_heads, v_head_dim)
    hit = _FACTORS.get(weight)
    if hit is not None and hit[0] == key:
        return hit[1]
    acc = torch.promote_types(weight.dtype, torch.float32)
    with torch.no_grad():
        w = weight.detach().to(acc).view(hidden, kv_heads * group, v_head_dim).transpose(0, 1)  # [q_heads, hidden, dv]
        r = torch.linalg.qr(w, mode="r").R  # [q_heads, min(hidden, dv), dv]
        r = F.pad(r, (0, 0, 0, v_head_dim - r.shape[1]))  # hidden < dv: zero rows keep ||R v|| = ||W v||
        factors = r.transpose(1, 2).reshape(kv_heads, group, v_head_dim, v_head_dim).transpose(1, 2).reshape(
            kv_heads, v_head_dim, group * v_head_dim).contiguous()
    _FACTORS[weight] = (key, factors)
    return factors


def value_out_norms(v: Tensor, wo: Tensor, acc: torch.dtype) -> Tensor:
    """`wov_norm` of new tokens: `||W_o^(j) v||_2` averaged over the KV group's query heads `j`, `[b, h, n]` in `acc`.

    Args:
        v: values `[b, h, n, dv]`. wo: the layer's factors `[h, dv, group * dv]` (`out_projection_factors`; NaN when
            the model's W_o is unknown: the signal is then NaN and rules that read it are refused).
        acc: the kernel's accumulation dtype.
    One matmul per KV head over the call's tokens; its `[h, b * n, group * dv]` result is as large as the call's
    queries, so no blocking is needed.
    """
    b, h, n, dv = v.shape
    g = wo.shape[-1] // dv
    rows = v.to(acc).transpose(0, 1).reshape(h, b * n, dv)
    y = torch.bmm(rows, wo.to(acc)).view(h, b, n, g, dv)
    return torch.linalg.vector_norm(y, dim=-1).mean(dim=-1).transpose(0, 1)


def check_left_padded(new_pos: Tensor) -> None:
    """Eager calls only (a host sync): a row's pads (position -1) come before its tokens, as fxbudget pads (shape
    buckets, left-padded batches), so the window's queries are the call's last `w`.

    Raises:
        ValueError: a real token followed by a pad.
    """
    valid = new_pos >= 0
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError("new_pos: pads (-1) must come before a row's tokens (left padding), found a token before a pad")


def window_block(blk, queries: Tensor, qpos: Tensor, weights: Tensor, w: int):
    """The call's last `w` queries (the window, pads first) attended once more as one block (`attention.Block`, the
    same softmax): `(sums over slots, sums over new tokens from c0, max over slots, max over new tokens from c0,
    c0)`.
    A sliding layer's window sees only the new tokens from `c0 = n - w - sliding + 1` on."""
    b, h, gn, d = queries.shape
    n = qpos.shape[1]
    g = gn // n
    q_w = queries.view(b, h, g, n, d)[:, :, :, n - w:].reshape(b, h, g * w, d)
    c0 = max(0, n - w - blk.sliding + 1) if blk.sliding else 0
    _, s_s, s_n, m_s, m_n = blk(q_w, qpos[:, n - w:], weights[..., n - w:], c0, n, win=(0, w))
    return s_s, s_n, m_s, m_n, c0


def window_max(blk, queries: Tensor, qpos: Tensor, weights: Tensor, w: int) -> Tensor:
    """`window_max_attn` of a traced call of several query blocks: the window's block (`window_block`),
    `[b, h, S + n]`."""
    _, _, m_s, m_n, c0 = window_block(blk, queries, qpos, weights, w)
    return torch.cat([m_s, F.pad(m_n, (c0, 0))], dim=-1)
