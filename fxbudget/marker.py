"""The marker op `fxbudget::candidates`, which links each attention call to its cache slots.

`BudgetLayer.update` emits it with everything the kernel needs; the SDPA pass (compiled path) and the eager
interceptor (eager path) find the SDPA call it feeds and replace it with `budget_attention`. Its own module, so
that the cache and the eager interceptor both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class NoBudgetAttentionError(RuntimeError):
    """Attention fed by a BudgetCache that fxbudget cannot budget: none in the traced graph, or an SDPA call (or
    another op) reading a layer's cached keys/values through an op the SDPA pass does not follow."""


@torch.library.custom_op("fxbudget::candidates", mutates_args=())
def candidates(
    k_slots: Tensor, v_slots: Tensor, pos_slots: Tensor, state: Tensor, norms: Tensor, totals: Tensor,
    k_new: Tensor, v_new: Tensor, new_pos: Tensor, inv_freq: Tensor, wo: Tensor, owner: Tensor, layer: int, budget: int,
    keep: int, sliding: int, pooled: bool,
) -> tuple[Tensor, Tensor]:
    """Marker: the candidate keys/values (slots then new tokens), as a plain cache would hand them to SDPA."""
    return torch.cat([k_slots, k_new], dim=2), torch.cat([v_slots, v_new], dim=2)


@candidates.register_fake
def _(k_slots, v_slots, pos_slots, state, norms, totals, k_new, v_new, new_pos, inv_freq, wo, owner, layer, budget,
      keep, sliding, pooled):
    return torch.cat([k_slots, k_new], dim=2), torch.cat([v_slots, v_new], dim=2)


# Positional argument names of the marker, shared by the pass and the eager interceptor.
MARKER_TENSORS = ("k_slots", "v_slots", "pos_slots", "state", "norms", "totals", "k_new", "v_new", "new_pos",
                  "inv_freq", "wo", "owner")
MARKER_STATICS = ("layer", "budget", "keep", "sliding", "pooled")


@dataclass
class MarkerCall:
    """The marker's arguments, attached to its eager outputs so the eager interceptor can find them."""

    tensors: tuple[Tensor, ...]
    layer: int
    budget: int
    keep: int
    sliding: int
    pooled: bool = False
