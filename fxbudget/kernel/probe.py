"""A rule's dry run on a tiny probe: its `score` (and `protect`) called once on small random `Signals` of the right
shapes, before a run, so that a rule that reads a signal the kernel does not measure, returns the wrong shape or
fails is refused in one line naming the rule, instead of failing inside the compiled kernel minutes later.

The probe also says which signals a rule reads (`signals_read`): a rule that reads the observation window's
attention (`window_attn`, `last_attn`, `window_max_attn`) chooses with the latest queries of each call, which its
paper fills with the question (SnapKV, TOVA); `reads_observation_window` is what the protocol note of a run and a
report is built on (`fxbudget.harness.protocol_note`).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import traceback
from pathlib import Path

import torch
from torch import Tensor

from ..checks import nearest
from .contract import NoMutation, RuleContractError, check_output, rule_name
from ..rules.base import Rule, Signals

# The signals measured from the observation window (the last `window` queries of a call, or its last query).
OBSERVATION_WINDOW_SIGNALS = ("window_attn", "last_attn", "window_max_attn")


class RuleProbeError(ValueError):
    """A rule failed its dry run: the message is one line naming the rule and what is wrong."""


def signal_names() -> list[str]:
    """Every name a rule may read on `Signals`: its fields, properties and methods (public ones)."""
    fields = [f.name for f in dataclasses.fields(Signals)]
    members = [n for n, _ in inspect.getmembers(Signals) if not n.startswith("_") and n not in fields]
    return fields + sorted(members)


class _UnknownSignal(AttributeError):
    def __init__(self, name: str):
        super().__init__(name)
        self.signal = name


class _Recording(Signals):
    """`Signals` that remembers which names a rule read (in its class's `_read`, so that a copy a rule makes with
    `dataclasses.replace` records into the same set), and refuses a name it does not have."""

    _read: set

    def __getattribute__(self, name):
        # `dataclasses.replace` (a rule's modified copy) reads every field: not a read of the rule's.
        if not name.startswith("_") and sys._getframe(1).f_code.co_filename != dataclasses.__file__:
            type(self)._read.add(name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name):  # only for names the class does not have
        if name.startswith("_"):
            raise AttributeError(name)
        raise _UnknownSignal(name)


# The per-candidate fields `probe_signals` draws by name (with their own ranges).
_LISTED = ("attn", "window_attn", "last_attn", "acc_attn", "key_norm", "value_norm", "pos", "window_max_attn",
           "wov_norm")


def probe_signals(*, batch: int = 1, kv_heads: int = 2, group: int = 2, slots: int = 6, new: int = 4,
                  head_dim: int = 8, seed: int = 0) -> Signals:
    """Small random `Signals` of the kernel's shapes: `slots` cached candidates (positions 0..slots-1) followed by
    `new` tokens of this call, every signal finite (attention masses positive, `inv_freq` the default RoPE's)."""
    g = torch.Generator().manual_seed(seed)
    c = slots + new

    def rand(*shape):
        return torch.rand(*shape, generator=g) + 0.01

    pos = torch.arange(c).expand(batch, kv_heads, c).contiguous()
    recording = type("ProbeSignals", (_Recording,), {"_read": set()})
    # A per-candidate signal added since (a new `TOKEN_SIGNALS` entry and its field): random, as the others.
    added = {f.name: rand(batch, kv_heads, c) for f in dataclasses.fields(Signals)
             if f.metadata.get("per_candidate") and f.name not in _LISTED}
    return recording(**added,
        attn=rand(batch, kv_heads, c), window_attn=rand(batch, kv_heads, c), last_attn=rand(batch, kv_heads, c),
        acc_attn=rand(batch, kv_heads, c), key_norm=rand(batch, kv_heads, c), value_norm=rand(batch, kv_heads, c),
        pos=pos, queries=torch.randn(batch, kv_heads, group * new, head_dim, generator=g),
        k_slots=torch.randn(batch, kv_heads, slots, head_dim, generator=g),
        k_new=torch.randn(batch, kv_heads, new, head_dim, generator=g),
        new_pos=torch.arange(slots, c).expand(batch, new).contiguous(),
        inv_freq=1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)),
        v_slots=torch.randn(batch, kv_heads, slots, head_dim, generator=g),
        v_new=torch.randn(batch, kv_heads, new, head_dim, generator=g),
        window_max_attn=rand(batch, kv_heads, c) / 2, wov_norm=rand(batch, kv_heads, c), budget=slots,
        window=torch.full((batch, 1, 1), min(new, 2), dtype=torch.long))


def _where(e: BaseException) -> str:
    """` (file:line)` of the last frame that raised `e` in the rule's code (not torch's, not this probe's), "" if
    none."""
    skip = (str(Path(torch.__file__).parent), str(Path(__file__)), str(Path(__file__).with_name("contract.py")))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def signals_read(rule: Rule) -> frozenset[str]:
    """The `Signals` names `rule`'s `score` and `protect` read on the probe (its dry run).

    Raises:
        RuleProbeError: the rule reads a name `Signals` does not have (naming it and the valid ones), returns the
            wrong shape or dtype, writes a signal in place, or raises.
    """
    name = rule_name(rule)
    s = probe_signals()
    tensors = tuple(v for v in vars(s).values() if isinstance(v, Tensor))
    like = s.pos
    try:
        with torch.no_grad(), NoMutation(rule, tensors):
            score = rule.score(s)
            check_output(rule, "the score", score, like, floating=True)
            protect = rule.protect(s)
            if protect is not None:
                check_output(rule, "protect()", protect, like, floating=False)
    except _UnknownSignal as e:
        near = nearest(e.signal, signal_names(), cutoff=0.5)
        hint = f" (did you mean s.{near}?)" if near else ""
        raise RuleProbeError(f"rule {name!r} reads s.{e.signal}{_where(e)}, which the kernel does not measure{hint}; "
                             f"the signals are: {', '.join(signal_names())}") from None
    except RuleContractError as e:
        raise RuleProbeError(f"{e} (found by a dry run of its score on a probe, before the run)") from None
    except NotImplementedError as e:
        raise RuleProbeError(f"rule {name!r} does not define score(self, s) -> Tensor{_where(e)}") from None
    except Exception as e:  # the rule's own code failed on valid signals
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuleProbeError(f"rule {name!r}: its score fails on a probe of random signals of the kernel's shapes: "
                             f"{type(e).__name__}: {first}{_where(e)}") from None
    return frozenset(type(s)._read)


def reads_observation_window(rule: Rule) -> bool:
    """Whether `rule` chooses with the observation window's attention (the latest queries of each call)."""
    return bool(signals_read(rule) & set(OBSERVATION_WINDOW_SIGNALS))
