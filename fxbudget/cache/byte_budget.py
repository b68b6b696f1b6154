"""A memory budget in bytes: `budget="256MiB"` is the largest token budget whose cache fits in that many bytes.

The bytes are what a `BudgetCache` allocates for one sequence (batch row) in its slot tensors (`LayerSlots`): keys and
values at the cache's dtype, and each entry's bookkeeping (position int64, carried attention and per-token signals
fp32, owner head int32), every layer; sliding layers hold their window whatever the budget, and the per-head totals
are fixed. So the bytes are `fixed + tokens x per_token`, read off two caches built on the meta device (nothing is
allocated): whatever the layout (per-layer schedules sum to the same entries, a head pool holds the same slots) or a
storage a cache adds later, the count is the cache's own. Head-room (`headroom`, `interval`) comes on top.
"""

from __future__ import annotations

import torch

from ..checks import byte_size, size_label
from ..kernel.state import SLOT_FIELDS
from .budget_cache import BudgetCache


def cache_bytes(config, tokens: int, *, dtype: torch.dtype, head_pool: bool = False,
                slot_dtype: str | None = None) -> int:
    """Bytes of the slot tensors of a `BudgetCache(config, tokens)` for one sequence, no head-room (meta device)."""
    cache = BudgetCache(config, tokens, 1, dtype=dtype, device="meta", head_pool=head_pool, slot_dtype=slot_dtype)
    return sum(getattr(layer, f).numel() * getattr(layer, f).element_size() for layer in cache.layers
               for f in SLOT_FIELDS)


def tokens_for_bytes(spec: str, config, *, dtype: torch.dtype, head_pool: bool = False,
                     slot_dtype: str | None = None) -> int:
    """The largest token budget (entries per full-attention layer and KV head) whose cache fits in `spec` bytes.

    Raises:
        ValueError: a malformed size, a model with no layer a budget applies to, or a size below one entry per
            layer and KV head (the message gives the smallest that works).
    """
    total = byte_size(spec)
    if total is None:
        raise ValueError(f"not a byte budget: {spec!r} (a number and a unit such as 256MiB)")
    one, two = (cache_bytes(config, t, dtype=dtype, head_pool=head_pool, slot_dtype=slot_dtype) for t in (1, 2))
    per_token, fixed = two - one, 2 * one - two
    if per_token == 0:
        raise ValueError(f"budget {spec}: this model has no full-attention layer (every layer holds its sliding "
                         "window), so there is nothing a budget limits")
    tokens = (total - fixed) // per_token
    if tokens < 1:
        dt = str(dtype).removeprefix("torch.") + ("" if slot_dtype in (None, "model") else f" ({slot_dtype} slots)")
        raise ValueError(f"budget {spec} is below one entry per layer and KV head for this model in {dt}: the "
                         f"smallest byte budget that works is {_bytes(one)} (each further entry per layer "
                         f"and KV head adds {per_token} B)")
    return tokens


def model_tokens_for_bytes(spec: str, model, *, head_pool: bool, slot_dtype: str | None = None) -> int:
    """`tokens_for_bytes` for a loaded model: its config, and its dtype now."""
    return tokens_for_bytes(spec, model.config, dtype=next(model.parameters()).dtype, head_pool=head_pool,
                            slot_dtype=slot_dtype)


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n} B = {size_label(n)}"
