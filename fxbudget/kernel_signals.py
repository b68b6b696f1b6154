"""Two signals of the shared kernel measured beside its attention blocks, for every rule (issue 23):

- `window_max_attn` (`window_max`): the largest attention probability a candidate gets from one query of the
  observation window and one query head of its KV group (DefensiveKV's max, where `window_attn` is the sum);
- `wov_norm` (`value_out_norms`): the L1 norm of a value under its query heads' slices of the layer's output
  projection, averaged over the group (CriticalKV's ||W_o v||_1), measured once per token and stored with the norms.

Both keep the kernel's memory bound: temporaries O(block x candidates), never O(n x candidates) nor
O(n x group x hidden).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.scan import scan_op

# Floats of one block of `value_out_norms` (the [tokens, group, hidden] projection of values by W_o): 8 MB on CPU,
# like `auto_block`'s bound; 1 GB on an accelerator.
_WOV_FLOATS = {"cpu": 2**21}
_WOV_FLOATS_ACCEL = 2**28


def unknown_wo(q_heads: int, v_head_dim: int, device) -> Tensor:
    """The `wo` of a layer whose output projection is unknown: one NaN row (so `wov_norm` is NaN)."""
    return torch.full((1, q_heads * v_head_dim), float("nan"), device=device)


def window_max(blk, queries: Tensor, qpos: Tensor, weights: Tensor, w: int, R: int, slots: int) -> Tensor:
    """`window_max_attn`: per candidate, the largest attention probability it gets from one query of the
    observation window (the row's last `w` real queries) and one query head of the KV group, `[b, h, S + n]`.

    The window's queries are gathered (static count `w`; a row with fewer real tokens gets pads, which see nothing)
    and attended again in blocks of at most `R` rows: exact softmax over the same visible set as `_Block`, so the
    cost is O(w x candidates) per call whatever `n`, and the temporaries stay O(block x candidates)."""
    b, h, gn, d = queries.shape
    n = qpos.shape[1]
    g = gn // n
    in_window = weights[:, 1] > 0  # [b, n]
    ranked = torch.where(in_window, torch.arange(n, device=qpos.device), -1)
    idx = torch.topk(ranked, w, dim=-1).indices  # [b, w]: the window's queries (others are masked below)
    qpos_w = qpos.gather(1, idx).masked_fill(~in_window.gather(1, idx), -1)
    q_w = queries.view(b, h, g, n, d).gather(3, idx.view(b, 1, 1, w, 1).expand(b, h, g, w, d))
    k_new, new_pos, band = blk.k_new, blk.new_pos, None
    if blk.sliding:
        # A sliding layer's window sees only a band of new tokens ending at its last query (a row's real tokens
        # are consecutive): gathered at a data offset, static length; out-of-range entries are invisible. Always
        # the band on a sliding layer, so the graph's ops do not depend on the call's length.
        length = w + blk.sliding - 1
        raw = idx.amin(dim=-1, keepdim=True) - blk.sliding + 1 + torch.arange(length, device=qpos.device)
        band = raw.clamp(0, n - 1)  # [b, length]
        k_new = blk.k_new.gather(2, band.view(b, 1, length, 1).expand(b, h, length, d))
        new_pos = blk.new_pos.gather(-1, band.unsqueeze(1)).masked_fill(((raw < 0) | (raw >= n)).unsqueeze(1), -1)
    best = None
    for r0 in range(0, w, R):
        r1 = min(r0 + R, w)
        qs = q_w[:, :, :, r0:r1].reshape(b, h, g * (r1 - r0), d) * blk.scale
        qp = qpos_w[:, r0:r1].view(b, 1, 1, r1 - r0, 1)
        parts = []
        for k, kpos in ((blk.k_slots, blk.slot_pos), (k_new, new_pos)):
            kt = k.transpose(-1, -2)
            # One head in `k` (the head pool): fold the heads into the rows, where broadcasting would copy the pool.
            lg = (qs @ kt if k.shape[1] == h else qs.reshape(b, 1, -1, d) @ kt).view(b, h, g, r1 - r0, -1)
            kp = kpos.unsqueeze(2).unsqueeze(2)
            vis = (kp >= 0) & (kp <= qp)
            if blk.sliding:
                vis = vis & (kp > qp - blk.sliding)
            parts.append(lg.masked_fill(~vis, float("-inf")))
        # Slots and new tokens apart, as `_Block`: the new tokens' part does not depend on the number of empty slots.
        ls, ln = parts
        m = ln.amax(dim=-1, keepdim=True)
        if ls.shape[-1]:
            m = torch.maximum(ls.amax(dim=-1, keepdim=True), m)
        m = m.masked_fill(m == float("-inf"), 0.0)  # a pad row sees nothing: all zeros, not NaN
        es, en = (ls - m).exp(), (ln - m).exp()
        denom = es.sum(dim=-1, keepdim=True) + en.sum(dim=-1, keepdim=True)
        inv = 1.0 / denom.masked_fill(denom == 0, 1.0)
        top = torch.cat([(es * inv).amax(dim=(2, 3)), (en * inv).amax(dim=(2, 3))], dim=-1)
        best = top if best is None else torch.maximum(best, top)
    if slots > blk.k_slots.shape[2]:  # eager, a call on an empty cache skipped its slots: they get exact zeros
        best = F.pad(best, (slots - blk.k_slots.shape[2], 0))
    if band is None:
        return best
    S = slots
    # Back to the call's tokens; the band's invisible entries carry 0, so the max over duplicates is exact.
    on_new = best.new_zeros(b, h, n).scatter_reduce(-1, band.unsqueeze(1).expand(b, h, -1), best[..., S:], "amax")
    return torch.cat([best[..., :S], on_new], dim=-1)


def value_out_norms(v: Tensor, wo: Tensor, group: int, acc: torch.dtype, traced: bool = False,
                    block: int | None = None) -> Tensor:
    """`wov_norm` of new tokens: the L1 norm of each value projected by its query heads' slices of the layer's
    output projection, averaged over the KV group (CriticalKV's ||W_o v||_1), `[b, h, n]` in `acc`.

    Args:
        v: values `[b, h, n, dv]`. wo: the layer's `o_proj.weight`, `[hidden, q_heads * dv]` (`[1, q_heads * dv]`
            of NaN when the model's is unknown: the signal is then NaN and rules that read it are refused).
        group: query heads per KV head. traced: loop over token blocks with a `scan` (static shapes).
        block: at most this many tokens per block (the kernel passes its query block).
    Blocked over tokens so that the `[tokens, group, hidden]` projection stays within `_WOV_FLOATS` floats: a long
    one-call prefill never holds it for all `n` tokens.
    """
    b, h, n, dv = v.shape
    hidden = wo.shape[0]
    w = wo.to(acc).view(hidden, h, group, dv).permute(1, 2, 3, 0)  # [h, g, dv, hidden]: query head (i, j)'s W_o^T
    floats = _WOV_FLOATS.get(v.device.type, _WOV_FLOATS_ACCEL)
    c = max(1, min(n, block or n, floats // max(1, b * h * group * hidden)))

    def part(vb: Tensor, wt: Tensor) -> Tensor:
        return (vb.to(acc).unsqueeze(2) @ wt).abs().sum(dim=-1).mean(dim=2)  # [b, h, tokens]

    if n <= c:
        return part(v, w)
    if not traced:
        return torch.cat([part(v[:, :, i:i + c], w) for i in range(0, n, c)], dim=2)
    nb = -(-n // c)
    xs = F.pad(v, (0, 0, 0, nb * c - n)).view(b, h, nb, c, dv).permute(2, 0, 1, 3, 4).contiguous()

    def body(count, vb, wt):  # the carry only counts blocks: a scan needs one, and must not return its input
        return count + 1, part(vb, wt)

    _, ys = scan_op(body, [v.new_zeros((), dtype=acc)], [xs], (w,))
    return ys.permute(1, 2, 0, 3).reshape(b, h, nb * c)[..., :n]
