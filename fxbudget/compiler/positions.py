"""The positions of a call's tokens, per row: what the kernel sees as `new_pos` (-1 = a pad).

A batch of prompts of different lengths is left-padded, with a 2-D `attention_mask` of 0s (pads) then 1s, as
transformers' `generate()` does. Each row then numbers its own tokens from 0, exactly as if it ran alone (the
positions `generate()` computes from the mask); pads get -1: never visible, never kept. `BudgetForward` passes the
same positions to the model (RoPE), so the kernel and the model agree on every token's position.

Host syncs (reading a device tensor on the host stalls an accelerator's queue): a call with neither a mask nor
`position_ids` reads nothing; a call of several tokens with either reads one small tensor, once for the whole call
(every check and each chunk's count of real tokens together); a decode step (one token) reads nothing: its mask is
used only in its new column (1 = a real token, 0 = a masked-out one that is never visible nor kept, as transformers
treats a 0 there) and its `position_ids` are not re-read (the cache numbers each row's tokens itself). The mask's
past part was checked when those tokens were added, which is why a decode step need not read it again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.budget_cache import BudgetCache


def call_positions(cache: BudgetCache, n: int, attention_mask: Tensor | None, position_ids: Tensor | None,
                   device: torch.device, chunks: list[slice] | None = None) -> tuple[Tensor, list[int], int]:
    """Positions `[batch, n]` of a call of `n` tokens on `cache` (-1 for pads), and counts of real tokens.

    Args:
        cache: the call's cache; `cache.next_pos` is each row's next position; `get_seq_length()` the tokens (pads
            included) it has seen, which a mask covering past and current tokens must match.
        attention_mask: None, or `[batch, seen + n]` of 0/1, each row 0s then 1s (left padding).
        position_ids: None, or `[batch or 1, n]`; where given they must equal the positions above on every real token.
        device: where the positions live.
        chunks: the slices the call runs in (default: one); each gets the largest number of real tokens of a row.
    Returns:
        A long tensor `[batch, n]`; per chunk, the most real tokens of any row in it; the most real tokens of any
        row in the whole call (host ints; for a decode step with a mask, the upper bound 1).
    Raises:
        ValueError: for a mask that is not left padding (holes, right padding), one that does not match the cache, or
            position_ids that do not continue the rows' positions (calls of more than one token).
    """
    chunks = chunks or [slice(0, n)]
    sizes = [sl.stop - sl.start for sl in chunks]
    batch = cache.batch_size
    nxt = cache.next_pos.to(device)
    if attention_mask is None:
        pos = nxt.unsqueeze(1) + torch.arange(n, device=device)
        real = None
    else:
        mask = attention_mask.to(device)
        if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < n:
            raise ValueError(f"attention_mask must be 2-D [batch, past + new tokens] = [{batch}, past + {n}], got "
                             f"{tuple(mask.shape)} (fxbudget builds visibility from positions; 4-D masks are refused)")
        real = mask[:, -n:] == 1
        pos = torch.where(real, nxt.unsqueeze(1) + real.long().cumsum(-1) - 1, -1)
    if n == 1 or (attention_mask is None and position_ids is None):
        return pos, sizes, n  # nothing read back (see the module docstring)
    # mask values, mask vs cache, position_ids, and whether they restart below the cache's positions (a re-feed)
    checks = [torch.ones((), dtype=torch.bool, device=device)] * 3 + [torch.zeros((), dtype=torch.bool, device=device)]
    if attention_mask is not None:
        past = mask.shape[1] - n
        # One read for the whole call: every check, the cache's count, and the chunks' counts of real tokens.
        checks[0] = ~(((mask != 0) & (mask != 1)).any() | (mask[:, 1:] < mask[:, :-1]).any())
        checks[1] = (mask[:, :past].sum(-1) == nxt).all() & (cache.get_seq_length().to(device) == past)
    if position_ids is not None:
        if position_ids.shape[-1] != n:
            raise ValueError(f"position_ids must have the call's {n} positions, got shape {tuple(position_ids.shape)}")
        given = position_ids.to(device).reshape(-1, n).expand(batch, n)
        checks[2] = (torch.where(pos >= 0, given, -1) == pos).all()
        checks[3] = ((given < nxt.unsqueeze(1)) & (pos >= 0)).any()
    counts = [real.sum(-1).max(), *(real[:, sl].sum(-1).max() for sl in chunks)] if real is not None else []
    values = torch.stack([c.long() for c in checks + counts]).tolist()  # the call's only host read
    if not values[0]:
        raise ValueError("attention_mask must be left padding: each row 0s (pads) then 1s, no holes and no right "
                         "padding")
    if not values[1]:
        raise ValueError("attention_mask does not match the cache: its past part must have as many 1s per row as "
                         "the tokens the cache has seen for that row")
    if not values[2] and values[3]:
        raise ValueError("position_ids restart at positions the cache already holds: this call feeds tokens again "
                         "that the cache has seen (generate() with a prefilled cache re-feeds its whole input_ids "
                         "under assisted generation); pass only the new tokens, with an attention_mask covering the "
                         "cache's tokens and theirs")
    if not values[2]:
        raise ValueError("position_ids must continue each row's positions (left padding is given by "
                         "attention_mask; no gaps)")
    return (pos, values[5:], values[4]) if counts else (pos, sizes, n)
