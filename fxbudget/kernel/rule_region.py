"""The rule region, the kernel's second phase: the only rule-specific ops (what `kernel_fingerprint` abstracts).
The rule's `score` and `protect`, then, on the head pool, the allocation step (`floor`)."""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import NoMutation, check_output
from ..rules.base import Absent, Rule, Signals
from .evict import _order_key, _top_indices
from .state import SIGNAL_NAMES


def rule_region(rule: Rule, budget: int, window: int, signals: dict[str, Tensor], floor: int | None = None) -> Tensor:
    """The only rule-specific ops: the final score of every candidate, from `measure`'s signals (a dict). The
    rule sees the observation `window` per row as `Signals.window`, counted over the call's real tokens only.

    Protected candidates score +inf and empty slots -inf, so selection needs nothing else from the rule.
    The rule must not write any tensor it is handed (refused, naming the op) and must return a floating score of
    exactly the candidates' shape (refused otherwise; `kernel.contract`). A NaN score (either sign) ranks lowest among
    real candidates, like -inf, and still above empty slots (ties go to the newer position; an empty slot is older than any token). Scores are
    cast to the signals' dtype (float32, float64 for float64 inputs) and ranked in float32 by `evict`: scores that
    differ only beyond float32's precision tie, and the newer candidate wins.

    `floor` (the head-pooled layout only, `fxbudget.pool`): the allocation step. Each head's best `floor` real
    candidates (in `evict`'s order) are raised to float32's largest finite value (protected ones stay +inf), so the
    pooled eviction's one top-k over every head of the layer keeps them before any other: `floor = budget` is
    uniform allocation, `AdaKV.floor(budget)` AdaKV's safeguard.
    """
    # The window as data, per row: how many of the call's real queries `window_attn` sums over. fxbudget's own
    # pads (a call padded to a shape bucket) then change nothing a rule sees (an int would be `min(window, bucket)`).
    new_pos = signals["new_pos"]
    rows = (new_pos >= 0).sum(-1).clamp(max=min(window, new_pos.shape[-1])).view(-1, 1, 1)
    h = signals["pos"].shape[1]
    # The head pool's slots come with one head: every head's rule sees them all (a view, not a copy).
    signals = {name: x.expand(x.shape[0], h, *x.shape[2:]) if name in ("k_slots", "v_slots") and x.shape[1] != h
               else x for name, x in signals.items()}
    # A signal outside the run's set is absent: reading it raises (`Signals`), it is never a zero.
    s = Signals(**{name: signals[name] if name in signals else Absent(name) for name in SIGNAL_NAMES},
                budget=budget, window=rows)
    with NoMutation(rule, tuple(signals.values())):
        score = rule.score(s)
        protect = rule.protect(s)
    check_output(rule, "the score", score, s.pos, floating=True)
    score = score.to(s.dtype)
    score = score.masked_fill(score.isnan(), float("-inf"))
    if protect is not None:
        check_output(rule, "protect()", protect, s.pos, floating=False)
        score = score.masked_fill(protect, float("inf"))
    score = score.masked_fill(s.pos < 0, float("-inf"))
    if floor:
        C = score.shape[-1]
        best = _top_indices(_order_key(score, s.pos, C)[0], min(floor, C), largest=True)
        top = torch.zeros_like(s.pos, dtype=torch.bool).scatter(-1, best, True) & (s.pos >= 0) & (score < float("inf"))
        score = score.masked_fill(top, torch.finfo(torch.float32).max)
    return score


