"""`weighted`: a weighted sum of the kernel's normalized signals, the parametric family `fxbudget search` fits.

No paper: a family that contains several published rules as points, so a search over it starts from them.
Per candidate, with every feature normalized per batch row and KV head over the valid candidates only (`z`: minus
the mean, over the standard deviation; empty slots and pads, `pos < 0`, take no part in the statistics):

    score = w_attn * z(log attn) + w_window_attn * z(log window_attn) + w_last_attn * z(log last_attn)
          + w_acc_attn * z(log acc_attn) + w_key_norm * z(key_norm) + w_value_norm * z(value_norm)
          + w_recency * z(-log(step - pos)) + w_mean_attn * z(log mean_attn) + w_key_diff * z(key_diff)
          + w_window_max_attn * z(log window_max_attn) + w_wov_norm * z(wov_norm)

then, if `pool > 1`, max-pooled over `pool` neighbouring positions in sequence order (snapkv's pooling, applied to
the whole score); `mean_attn` is `observed_attention`'s score (attention over the number of the call's queries that
see the candidate) and `key_diff` `keydiff`'s (minus the cosine to the mean normalized key); `window_max_attn` and
`wov_norm` are the kernel's signals that defensivekv reads (a nonzero `w_wov_norm` needs the model's W_o, as
defensivekv does; a zero weight's feature is never computed into the score, so models without W_o run the rest); the
first `n_sink`
positions and the `n_recent` most recent ones are always kept. Attention
signals enter as logs: they span orders of magnitude (a sink takes most of the mass), and a z-score of the raw values
would be the sink's alone. Weights have no scale (the ranking ignores a positive factor); a feature constant over a
head contributes 0. Points of the family equal to built-in rules (`BUILTIN_POINTS`; same kept tokens in a one-call
prefill of at least `window` tokens, up to float ties): snapkv, tova, knorm, h2o, streamingllm, window,
observed_attention, keydiff.
The observation window is the kernel default (a run compares rules at one window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_int
from .registry import register
from .base import Rule, Signals, recent
from .keydiff import KeyDiff
from .observed_attention import ObservedAttention

WEIGHTS = ("w_attn", "w_window_attn", "w_last_attn", "w_acc_attn", "w_key_norm", "w_value_norm", "w_recency",
           "w_mean_attn", "w_key_diff", "w_window_max_attn", "w_wov_norm")
# Signals that enter as logs; the kernel's signals first, then `mean_attn` (observed_attention's score).
_LOG = ("attn", "window_attn", "last_attn", "acc_attn", "window_max_attn", "mean_attn")


def builtin_points(budget: int, window: int = 32) -> dict[str, dict]:
    """The family's parameters equal to built-in rules at their defaults (the kernel's default `window`).

    Args:
        budget: the budget of the run (h2o protects `budget // 2` recent tokens).
        window: the observation window (snapkv protects it).
    Returns:
        `{rule name: Weighted parameters}` (unset weights 0, `pool` 1, no protection).
    """
    points = {"snapkv": {"w_window_attn": 1.0, "pool": 7, "n_recent": window},
              "tova": {"w_last_attn": 1.0},
              "knorm": {"w_key_norm": -1.0},
              "h2o": {"w_acc_attn": 1.0, "n_recent": int(budget * 0.5)},
              "streamingllm": {"w_recency": 1.0, "n_sink": 4},
              "window": {"w_recency": 1.0},
              "observed_attention": {"w_mean_attn": 1.0},
              "keydiff": {"w_key_diff": 1.0}}
    return {name: {**{w: 0.0 for w in WEIGHTS}, "n_sink": 0, "n_recent": 0, "pool": 1, **p}
            for name, p in points.items()}


def _z(x: Tensor, valid: Tensor, count: Tensor) -> Tensor:
    """`x` standardized over the valid candidates of each row and head; 0 elsewhere and where `x` is constant."""
    x = torch.where(valid, x, 0.0)
    d = torch.where(valid, x - x.sum(-1, keepdim=True) / count, 0.0)
    std = (d.square().sum(-1, keepdim=True) / count).sqrt()
    return d / std.clamp_min(1e-6)


@register("weighted")
@dataclass
class Weighted(Rule):
    """Defaults: the family's point equal to snapkv (window attention, max-pooled over 7, the window kept)."""

    w_attn: float = 0.0
    w_window_attn: float = 1.0
    w_last_attn: float = 0.0
    w_acc_attn: float = 0.0
    w_key_norm: float = 0.0
    w_value_norm: float = 0.0
    w_recency: float = 0.0
    w_mean_attn: float = 0.0
    w_key_diff: float = 0.0
    w_window_max_attn: float = 0.0
    w_wov_norm: float = 0.0
    n_sink: int = 0
    n_recent: int = 32
    pool: int = 7

    def __post_init__(self):
        for name in ("n_sink", "n_recent"):
            check_int(f"{self.name} {name}", getattr(self, name), 0)
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"{self.name} pool must be a positive odd int, got {self.pool!r}")

    @property
    def needs_wo(self) -> bool:
        """Only a nonzero `w_wov_norm` reads W_o (wov_norm is NaN where the model's W_o is unknown)."""
        return bool(self.w_wov_norm)

    def features(self, s: Signals, names: tuple[str, ...] = WEIGHTS) -> dict[str, Tensor]:
        """The normalized features `names` (weight names; default all), by weight name (`z` of each term of the
        formula). Only those asked for are computed, so a rule reads only the signals of its nonzero weights (the
        run's kernel measures what its rules read: `fxbudget.kernel.signal_set`)."""
        valid = s.pos >= 0
        count = valid.sum(-1, keepdim=True).clamp_min(1)
        dt = s.dtype
        tiny = torch.finfo(dt).tiny
        terms = {**{f"w_{n}": (lambda n=n: torch.log(getattr(s, n).clamp_min(tiny))) for n in _LOG[:-1]},
                 "w_mean_attn": lambda: torch.log(ObservedAttention().score(s).clamp_min(tiny)),
                 "w_key_diff": lambda: KeyDiff().score(s),
                 "w_key_norm": lambda: s.key_norm, "w_value_norm": lambda: s.value_norm,
                 "w_wov_norm": lambda: s.wov_norm,
                 "w_recency": lambda: -torch.log((s.step - s.pos).clamp_min(1).to(dt))}
        return {name: _z(terms[name]().to(dt), valid, count) for name in names}

    def score(self, s: Signals) -> Tensor:
        # Zero weights are left out, not multiplied: 0 * NaN (wov_norm without W_o) would poison the score, and a
        # signal of a zero weight is not read (nor measured).
        used = tuple(w for w in WEIGHTS if getattr(self, w))
        feats = self.features(s, used)
        score = sum((getattr(self, w) * feats[w] for w in used), torch.zeros_like(s.pos, dtype=s.dtype))
        if self.pool == 1:
            return score
        # Empty slots and pads must not lend their score to a neighbour: -inf before the max pool.
        x = s.in_sequence_order(score.masked_fill(s.pos < 0, float("-inf")))
        b, h, c = x.shape
        x = F.max_pool1d(x.reshape(b * h, 1, c), self.pool, stride=1, padding=self.pool // 2).view(b, h, c)
        return s.from_sequence_order(x)

    def protect(self, s: Signals) -> Tensor | None:
        keep = (s.pos >= 0) & (s.pos < self.n_sink)
        return keep | recent(s, self.n_recent) if self.n_recent else keep

    def protected_per_head(self, budget: int) -> int:
        return self.n_sink + self.n_recent  # the sinks and the recent window

    def formula(self) -> str:
        """The score with this rule's values, as text (zero weights left out)."""
        terms = [f"{getattr(self, w):+.4g} * z({'log ' if w[2:] in _LOG else ''}{w[2:]})"
                 for w in WEIGHTS if getattr(self, w)]
        text = " ".join(terms).replace("z(recency)", "z(-log age)") or "0"
        text = f"score = {text.lstrip('+')}"
        if self.pool > 1:
            text += f", max-pooled over {self.pool} positions"
        kept = ([f"the first {self.n_sink}"] if self.n_sink else []) + \
            ([f"the last {self.n_recent}"] if self.n_recent else [])
        return text + (f"; always kept: {' and '.join(kept)} positions" if kept else "")
