"""How slots store keys and values: in the model's dtype (the default), or quantized with one float32 scale per entry
and head (symmetric absmax over the head's `d` numbers), a kernel setting of the run (`slot_dtype`).

A quantized slot tensor keeps each entry's codes and its scale side by side in one row of integers, so the slot
tensors, the marker op and every graph keep their signature, and only integer bits move through `evict` (a compiled
`where` of float8 may go through float32 and lose NaN bit patterns, which a scale's bytes can hold). The format is
read off the tensor's dtype and row width (`slot_format`):

| `slot_dtype`    | tensor | row (bytes) | codes                                                      |
|-----------------|--------|-------------|------------------------------------------------------------|
| `float8_e4m3fn` | uint8  | d + 4       | float8_e4m3fn bits of x / s, s = absmax / 448 (e4m3's max) |
| `int8`          | int8   | d + 4       | round(x / s) in [-127, 127], s = absmax / 127              |
| `int4`          | uint8  | d / 2 + 4   | round(x / s) + 8 in [1, 15], s = absmax / 7, two per byte  |
| `bfloat16`      | bf16   | d           | x cast (no scale): 16-bit slots for a float32 model        |

The last 4 bytes of a quantized row are its scale's float32 bits. A floating slot tensor is a cast of the model's
dtype (none when they agree: "model" and `bfloat16` slots of a bf16 model are bit-identical). `encode` writes a call's
new tokens into that form when `evict` stores them; `decode` gives the measure phase (and the marker's plain-attention
view) what the slots hold, in the model's dtype: the rule and the attention see the stored values. A call's own new
tokens are attended in the model's dtype (as transformers' QuantizedCache does with its residual tokens); their
per-token signals (norms) are measured on what will be stored (`stored_new`), like every cached entry's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .state import LayerSlots, NewTokens

SCALE_BYTES = 4  # a float32 scale per entry and head, after its codes
_STORAGE = {"float8_e4m3fn": torch.uint8, "int8": torch.int8, "int4": torch.uint8}
_QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0, "int4": 7.0}
_CAST = {"bfloat16": torch.bfloat16}  # floating storages: a cast, no scale


def slot_format(t: Tensor, d: int) -> str | None:
    """The quantized format a slot tensor of `d`-dim heads holds, None for a floating one (cast, no scale)."""
    if t.dtype == torch.int8:
        return "int8"
    if t.dtype == torch.uint8:
        return "float8_e4m3fn" if t.shape[-1] == d + SCALE_BYTES else "int4"
    return None


def slot_shape(slot_dtype: str, d: int) -> tuple[torch.dtype | None, int]:
    """`(tensor dtype, row width)` of slots of `d`-dim heads (None: the model's dtype, width `d`)."""
    if slot_dtype == "model":
        return None, d
    if slot_dtype in _CAST:
        return _CAST[slot_dtype], d
    if slot_dtype == "int4" and d % 2:
        raise ValueError(f"slot_dtype='int4' packs two numbers per byte: head_dim {d} must be even")
    return _STORAGE[slot_dtype], (d // 2 if slot_dtype == "int4" else d) + SCALE_BYTES


def encode(x: Tensor, like: Tensor) -> Tensor:
    """`x` `[..., d]` (the model's dtype) in the storage of slot tensor `like` (`x` itself for the model's dtype)."""
    fmt = slot_format(like, x.shape[-1])
    if fmt is None:
        return x.to(like.dtype)
    xf = x.float()
    qmax = _QMAX[fmt]
    scale = xf.abs().amax(dim=-1, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0, scale 1
    y = xf / scale
    if fmt == "float8_e4m3fn":
        codes = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    elif fmt == "int8":
        codes = y.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        q = (y.round().clamp(-qmax, qmax) + 8).to(torch.uint8)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return torch.cat([codes, _scale_bytes(scale).view(like.dtype)], dim=-1)


def decode(t: Tensor, d: int, dtype: torch.dtype) -> Tensor:
    """Slot tensor `t` as `[..., d]` values in `dtype` (`t` itself in the model's dtype)."""
    fmt = slot_format(t, d)
    if fmt is None:
        return t.to(dtype)
    width = t.shape[-1] - SCALE_BYTES
    scale = _scale_of(t[..., width:])  # [..., 1]
    codes = t[..., :width]
    if fmt == "int4":
        values = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).to(torch.float32) - 8
    elif fmt == "float8_e4m3fn":
        values = codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        values = codes.to(torch.float32)
    return (values * scale).to(dtype)


# The scale's float32 bits as 4 bytes (little-endian), by shifts and masks on int32 and same-size bitcasts only: a
# bitcast between sizes (uint8[4] <-> float32) is an ATen call outside Inductor's kernels, these fuse. A scale is
# positive, so its bits fit an int32 without a sign (the top byte is below 128).
def _scale_bytes(scale: Tensor) -> Tensor:
    """`[..., 1]` float32 -> `[..., 4]` uint8."""
    bits = scale.view(torch.int32)
    return torch.cat([(bits >> (8 * i)) & 255 for i in range(SCALE_BYTES)], dim=-1).to(torch.uint8)


def _scale_of(raw: Tensor) -> Tensor:
    """`_scale_bytes`' inverse, from the slot row's last 4 bytes (uint8 or int8)."""
    b = (raw.view(torch.uint8) if raw.dtype == torch.int8 else raw).to(torch.int32)
    bits = b[..., 0:1] | (b[..., 1:2] << 8) | (b[..., 2:3] << 16) | (b[..., 3:4] << 24)
    return bits.view(torch.float32)


def _as_model(slot_keys: Tensor, new_keys: Tensor) -> bool:
    """Whether slots store keys as the new ones are (the model's dtype): nothing to decode."""
    return slot_keys.dtype == new_keys.dtype and slot_format(slot_keys, new_keys.shape[-1]) is None


def stored_slots(slots: LayerSlots, new: NewTokens) -> LayerSlots:
    """`slots` with their keys and values as the values they store, in the new tokens' dtype."""
    if _as_model(slots.keys, new.keys):
        return slots
    return replace(slots, keys=decode(slots.keys, new.keys.shape[-1], new.keys.dtype),
                   values=decode(slots.values, new.values.shape[-1], new.values.dtype))


def stored_new(new: NewTokens, slots: LayerSlots) -> NewTokens:
    """The new tokens as `slots` would store them (`decode(encode(.))`; themselves in the model's dtype)."""
    if _as_model(slots.keys, new.keys):
        return new
    return NewTokens(decode(encode(new.keys, slots.keys), new.keys.shape[-1], new.keys.dtype),
                     decode(encode(new.values, slots.values), new.values.shape[-1], new.values.dtype), new.pos)


def round_trip(x: Tensor, slot_dtype: str) -> Tensor:
    """What slots of `slot_dtype` give back for `x`: `decode(encode(x))` (the oracle's quantized cache uses it)."""
    storage, width = slot_shape(slot_dtype, x.shape[-1])
    if storage is None:
        return x
    like = torch.empty(0, width, dtype=storage, device=x.device)
    return decode(encode(x, like), x.shape[-1], x.dtype)
