"""The positions of a call's tokens, per row: what the kernel sees as `new_pos` (-1 = a pad).

A batch of prompts of different lengths is left-padded, with a 2-D `attention_mask` of 0s (pads) then 1s, as
transformers' `generate()` does. Each row then numbers its own tokens from 0, exactly as if it ran alone (the
positions `generate()` computes from the mask); pads get -1: never visible, never kept. `BudgetForward` passes the
same positions to the model (RoPE), so the kernel and the model agree on every token's position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import BudgetCache


def call_positions(cache: BudgetCache, n: int, attention_mask: Tensor | None, position_ids: Tensor | None,
                   device: torch.device) -> Tensor:
    """Positions `[batch, n]` of a call of `n` tokens on `cache` (-1 for pads).

    Args:
        cache: the call's cache; `cache.next_pos` is each row's next position, `cache.tokens_seen` the tokens (pads
            included) it has seen, which a mask covering past and current tokens must match.
        attention_mask: None, or `[batch, seen + n]` of 0/1, each row 0s then 1s (left padding).
        position_ids: None, or `[batch or 1, n]`; where given they must equal the positions above on every real token.
        device: where the positions live.
    Returns:
        A long tensor `[batch, n]`.
    Raises:
        ValueError: for a mask that is not left padding (holes, right padding), one that does not match the cache, or
            position_ids that do not continue the rows' positions.
    """
    batch, seen = cache.batch_size, cache.tokens_seen
    nxt = cache.next_pos.to(device)
    if attention_mask is None:
        pos = nxt.unsqueeze(1) + torch.arange(n, device=device)
    else:
        mask = attention_mask.to(device)
        if mask.dim() != 2 or mask.shape != (batch, seen + n):
            raise ValueError(f"attention_mask must be 2-D [batch, past + new tokens] = [{batch}, {seen + n}], got "
                             f"{tuple(mask.shape)} (fxbudget builds visibility from positions; 4-D masks are refused)")
        if bool(((mask != 0) & (mask != 1)).any()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("attention_mask must be left padding: each row 0s (pads) then 1s, no holes and no right "
                             "padding")
        if not torch.equal(mask[:, :seen].sum(-1), nxt):
            raise ValueError("attention_mask does not match the cache: its past part must have as many 1s per row as "
                             "the tokens the cache has seen for that row")
        real = mask[:, seen:].long()
        pos = torch.where(real.bool(), nxt.unsqueeze(1) + real.cumsum(-1) - 1, -1)
    if position_ids is not None:
        given = position_ids.to(device).reshape(-1, n).expand(batch, n)
        if position_ids.shape[-1] != n or not torch.equal(torch.where(pos >= 0, given, -1), pos):
            raise ValueError("position_ids must continue each row's positions (left padding is given by "
                             "attention_mask; no gaps)")
    return pos
