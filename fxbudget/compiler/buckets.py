"""Shape buckets: the few lengths a compiled call runs at, so that a bounded number of graphs serves every length.

A compiled graph has static shapes (`dynamic=False`: the kernel's block loop and its top-k need them), so every
distinct call length would be a graph of its own, and Dynamo's recompile limit turns the ninth into an error. A
compiled call of `n > 1` tokens therefore runs at `bucket_length(n)`, padded on the left with fxbudget's own pads:
position -1, never visible, never kept, counted in no signal and not in `get_seq_length()`. The rule's observation
window is counted per row over real tokens (`Signals.window`), so a padded call scores exactly as the unpadded one.

Bound: calls of 2 to 128K (2**17) tokens fall into `len(bucket_set(2**17)) = 48` buckets (16, 32, 48, 64, then four
per doubling); a decode step (one token) is one more graph. So one compiled region serves any sequence of lengths
up to 128K with at most 49 graphs per eviction mode (frozen calls keep every slot: another 49 at most), plus one per
bucket longer than the slots for a call on an empty cache (it skips the slots, `CallPositions.empty`; never frozen:
such a call does not fit), and at most `MAX_GRAPHS_PER_REGION` for lengths up to 2**20, which is the recompile limit
fxbudget runs its regions under.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_LENGTH = 2**20  # the longest call the recompile limit below is sized for (longer calls still bucket)


def bucket_length(n: int, buckets: tuple[int, ...] = ()) -> int:
    """The length a call of `n > 1` tokens runs at: the smallest of `buckets` that holds it, else `n` rounded up to
    a quarter of its power of two, at least 16: from 64 tokens on at most a quarter more tokens (four lengths per
    doubling); below, a multiple of 16 (16, 32, 48, 64).

    Args:
        n: the call's tokens (>= 1). buckets: lengths tried first (e.g. the prefill chunk size).
    Returns:
        The bucket length (>= n).
    """
    fits = [b for b in buckets if b >= n]
    if fits:
        return min(fits)
    step = max(16, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


def bucket_set(longest: int, buckets: tuple[int, ...] = ()) -> list[int]:
    """Every bucket a call of 2 to `longest` tokens can run at (sorted): what bounds the number of graphs."""
    out, n = set(), 2
    while n <= longest:
        b = bucket_length(n, buckets)
        out.add(b)
        n = b + 1
    return sorted(out)


# Per compiled region: every bucket up to MAX_LENGTH, plus the decode step, in both eviction modes (frozen or not),
# and every bucket once more on an empty cache.
MAX_GRAPHS_PER_REGION = 2 * (len(bucket_set(MAX_LENGTH)) + 1) + len(bucket_set(MAX_LENGTH))


def pad_left(kwargs: dict, name: str, pads: int, call_pos: torch.Tensor) -> torch.Tensor:
    """Pad a call's per-token inputs on the left by `pads` of fxbudget's own pads, in place in `kwargs`.

    Pads are token 0 (any token: never attended), RoPE position 0 (unused) and kernel position -1; labels of the
    pads and of the first real token (which the last pad's logits would predict) are -100, so a loss keeps exactly
    the terms of the unpadded call.

    Args:
        kwargs: the forward's keyword arguments; `kwargs[name]` is `input_ids` or `inputs_embeds`.
        name: which of the two the call has. pads: how many. call_pos: the call's kernel positions `[batch, n]`.
    Returns:
        The padded kernel positions `[batch, n + pads]`.
    """
    x = kwargs[name]
    kwargs[name] = torch.cat([x.new_zeros(x.shape[0], pads, *x.shape[2:]), x], dim=1)
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = F.pad(kwargs["position_ids"], (pads, 0), value=0)
    if kwargs.get("labels") is not None:
        labels = F.pad(kwargs["labels"], (pads, 0), value=-100)
        labels[:, pads] = -100
        kwargs["labels"] = labels
    return F.pad(call_pos, (pads, 0), value=-1)


def unpad_outputs(out, n: int):
    """Drop the pads' logits and hidden states from a padded call's outputs (a call of `n` real columns)."""
    if out.logits.shape[1] > n:  # every position's logits were asked for
        out.logits = out.logits[:, -n:]
    if getattr(out, "hidden_states", None) is not None:
        out.hidden_states = tuple(h[:, -n:] for h in out.hidden_states)
    return out
