"""The measure phase's second exact form, for GPUs: attention and `attn` from two fused `flex_attention` calls, the
window signals from a `w x (S + n)` block (issue 49; `measure.measure` picks the form, `settings.measure_form`).

Why: today's form (`attention.Block`, query blocks against every candidate) writes every query's scores. On a CPU
that is the fastest exact way; on a GPU the unmodified model's SDPA (flash) never writes them, and a kernel that does
is bound by memory traffic. Only `attn` reads every query; it has an exact fused form:

1. `flex_attention` over slots + new tokens with the queries folded: per KV head, its query heads' queries end to
   end on the query axis (`[b, kv_heads, g * n_pad, d]`, each head's padded to whole blocks; K/V are never copied
   per query head), a block mask built from the positions (`_visibility`: causal, pads (-1) never visible, the
   sliding window) and `AuxRequest(lse=True)`: the output and each folded row's log-sum-exp `lse_q`.
2. The transposed call: the candidates are the queries, the folded rows the keys, the score_mod subtracts `lse_q`
   (at the row's own index: no `enable_gqa` in either call). Its own log-sum-exp per candidate `k` is
   `log sum_q exp(s[q, k] - lse_q) = log sum_q P[q, k]`: `attn = exp(LSE_k)`, summed over the group's heads and every
   valid query (pads see nothing). Its output is discarded (its values: `VALUE_DIM` zeros per row).
3. `window_attn`, `last_attn` and `window_max_attn` read the call's last `w` queries: one `attention.Block` over them
   (the code today's form runs), `w x (S + n)` scores.
`acc_attn`, the totals and the per-token signals are `measure`'s own, the same for both forms: a rule cannot tell.
A run whose rules read neither `attn` nor `acc_attn` (its signal set, `kernel.signal_set`) skips step 2: the output
from one fused call (no log-sum-exp asked) and the window block, `attn` absent and the carried state not updated.

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
(it applies `mask_mod` everywhere); `tests/test_flex_measure.py` checks the lists against the dense mask, and that
they read the same at row-major offsets, as the GPU kernel reads them (strided lists made `attn` wrong on an H200).

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
# The transposed call's values (its output is discarded): the narrowest head flex's GPU kernels take.
VALUE_DIM = 16


def flex_attend(q: Tensor, k_slots: Tensor, v_slots: Tensor, slot_pos: Tensor, k_new: Tensor, v_new: Tensor,
                qpos: Tensor, *, scale: float, sliding: int, attn: bool = True) -> tuple[Tensor, Tensor | None]:
    """The attention output `[b, q_heads, n, dv]` (in `v_new`'s dtype) and `attn` `[b, h, S + n]` (fp32; fp64 for
    fp64 inputs): each candidate's attention summed over the KV group's query heads and every valid query.
    `attn=False` (no rule of the run reads `attn` or `acc_attn`: the run's signal set): the first call only, no
    log-sum-exp asked, and None for `attn`.

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
    # The folded queries: per KV head of `k_all` (h, or the pool's 1), its `heads` query heads' queries end to end on
    # the query axis, each head's padded to whole blocks (a view of a contiguous `q` when n is a multiple of the block). No
    # `enable_gqa`: a folded row's log-sum-exp is then read by the transposed call at its own index.
    hk = k_all.shape[1]
    heads = hq // hk
    vis_blk, full_blk = _visibility(kpos, qpos, sliding)  # [b, h, nq, nk]
    nq = vis_blk.shape[2]
    n_pad = nq * FLEX_BLOCK
    qf = (F.pad(q, (0, 0, 0, n_pad - n)) if n_pad > n else q).to(dtype).reshape(b, hk, heads * n_pad, d)
    # [b, heads * n_pad]: pads see nothing. A gather, not F.pad: Inductor 2.11 fails to inline a padding's `masked`
    # load into flex's mask_mod (the H200 run).
    at = torch.arange(n_pad, device=q.device)
    qpos_f = torch.where(at < n, qpos[:, at.clamp(max=n - 1)], -1).repeat(1, heads)
    # The head of `kpos` each folded row reads: its KV head (query head // g; in the pool, per query head).
    row_kv = (torch.arange(hq, device=q.device) // g).view(hk, heads).repeat_interleave(n_pad, dim=1)

    def kpos_at(bi, kv, ci) -> Tensor:  # kpos[bi, kv, ci], read from its two parts: Inductor 2.11 fails to inline
        # the `masked` loads of a `cat` into flex's mask_mod (the codegen leg's chunk case, the H200 run)
        if not S:
            return new_kpos[bi, kv, ci]
        return torch.where(ci < S, slot_pos[bi, kv, ci.clamp(max=S - 1)], new_kpos[bi, kv, (ci - S).clamp(min=0)])

    def visible(bi, hi, ci, ri) -> Tensor:  # candidate ci against folded row ri (the transposed call's mask_mod)
        kp, qp = kpos_at(bi, row_kv[hi, ri], ci), qpos_f[bi, ri]
        vis = (kp >= 0) & (kp <= qp)
        return vis & (kp > qp - sliding) if sliding else vis

    def fold(x: Tensor) -> Tensor:  # block level [b, h, nq, nk] -> [b, hk, heads * nq, nk]: the folded rows' blocks
        return x.repeat_interleave(g, dim=1).reshape(b, hk, heads * nq, x.shape[-1])

    vis_f, full_f = fold(vis_blk), fold(full_blk)
    flex = fused_flex(q.device)
    mask = _block_mask(vis_f, full_f, lambda bi, hi, ri, ci: visible(bi, hi, ci, ri), (heads * n_pad, C))
    if not attn:  # the output alone: one fused call, as the unmodified model's attention
        out = flex(qf, k_all, v_all, block_mask=mask, scale=scale)
        return out.view(b, hk, heads, n_pad, -1).reshape(b, hq, n_pad, -1)[:, :, :n].to(v_new.dtype), None
    out, aux = flex(qf, k_all, v_all, block_mask=mask, scale=scale, return_aux=AuxRequest(lse=True))
    out = out.view(b, hk, heads, n_pad, -1).reshape(b, hq, n_pad, -1)[:, :, :n]

    # The transposed call: the candidates are the queries, the folded rows the keys; the score_mod subtracts each
    # row's log-sum-exp. Rows with nothing visible (pads) have lse -inf; they are masked out, and a finite value
    # keeps the algebra NaN-free wherever the score_mod is evaluated before the mask. Its output is discarded: its
    # values are VALUE_DIM zeros per row, so that the discarded P @ V stays small (a view of `qf` would alias two
    # inputs of the compiled call: Dynamo 2.11 failed on it).
    lse = aux.lse.float() if aux.lse.dtype != torch.float64 else aux.lse
    lse = lse.masked_fill(lse == float("-inf"), 0.0)  # [b, hk, heads * n_pad]
    mask_t = _block_mask(vis_f.transpose(-1, -2), full_f.transpose(-1, -2), visible, (C, heads * n_pad))
    _, aux_t = flex(k_all, qf, qf.new_zeros(b, hk, heads * n_pad, VALUE_DIM),
                    score_mod=lambda s, bi, hi, ci, ri: s - lse[bi, hi, ri],
                    block_mask=mask_t, scale=scale, return_aux=AuxRequest(lse=True))
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
# Both calls' graphs share one Dynamo cache: a graph per mask and score_mod, sliding window, empty or held slots, layout,
# static then dynamic lengths (16 and more on a model with sliding layers), past Dynamo's default limit of 8, where a
# call would silently run flex's eager math path (the n x C scores). A higher limit, and an error past it.
FLEX_RECOMPILE_LIMIT = 64


def fused_flex(device: torch.device):
    """`flex_attention`, compiled with `EAGER_FLEX_BACKEND[device type]` when called outside a traced graph."""
    backend = EAGER_FLEX_BACKEND.get(torch.device(device).type)
    if backend is None or torch.compiler.is_compiling() or _tracing():
        return flex_attention
    if backend not in _COMPILED:
        # Dynamo's automatic dynamic shapes: a second call length recompiles once with symbolic lengths, so an eager
        # run over many lengths stays far from the recompile limit.
        _COMPILED[backend] = _limited(torch.compile(flex_attention, backend=backend))
    return _COMPILED[backend]


def _limited(compiled):
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            return compiled(*args, **kwargs)

    return call


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

    def listed(x: Tensor):  # contiguous: flex's GPU kernel reads the lists with unit stride along a row (the
        # transposed call's are built from transposed views; strided lists were misread on an H200)
        x = x.contiguous()
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
