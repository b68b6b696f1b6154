"""The shared budget-attention kernel: the fairness contract (DESIGN §4). Every rule runs exactly this code; only
the rule region (the rule's `score` and `protect`) differs.

One call, per batch row and KV head, with `S` slots and `n` new tokens (`C = S + n` candidates), in three phases
(`pipeline`, the only place they are put in order):
1. `measure` (`measure.py`, attention in `attention.py` eagerly and `block_scan.py` traced): exact softmax attention
   of the call's queries over the visible candidates, then the run's signal set (`signal_set.py`: what the run's
   rules read, or every signal) for every candidate, the same for every rule of the run.
2. the rule region (`rule_region.py`): `score = rule.score(signals)`; candidates in `rule.protect(signals)` score
   +inf, empty slots -inf; on the head pool, the allocation step.
3. `evict` (`evict.py`): the top `keep` candidates by score are kept (ties: newer position wins); surviving new tokens
   are written into freed slots; positions, the carried state and the per-token signals are updated.

The data is named once (`state.py`: `LayerSlots`, `NewTokens`, `LayerConstants`, which signals are totaled and
cached); the layouts (per-head slots, the head pool) are objects behind one protocol (`layouts.py`).

Adding a signal: a `Signals` field (`rules/base.py`, with `PER_CANDIDATE` metadata if it is one value per
candidate) and its computation in `measure.py`; a signal of a token alone (cached with its entry) is instead an
entry of `signals.TOKEN_SIGNALS` (docs/rules.md shows the recipe).

Beside the phases: the marker op that links an attention call to its cache slots (`marker.py`), what a rule may do
inside the kernel (`contract.py`), a rule's dry run against that contract (`probe.py`) and the run's signal set
from those dry runs (`signal_set.py`).

May import: `rules.base` (the rule interface, no rule), `checks`.
"""

from .contract import RuleContractError
from .evict import evict
from .layouts import HEAD_POOL, PER_HEAD, Layout, head_view, layout
from .measure import measure, signal_totals
from .pipeline import attend, budget_attention, evict_phase, measure_phase, rule_phase, select
from .rule_region import rule_region
from .settings import DEFAULT_BLOCK, DEFAULT_WINDOW, auto_block, check_block
from .state import (MARKER_TENSORS, SIGNAL_NAMES, SLOT_FIELDS, TOTALED, LayerConstants, LayerSlots, NewTokens,
                    from_marker, marker_tensors)

__all__ = [
    "DEFAULT_BLOCK", "DEFAULT_WINDOW", "HEAD_POOL", "MARKER_TENSORS", "PER_HEAD", "SIGNAL_NAMES", "SLOT_FIELDS",
    "TOTALED", "LayerConstants", "LayerSlots", "Layout", "NewTokens", "RuleContractError", "attend", "auto_block",
    "budget_attention", "check_block", "evict", "evict_phase", "from_marker", "head_view", "layout", "marker_tensors",
    "measure", "measure_phase", "rule_phase", "rule_region", "select", "signal_totals",
]
