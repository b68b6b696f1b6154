"""The kernel's data, declared once: a layer's slots, the call's new tokens, the layer's constants, and which
`Signals` the kernel measures, totals and caches.

`LayerSlots`, `NewTokens` and `LayerConstants` are dataclasses registered as pytrees, so `make_fx` (the SDPA pass)
and `scan` see their tensors by name. Whatever holds a layer's state (the cache, a snapshot, the marker op's
arguments, a branched prefill) converts through these, never through a hand-kept list of positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import Tensor
from torch.utils import _pytree as pytree

from ..rules.base import Signals
from .signals import TOKEN_SIGNALS


@dataclass
class LayerSlots:
    """One layer's slots: every tensor a call writes in place. `S` slots per batch row and KV head.

    Attributes:
        keys, values: `[batch, kv_heads, S, head_dim]` (post-RoPE). The head pool views them `[batch, 1, h*S, d]`.
        pos: each entry's original position `[batch, kv_heads, S]` (long; -1 = empty).
        state: accumulated attention of each entry `[batch, kv_heads, S]` (float32): `acc_attn`'s carried part.
        norms: the per-token signals of each entry (`TOKEN_SIGNALS`, one column each, in that order), measured
            once when it was written `[batch, kv_heads, S, len(TOKEN_SIGNALS)]` (float32).
        totals: each `TOTALED` signal's total over the last call's candidates `[batch, kv_heads, len(TOTALED)]`.
        owner: the KV head whose entry each slot holds `[batch, kv_heads, S]` (int32, -1 = free); read and written
            only by the head-pooled layout (unpooled it is the row's own head).
    """

    keys: Tensor
    values: Tensor
    pos: Tensor
    state: Tensor
    norms: Tensor
    totals: Tensor
    owner: Tensor


@dataclass
class NewTokens:
    """The call's new tokens: keys/values `[batch, kv_heads, n, head_dim]`, positions `[batch, n]` (-1 = a pad)."""

    keys: Tensor
    values: Tensor
    pos: Tensor


@dataclass
class LayerConstants:
    """What the kernel reads and never writes: RoPE inverse frequencies `[head_dim // 2]` (NaN = unknown, zeros for
    a NoPE layer) and the output projection's factors `wo` (`signals.out_projection_factors`; NaN = unknown)."""

    inv_freq: Tensor
    wo: Tensor


for _cls in (LayerSlots, NewTokens, LayerConstants):
    pytree.register_dataclass(_cls)

SLOT_FIELDS = tuple(f.name for f in fields(LayerSlots))
# The signal tensors `measure` returns (a dict, in this order): every `Signals` field but the two the rule region
# adds (`budget`, `window`).
SIGNAL_NAMES = tuple(f.name for f in fields(Signals) if f.name not in ("budget", "window"))
# The per-candidate signals, whose per-call totals are stored (`LayerSlots.totals`). Storing them makes every signal a
# live value for every rule: dead-code elimination cannot give one rule a cheaper kernel.
TOTALED = tuple(f.name for f in fields(Signals) if f.metadata.get("per_candidate"))
assert set(TOKEN_SIGNALS) <= set(TOTALED), "a per-token signal is a per-candidate Signals field"

# The marker op's tensor arguments (`fxbudget.kernel.marker.candidates`), in order: the slots, the new tokens, the constants.
MARKER_TENSORS = SLOT_FIELDS + ("k_new", "v_new", "new_pos", "inv_freq", "wo")


def marker_tensors(slots: LayerSlots, new: NewTokens, const: LayerConstants) -> tuple[Tensor, ...]:
    """The marker op's tensor arguments (`MARKER_TENSORS`) of one call."""
    return (*(getattr(slots, f) for f in SLOT_FIELDS), new.keys, new.values, new.pos, const.inv_freq, const.wo)


def from_marker(tensors) -> tuple[LayerSlots, NewTokens, LayerConstants]:
    """`marker_tensors`' inverse: works on tensors and on the graph's nodes alike (the SDPA pass)."""
    k = len(SLOT_FIELDS)
    return LayerSlots(*tensors[:k]), NewTokens(*tensors[k:k + 3]), LayerConstants(*tensors[k + 3:k + 5])
