"""The measure phase's second exact form, for GPUs: attention and `attn` from two fused `flex_attention` calls, the
window signals from a `w x (S + n)` block (issue 49; `measure.measure` picks the form, `settings.measure_form`).

Why: today's form (`attention.Block`, query blocks against every candidate) writes every query's scores. On a CPU
that is the fastest exact way; on a GPU the unmodified model's SDPA (flash) never writes them, and a kernel that does
is bound by memory traffic. Only `attn` reads every query; it has an exact fused form:

1. `flex_attention` over slots + new tokens (queries `[b, q_heads, n, d]`, keys/values `[b, kv_heads, C, d]` with
   `enable_gqa`: K/V are never copied per query head), with a block mask built from the positions (`_visibility`:
   causal, pads (-1) never visible, the sliding window) and `AuxRequest(lse=True)`: the output and each query's
   log-sum-exp `lse_q`.
2. The transposed call: the candidates are the queries, the KV group's queries (each head's padded to whole blocks)
   folded into the key axis, the score_mod subtracts `lse_q`. Its own log-sum-exp per candidate `k` is
   `log sum_q exp(s[q, k] - lse_q) = log sum_q P[q, k]`: `attn = exp(LSE_k)`, summed over the group's heads and every
   valid query (pads see nothing). Its output is discarded (its values are the folded queries: no extra tensor).
3. `window_attn`, `last_attn` and `window_max_attn` read the call's last `w` queries: one `attention.Block` over them
   (the code today's form runs), `w x (S + n)` scores.
`acc_attn`, the totals and the per-token signals are `measure`'s own, the same for both forms: a rule cannot tell.

The head pool (`layouts.HeadPool`): the pooled keys are one KV head every query head sees; the call's new tokens are
laid after the pool head by head (`[pool; new of head 0; ...]`, one KV head), each query head seeing only its own
head's (the positions say so: `kpos` is per head). Nothing is copied per head; the masked columns are skipped whole
by the block mask where a block holds another head's tokens only.

Which calls: a call of at most `w` queries (every decode step; a short chunk) IS its own window block: today's one
block gives the output and every signal, and the two flex launches would add work, not save it. So a decode step
keeps today's form (item 5): one query row against `B` slots is already a `1 x B` block, memory-bound on reading the
cache once, which both forms do; the flex form would read the cache three times (two calls and the window block).

Block masks are built at block granularity from per-block position bounds (`_visibility`, never an `n x C` mask):
a block pair is listed if some pair in it may be visible (a superset: `mask_mod` decides within it) and marked full
only if every pair is (then `mask_mod` is skipped there). The eager (CPU) path of flex ignores the block lists
(it applies `mask_mod` everywhere); `tests/test_flex_measure.py` checks the lists against the dense mask.

Torch: `AuxRequest` (torch >= 2.9; the GPU image's 2.11 has it). Inductor's CPU flex does not return the LSE
(torch 2.13: NotImplementedError): `check_backend` refuses that combination by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

# Flex's default sparse block (its Triton kernels tile within it).
FLEX_BLOCK = 128


def flex_attend(q: Tensor, k_slots: Tensor, v_slots: Tensor, slot_pos: Tensor, k_new: Tensor, v_new: Tensor,
                qpos: Tensor, *, scale: float, sliding: int) -> tuple[Tensor, Tensor]:
    """The attention output `[b, q_heads, n, dv]` (in `v_new`'s dtype) and `attn` `[b, h, S + n]` (fp32; fp64 for
    fp64 inputs): each candidate's attention summed over the KV group's query heads and every valid query.

    Args:
        q: queries `[b, q_heads, n, d]`. k_slots, v_slots: `[b, h, S, d]`, or `[b, 1, P, d]` (the head pool, `S = P`).
        slot_pos: `[b, h, S]` int32 positions as each head sees its slots (-1 = empty or another head's).
        k_new, v_new: `[b, h, n, d]`. qpos: `[b, n]` int32 (-1 = pad). sliding: the window of a sliding layer, or 0.
    """
    b, hq, n, d = q.shape
    h = k_new.shape[1]
    g = hq // h
    S = slot_pos.shape[-1]
    pooled = k_slots.shape[1] != h
    # The candidates as flex's keys: one KV head per head (slots, then new tokens), or the pool's one head.
    if pooled:
        k_all, v_all = (torch.cat([s, x.reshape(b, 1, h * n, x.shape[-1])], dim=2) if S else
                        x.reshape(b, 1, h * n, x.shape[-1]) for s, x in ((k_slots, k_new), (v_slots, v_new)))
        eye = torch.eye(h, dtype=torch.bool, device=q.device).view(1, h, h, 1)
        new_kpos = torch.where(eye, qpos.view(b, 1, 1, n), -1).reshape(b, h, h * n)  # head i sees its own only
    else:
        k_all, v_all = (torch.cat([s, x], dim=2) if S else x for s, x in ((k_slots, k_new), (v_slots, v_new)))
        new_kpos = qpos.view(b, 1, n).expand(b, h, n)
    kpos = torch.cat([slot_pos, new_kpos], dim=-1) if S else new_kpos.contiguous()  # [b, h, C]: per KV head
    C = kpos.shape[-1]
    dtype = k_all.dtype
    q = q.to(dtype)

    def visible(kp: Tensor, qp: Tensor) -> Tensor:
        vis = (kp >= 0) & (kp <= qp)
        return vis & (kp > qp - sliding) if sliding else vis

    def mask_mod(bi, hi, qi, ki):
        return visible(kpos[bi, hi // g, ki], qpos[bi, qi])

    vis_blk, full_blk = _visibility(kpos, qpos, sliding)  # [b, h, nq, nk]
    vis_q, full_q = (x.repeat_interleave(g, dim=1) for x in (vis_blk, full_blk))  # per query head
    mask = _block_mask(vis_q, full_q, mask_mod, (n, C))
    flex = fused_flex(q.device)
    out, aux = flex(q, k_all, v_all, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))

    # The transposed call: per KV head of `k_all` (h, or 1 pooled), its `heads` query heads' queries, each head's
    # padded to whole blocks so that a key block of the folded axis is one (head, query block).
    hk = k_all.shape[1]
    heads = hq // hk
    nq = vis_blk.shape[2]
    n_pad = nq * FLEX_BLOCK
    qf = F.pad(q, (0, 0, 0, n_pad - n)).reshape(b, hk, heads * n_pad, d)
    qpos_pad = F.pad(qpos, (0, n_pad - n), value=-1)
    # Rows with nothing visible (pads) have lse -inf; they are masked out, and a finite value keeps the algebra
    # NaN-free wherever the score_mod is evaluated before the mask.
    lse = aux.lse.float() if aux.lse.dtype != torch.float64 else aux.lse
    lse = F.pad(lse.masked_fill(lse == float("-inf"), 0.0), (0, n_pad - n))  # [b, hq, n_pad]

    def mask_mod_t(bi, hi, ci, ri):
        j = hi * heads + ri // n_pad
        return visible(kpos[bi, j // g, ci], qpos_pad[bi, ri % n_pad])

    def score_mod_t(s, bi, hi, ci, ri):
        return s - lse[bi, hi * heads + ri // n_pad, ri % n_pad]

    def transpose(x: Tensor) -> Tensor:  # [b, hq, nq, nk] -> [b, hk, nk, heads * nq]
        nk = x.shape[-1]
        return x.view(b, hk, heads, nq, nk).permute(0, 1, 4, 2, 3).reshape(b, hk, nk, heads * nq)

    mask_t = _block_mask(transpose(vis_q), transpose(full_q), mask_mod_t, (C, heads * n_pad))
    _, aux_t = flex(k_all, qf, qf, score_mod=score_mod_t, block_mask=mask_t, scale=scale,
                    return_aux=AuxRequest(lse=True))
    acc = torch.promote_types(dtype, torch.float32)
    col = aux_t.lse.to(acc).exp()  # [b, hk, C]: exp(-inf) = 0 for a candidate no query sees
    if pooled:  # a pool slot is visible to its owner's queries only: the column sum is that head's
        attn = torch.cat([torch.where(slot_pos >= 0, col[:, :, :S], 0.0), col[:, 0, S:].view(b, h, n)], dim=-1)
    else:
        attn = col
    return out.to(v_new.dtype), attn


# Which `flex_attention` an eager call uses, per device type: torch's flex is fused only when compiled; called eagerly
# it runs its math reference, which writes the n x C scores this form exists to avoid. So an eager (uncompiled) kernel
# on a GPU calls flex through its own `torch.compile` (Inductor's flex templates; the block masks and positions are
# that small graph's inputs). Inside a traced graph (the SDPA pass's `make_fx`, Dynamo) the plain op is recorded and
# the graph's backend lowers it. A CPU calls the plain op: its Inductor flex returns no log-sum-exp.
EAGER_FLEX_BACKEND = {"cuda": "inductor"}
_COMPILED: dict[str, object] = {}


def fused_flex(device: torch.device):
    """`flex_attention`, compiled with `EAGER_FLEX_BACKEND[device type]` when called outside a traced graph."""
    backend = EAGER_FLEX_BACKEND.get(torch.device(device).type)
    if backend is None or torch.compiler.is_compiling() or _tracing():
        return flex_attention
    if backend not in _COMPILED:
        # Dynamo's automatic dynamic shapes: a second call length recompiles once with symbolic lengths, so an eager
        # run over many lengths stays far from the recompile limit.
        _COMPILED[backend] = torch.compile(flex_attention, backend=backend)
    return _COMPILED[backend]


def _tracing() -> bool:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def _visibility(kpos: Tensor, qpos: Tensor, sliding: int) -> tuple[Tensor, Tensor]:
    """Block-level visibility `[b, h, nq, nk]` (bool) of query blocks against candidate blocks of `FLEX_BLOCK`:
    `vis` where some pair may be visible (a superset), `full` where every pair is. From per-block bounds of the
    valid positions, never an `n x C` mask."""
    big = torch.iinfo(torch.int32).max

    def bounds(pos: Tensor):  # [..., L] -> per block: max, min of the valid (>= 0) positions, all valid
        L = pos.shape[-1]
        nb = -(-L // FLEX_BLOCK)
        p = F.pad(pos, (0, nb * FLEX_BLOCK - L), value=-1).view(*pos.shape[:-1], nb, FLEX_BLOCK)
        valid = p >= 0
        return p.amax(-1), torch.where(valid, p, big).amin(-1), valid.all(-1)

    qmax, qmin, qall = (x.view(x.shape[0], 1, -1, 1) for x in bounds(qpos.to(torch.int32)))  # [b, 1, nq, 1]
    kmax, kmin, kall = (x.unsqueeze(2) for x in bounds(kpos.to(torch.int32)))  # [b, h, 1, nk]
    vis = (qmax >= 0) & (kmax >= 0) & (kmin <= qmax)
    full = qall & kall & (kmax <= qmin)
    if sliding:
        vis = vis & (kmax > qmin - sliding)
        full = full & (kmin > qmax - sliding)
    return vis, full


def _block_mask(vis: Tensor, full: Tensor, mask_mod, lengths: tuple[int, int]) -> BlockMask:
    """A `BlockMask` from dense block-level `vis`/`full` `[b, heads, rows, cols]`: partial blocks (visible, not full)
    and full blocks, each listed first in their row (a stable sort), counted."""
    partial = vis & ~full

    def listed(x: Tensor):
        return x.sum(-1, dtype=torch.int32), torch.argsort((~x).to(torch.int8), dim=-1, stable=True).to(torch.int32)

    num, idx = listed(partial)
    full_num, full_idx = listed(full)
    return BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=lengths)


def check_backend(gm: torch.fx.GraphModule, inner: str) -> None:
    """Refuse the fused form on a CPU under Inductor: torch's CPU flex template returns no log-sum-exp there.

    Raises:
        NotImplementedError: naming the setting and what works instead.
    """
    if inner != "inductor":
        return
    hop = torch.ops.higher_order.flex_attention
    for node in gm.graph.nodes:
        if node.target is hop:
            val = node.args[0].meta.get("val", node.args[0].meta.get("example_value"))
            if val is not None and val.device.type == "cpu":
                raise NotImplementedError(CPU_INDUCTOR)


CPU_INDUCTOR = ("fxbudget: measure='flex' cannot compile with Inductor on a CPU (torch's CPU flex_attention returns "
                "no log-sum-exp under Inductor); use measure='blocks' (the CPU default) or backend='aot_eager'")
