"""The rule interface: what the shared kernel measures (`Signals`) and what a rule returns.

A rule is a pure scoring function of the signals. It never touches the cache and never adds a code path to the
kernel: the kernel computes the run's signal set (what the run's rules read, or every signal) for every candidate in
every call, the same for every rule of the run (DESIGN §4). A signal outside the set is absent: reading it raises.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor


def rotate_half(x: Tensor, rot: int | None = None) -> Tensor:
    """transformers' `rotate_half` on the first `rot` dims (all by default); the other dims, which partial rotary
    leaves unrotated, map to zero."""
    rot = x.shape[-1] if rot is None else rot
    a, b = x[..., :rot].chunk(2, dim=-1)
    return torch.cat([-b, a, torch.zeros_like(x[..., rot:])], dim=-1)


def rope_cos_sin(theta: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """cos and sin of RoPE angles `[..., r/2]` laid out over `d` dims as transformers applies them: the first `r`
    dims rotated (angles repeated for both halves), the rest unrotated (cos 1, sin 0)."""
    pad = d - 2 * theta.shape[-1]
    cos, sin = (torch.cat([f(theta)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    return (torch.cat([cos, cos.new_ones(*cos.shape[:-1], pad)], dim=-1),
            torch.cat([sin, sin.new_zeros(*sin.shape[:-1], pad)], dim=-1))


def unrotate(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    """Undo RoPE on `x` `[..., n, d]` rotated at positions `pos` (broadcastable to `[..., n]`) with frequencies
    `inv_freq` `[r/2]`: the first `r` dims rotated, the rest left as they are (partial rotary). In `x`'s dtype."""
    cos, sin = rope_cos_sin(pos.to(x.dtype).unsqueeze(-1) * inv_freq.to(x.dtype), x.shape[-1])
    return x * cos - rotate_half(x, 2 * inv_freq.shape[-1]) * sin


# Field metadata of the `Signals` that hold one value per candidate, `[batch, kv_heads, C]`: the kernel totals them
# per call (`fxbudget.kernel.state.TOTALED`), and a layout or a shared-prefill branch assembles them slots-then-new.
PER_CANDIDATE = {"per_candidate": True}


class SignalNotMeasured(RuntimeError):
    """A rule read a signal this run's kernel does not measure (outside the run's signal set)."""


class Absent:
    """The value of a signal the kernel did not measure (`Signals` raises `SignalNotMeasured` on reading it)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: not measured>"


@dataclass
class Signals:
    """Per-candidate measurements of one attention call, for one layer.

    Candidates are the cache slots followed by the call's new tokens (`C = slots + n`). Shapes: `[batch, kv_heads, C]`
    unless stated. Empty slots have `pos == -1`; their signals are meaningless and are overridden by the kernel.

    Attributes:
        attn: attention mass received from all of this call's queries, summed over the query heads of the KV group.
        window_attn: the same, from the last `window` queries of the call only (the observation window).
        last_attn: the same, from the last query of the call only.
        acc_attn: attention mass accumulated over every query so far, this call included (the carried state).
        key_norm: L2 norm of each candidate key (post-RoPE, as cached).
        value_norm: L2 norm of each candidate value.
        pos: original position of each candidate (`-1` = empty slot).
        queries: this call's queries grouped per KV head, `[batch, kv_heads, group * n, head_dim]`.
        k_slots, k_new: cached keys `[batch, kv_heads, S, head_dim]` and this call's keys (`keys` joins them).
        new_pos: positions of this call's tokens `[batch, n]` (-1 = a pad, never visible nor kept); `step` is the
            number of positions each row has seen after the call, `[batch, 1, 1]` (broadcasts against `[b, h, C]`).
        inv_freq: the layer's RoPE inverse frequencies `[head_dim // 2]` (NaN if the model's RoPE is not the default
            kind); `queries` and keys are post-RoPE.
        v_slots, v_new: cached values `[batch, kv_heads, S, head_dim]` and this call's values (`values` joins them).
        window_max_attn: the largest attention probability from any one query of the observation window and any one
            query head of the KV group (the max, where `window_attn` is the sum).
        wov_norm: L2 norm of each candidate value projected by the layer's output projection, `||W_o^(j) v||_2`
            over the group's query heads j, averaged over the group (CriticalKV's weight, whose paper takes the L1
            norm; NaN if W_o is unknown).
        budget: the number of slots the layer keeps (a Python int, fixed at compile time).
        window: the observation window, per row `[batch, 1, 1]` (long): how many of this call's real queries
            `window_attn` sums over, `min(w, the row's real tokens)`. A tensor, not an int, so that padding a call
            to a shape bucket (compiled calls) changes nothing a rule computes; it broadcasts against `[b, h, C]`.
    """

    attn: Tensor = field(metadata=PER_CANDIDATE)
    window_attn: Tensor = field(metadata=PER_CANDIDATE)
    last_attn: Tensor = field(metadata=PER_CANDIDATE)
    acc_attn: Tensor = field(metadata=PER_CANDIDATE)
    key_norm: Tensor = field(metadata=PER_CANDIDATE)
    value_norm: Tensor = field(metadata=PER_CANDIDATE)
    pos: Tensor = field(metadata=PER_CANDIDATE)
    queries: Tensor
    k_slots: Tensor
    k_new: Tensor
    new_pos: Tensor
    inv_freq: Tensor
    v_slots: Tensor
    v_new: Tensor
    window_max_attn: Tensor = field(metadata=PER_CANDIDATE)
    wov_norm: Tensor = field(metadata=PER_CANDIDATE)
    budget: int
    window: Tensor

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        # `dataclasses.replace` (a rule's modified copy) reads every field: it copies an absent one as it is.
        if type(value) is Absent and sys._getframe(1).f_code.co_filename != dataclasses.__file__:
            raise SignalNotMeasured(
                f"s.{name} is not measured by this run's kernel: its signal set holds what the run's rules read on "
                f"their dry run (fxbudget.kernel.signal_set), or every signal with signals='all'")
        return value

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the measured signals and of the score (float32; float64 for float64 inputs), read from the
        keys, which every kernel has: a rule that needs a dtype reads it here, not off a signal it would otherwise
        make the kernel measure."""
        return torch.promote_types(self.k_slots.dtype, torch.float32)

    @property
    def step(self) -> Tensor:
        """Positions seen by each row after this call, `[batch, 1, 1]` (long): the row's newest position + 1."""
        return (self.new_pos.amax(dim=-1) + 1).view(-1, 1, 1)

    @property
    def keys(self) -> Tensor:
        """Candidate keys `[batch, kv_heads, C, head_dim]` (a copy: only rules that read keys pay for it)."""
        return torch.cat([self.k_slots, self.k_new], dim=2)

    @property
    def values(self) -> Tensor:
        """Candidate values `[batch, kv_heads, C, head_dim]` (a copy: only rules that read values pay for it)."""
        return torch.cat([self.v_slots, self.v_new], dim=2)

    def prerope_keys(self) -> Tensor:
        """Candidate keys before RoPE, `[batch, kv_heads, C, head_dim]` in float32 (float64 for float64 inputs): the
        cached keys rotated back by their own positions with `inv_freq` (half-split layout; with partial rotary only
        the first `2 * len(inv_freq)` dims are rotated, the rest come back as they are; a NoPE layer's `inv_freq` is
        zeros: no rotation). A rule that calls it sets `needs_rope`. Empty slots (position -1) come back
        meaningless, like their other signals."""
        keys = self.keys.to(torch.promote_types(self.k_slots.dtype, torch.float32))
        return unrotate(keys, self.pos, self.inv_freq)

    @functools.cached_property
    def order(self) -> Tensor:
        """Candidate indices sorted by position, oldest first (empty slots first): slots are unordered, so a rule
        that pools over neighbouring positions sorts first (and pays for it in its own ops)."""
        return torch.argsort(self.pos, dim=-1, stable=True)

    def in_sequence_order(self, x: Tensor) -> Tensor:
        """`x` ([..., C]) reordered oldest-first; undo with `from_sequence_order`."""
        return x.gather(-1, self.order)

    def in_sequence_order_rows(self, x: Tensor) -> Tensor:
        """Per-candidate rows `x` ([b, h, C, d], e.g. `keys`) reordered oldest-first."""
        return x.gather(2, self.order.unsqueeze(-1).expand_as(x))

    def from_sequence_order(self, x: Tensor) -> Tensor:
        """Inverse of `in_sequence_order`."""
        return torch.empty_like(x).scatter(-1, self.order, x)


class Rule:
    """Base class of eviction rules. Subclasses are dataclasses whose fields are the hyperparameters.

    Override `score` (higher = keep) and, if the rule protects tokens unconditionally (sinks, a recent window),
    `protect` and `protected_per_head` (how many it protects in a full head). `window` is the observation window the
    rule wants from the kernel (None = the kernel default); a run compares rules only at one window (DESIGN §4).

    Capabilities are declared here, once, with their defaults; every caller reads them as plain attributes and a
    wrapper (`fxbudget.rules.wrapper.Wrapper`) answers with the wrapped rule's.
    """

    name: ClassVar[str] = ""
    window: int | None = None
    never_evicts: ClassVar[bool] = False  # True for `full`: a call that would overflow the budget is an error
    # True if `score` reads `inv_freq` (the model's own, `fxbudget.cache.rope`): dynamic/LongRoPE and interleaved
    # rotation are refused
    needs_rope: ClassVar[bool] = False
    needs_wo: ClassVar[bool] = False  # True if `score` reads `wov_norm`: models whose W_o is not found are refused
    # True for rules that spread a layer's budget over its KV heads (`AdaKV`): they run on the head-pooled layout.
    head_adaptive: ClassVar[bool] = False
    # True for rules that evict only in their own replay protocol (`kvzip`, `fxbudget.harness.kvzip_protocol`): an evicting
    # call of plain generation is refused.
    replay_only: ClassVar[bool] = False

    def protected_per_head(self, budget: int) -> int:
        """How many candidates `protect` marks in a full head at `budget` (sinks, a recent window): a head-adaptive
        allocation refuses a budget below it (the heads' protected tokens must all fit)."""
        return 0

    def head_floor(self, budget: int) -> int:
        """Entries each KV head keeps on the head-pooled layout whatever the other heads score: the whole `budget`
        (uniform allocation: the unpooled layout's kept sets), less for a head-adaptive rule (`AdaKV`)."""
        return budget

    def check_budget(self, budgets: list[int]) -> None:
        """Refuse layer budgets this rule cannot run at (before any model work); the default accepts any."""

    def layer_budgets(self, budget: int, n_layers: int, prompt: int | None = None) -> list[int] | None:
        """Per-layer budgets for the `n_layers` budgeted layers (None = `budget` for all); must sum to
        `n_layers * budget`, so every rule holds the same memory. `prompt` is the prefill length when it is known
        as the cache is sized (None otherwise), for schedules that adapt to it."""
        return None

    def score(self, s: Signals) -> Tensor:
        raise NotImplementedError

    def protect(self, s: Signals) -> Tensor | None:
        return None

    def params(self) -> dict:
        """Hyperparameters, for result rows and error messages."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k != "name"}

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({inner})"


def recent(s: Signals, n_recent: int) -> Tensor:
    """Mask of the `n_recent` most recent positions seen so far (shared by rules that keep a recent window)."""
    return s.pos >= s.step - n_recent
