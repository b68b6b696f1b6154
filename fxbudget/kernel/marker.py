"""The marker op `fxbudget::candidates`, which links each attention call to its cache slots.

`BudgetLayer.update` emits it with everything the kernel needs; the SDPA pass (compiled path) and the eager
interceptor (eager path) find the SDPA call it feeds and replace it with `budget_attention`. Its own module, so
that the cache and the eager interceptor both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .slot_storage import decode
from .state import MARKER_TENSORS


class NoBudgetAttentionError(RuntimeError):
    """Attention fed by a BudgetCache that fxbudget cannot budget: none in the traced graph, or an SDPA call (or
    another op) reading a layer's cached keys/values through an op the SDPA pass does not follow."""


@torch.library.custom_op("fxbudget::candidates", mutates_args=())
def candidates(
    keys: Tensor, values: Tensor, pos: Tensor, state: Tensor, norms: Tensor, totals: Tensor, owner: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor, wo: Tensor, layer: int, budget: int, keep: int,
    sliding: int, pooled: bool, empty: bool,
) -> tuple[Tensor, Tensor]:
    """Marker: the candidate keys/values (slots then new tokens), as a plain cache would hand them to SDPA. Its
    tensors are `kernel.state.MARKER_TENSORS` (`marker_tensors` / `from_marker` convert)."""
    return _plain(keys, values, k_new, v_new)


@candidates.register_fake
def _(keys, values, pos, state, norms, totals, owner, k_new, v_new, new_pos, inv_freq, wo, layer, budget, keep,
      sliding, pooled, empty):
    return _plain(keys, values, k_new, v_new)


def _plain(keys, values, k_new, v_new):
    """Slots (as stored values: `slot_storage.decode`) then new tokens, in the new tokens' dtype."""
    return (torch.cat([decode(keys, k_new.shape[-1], k_new.dtype), k_new], dim=2),
            torch.cat([decode(values, v_new.shape[-1], v_new.dtype), v_new], dim=2))


assert MARKER_TENSORS == tuple(a.name for a in torch.ops.fxbudget.candidates.default._schema.arguments)[
    :len(MARKER_TENSORS)], \
    "the marker's tensors are kernel.state.MARKER_TENSORS"
# `empty`: every slot of the layer is empty (a long prefill on a fresh cache, `CallPositions.empty`): the kernel
# skips the slots, which a compiled graph cannot tell from their positions (data).
MARKER_STATICS = ("layer", "budget", "keep", "sliding", "pooled", "empty")


@dataclass
class MarkerCall:
    """The marker's arguments, attached to its eager outputs so the eager interceptor can find them."""

    tensors: tuple[Tensor, ...]
    layer: int
    budget: int
    keep: int
    sliding: int
    pooled: bool = False
    empty: bool = False
