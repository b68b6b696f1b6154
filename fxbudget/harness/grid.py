"""The comparison grid (what `fxbudget compare` runs) and the row key of each of its results; no torch import.

A grid is rules x budgets x protocols on samples: the generated tasks x context lengths x `samples`, then the lines of
each user task file (at most `task_file_samples` of each). `Grid.validate` checks everything that can be checked
without a model (rule names and hyperparameters, protocols, budgets, the task files' lines); the lengths are
checked against each task's minimum when the samples are built (`runner.build_samples`, tokenizer only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from ..checks import byte_size, check_slot_dtype
from .tasks import SHARED_TASKS, TASKS, load_jsonl

PROTOCOLS = ("query-agnostic", "query-aware", "streaming", "multi-request", "multi-turn")
# The shared-context protocols (`shared_context.py`): several requests over one compressed context, one row per
# request (`turn`); they run only tasks whose samples ask several questions (`tasks.SHARED_TASKS`).
MULTI_PROTOCOLS = ("multi-request", "multi-turn")
REFERENCE = "full"  # the unmodified model
# How a layer's budget is spread over its KV heads, and the cache layout it needs (ADAKV.md): a head-adaptive rule
# (`adakv:<rule>`) runs on the pooled layout, and so does every other rule of its run (one kernel per run).
ALLOCATIONS = ("uniform", "adakv")
LAYOUTS = ("slots", "head-pool")


def allocation(rule) -> str:
    """`adakv` for a head-adaptive rule instance, else `uniform`."""
    return "adakv" if rule.head_adaptive else "uniform"


BUDGET_KINDS = ("tokens", "bytes", "percent")  # how a budget is written: 128, "256MiB", "12.5%" (one kind per run)


def budget_kind(spec: int | str) -> str:
    """Which of `BUDGET_KINDS` `spec` is. Raises `ValueError` (as `budget_fraction`) on anything else."""
    if byte_size(spec) is not None:
        return "bytes"
    return "tokens" if budget_fraction(spec) is None else "percent"


def budget_fraction(spec: int | str) -> float | None:
    """The fraction of a relative budget (`"12.5%"` -> 0.125), None for an absolute one (a positive int, or a size
    in bytes such as "256MiB": `byte_size`).

    Raises:
        ValueError: anything else, or a percentage outside (0, 100].
    """
    if byte_size(spec) is not None:  # raises on a malformed size
        return None
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ValueError(f"an absolute budget must be a positive int, got {spec}")
        return None
    if isinstance(spec, str) and spec.endswith("%"):
        try:
            pct = Fraction(spec[:-1])
        except ValueError:
            pct = None
        if pct is not None and 0 < pct <= 100:
            return float(pct / 100)
    raise ValueError(f"a budget is a positive int (KV entries), a size in bytes such as '256MiB' or a percentage "
                     f"in (0, 100] such as '12.5%', got {spec!r}")


def resolve_budget(spec: int | str, context_tokens: int, byte_tokens: dict | None = None) -> int:
    """The absolute budget of `spec` for a sample whose context has `context_tokens` tokens (floor, at least 1); a
    byte budget's tokens come from `byte_tokens` (spec -> tokens for the run's model: `cache.byte_budget`)."""
    kind = budget_kind(spec)
    if kind == "bytes":
        if byte_tokens is None or spec not in byte_tokens:
            raise ValueError(f"budget {spec}: a byte budget needs the model's entry size (byte_tokens)")
        return byte_tokens[spec]
    if kind == "tokens":
        return spec
    return max(1, math.floor(Fraction(spec[:-1]) / 100 * context_tokens))


@dataclass
class Grid:
    """What to run. `rules` may include "full" (the reference row, no budget); `rule_params` maps a rule name to
    its hyperparameters; `task_files` are user JSONL files run in addition to the generated `tasks` (which may be
    empty), at most `task_file_samples` lines of each (None: all); `budgets` are ints (absolute) or percentages of
    each sample's context such as "12.5%" (one kind per run); `protocols` run in one pass over the samples;
    `likelihood` adds the answer log-likelihood to every row."""

    tasks: list[str] = field(default_factory=lambda: ["passkey"])
    lengths: list[int] = field(default_factory=lambda: [2000])
    rules: list[str] = field(default_factory=lambda: ["full", "streamingllm", "h2o", "snapkv", "tova", "knorm"])
    budgets: list[int | str] = field(default_factory=lambda: [128, 256, 512, 1024])
    samples: int = 3
    seed: int = 0
    protocols: list[str] = field(default_factory=lambda: ["query-agnostic"])
    chunk_size: int | None = None
    backend: str | None = None  # None: fxbudget's eager kernel; or a Dynamo backend ("inductor", ...)
    share_prefill: bool = True
    rule_params: dict[str, dict] = field(default_factory=dict)
    task_files: list[str] = field(default_factory=list)
    likelihood: bool = True
    task_file_samples: int | None = None
    # Decode steps between evictions under the streaming protocol (kvpress DecodingPress's compression_interval,
    # its target_size the budget; `BudgetCache(interval=)`); 1: every call evicts. Other protocols ignore it.
    interval: int = 1
    # The kernel's signal set (a kernel setting, like the window): None measures what the run's rules read (the
    # union, `kernel.signal_set.run_signals`), "all" every signal (to pool the rows with other runs').
    signals: str | None = None
    # How the caches store keys and values (`checks.SLOT_DTYPES`; a kernel setting): "model" = the
    # model's dtype; "float8_e4m3fn", "int8" or "int4" quantized per entry and head.
    slot_dtype: str = "model"

    def validate(self) -> None:
        """Check the grid without a model.

        Raises:
            ValueError: a bad protocol, task, rule, hyperparameter, length, budget, sample count, backend or task
                file line (naming the file and line); each message says what is valid.
        """
        from ..compiler.backend import INNER_BACKENDS, kernel_window
        from ..rules import get

        unknown = [p for p in self.protocols if p not in PROTOCOLS]
        if unknown or not self.protocols:
            raise ValueError(f"unknown protocol {', '.join(map(repr, unknown)) or '(none given)'}; the protocols "
                             f"are {', '.join(PROTOCOLS)}")
        if len(set(self.protocols)) != len(self.protocols):
            raise ValueError(f"protocols must be distinct names, got {','.join(self.protocols)}")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"--interval must be an int >= 1 (decode steps between evictions), got {self.interval!r}")
        if self.interval > 1 and "streaming" not in self.protocols:
            raise ValueError(f"--interval {self.interval} sets how often the streaming protocol evicts while decoding; "
                             f"add --protocol streaming (got {','.join(self.protocols)})")
        if not self.tasks and not self.task_files:
            raise ValueError("nothing to run: give --tasks and/or --task-file")
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"unknown task {t!r}; known tasks: {', '.join(TASKS)}")
        check_rule_params(self.rules, self.rule_params)
        made = {r: get(r, **self.rule_params.get(r, {})) for r in self.rules if r != REFERENCE}  # raises, listing
        # A replay rule (kvzip) runs its own protocol, whose window is the whole replay call: it decides nothing in
        # the other rules' calls, so it is exempt from the shared window (its rows record it).
        replayed = [r for r, rule in made.items() if rule.replay_only]
        if replayed and set(self.protocols) - {"query-agnostic", "multi-request"}:
            raise ValueError(f"{', '.join(replayed)} runs its own replay protocol, a query-agnostic one: run it with "
                             f"--protocol query-agnostic (or multi-request: its compressed context answers every "
                             f"request) only, got {','.join(self.protocols)}")
        self._check_shared()
        windows = {r: kernel_window(rule) for r, rule in made.items() if r not in replayed}
        if len(set(windows.values())) > 1:
            # The window is a parameter of the shared kernel's measure phase: rules compare only at one window.
            raise ValueError("the rules of one comparison must share one observation window (it is part of the "
                             "shared kernel), got " + ", ".join(f"{r} {w}" for r, w in windows.items())
                             + "; run each window as its own comparison (e.g. --param snapkv.window=32)")
        if self.tasks and (not self.lengths or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                   for v in self.lengths)):
            raise ValueError(f"lengths must be positive ints, got {self.lengths!r}")
        if not self.budgets:
            raise ValueError("budgets must not be empty")
        check_slot_dtype(self.slot_dtype)
        kinds = {budget_kind(b) for b in self.budgets}  # raises on a malformed budget
        for r in self.rules:  # e.g. AdaKV: an absolute budget below the tokens its rule protects in every head
            if r != REFERENCE and kinds == {"tokens"}:
                get(r, **self.rule_params.get(r, {})).check_budget(list(self.budgets))
        if len(kinds) > 1:
            raise ValueError(f"budgets {self.budgets} mix {' and '.join(k for k in BUDGET_KINDS if k in kinds)} "
                             "(KV entries, bytes of cache, % of the context): use one kind per run (`fxbudget "
                             "report` merges runs)")
        if self.samples < 1 or (self.task_file_samples is not None and self.task_file_samples < 1):
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.backend is not None and self.backend not in INNER_BACKENDS:
            raise ValueError(f"backend must be one of {INNER_BACKENDS} or None, got {self.backend!r}")
        for f in self.task_files:
            if not Path(f).is_file():
                raise ValueError(f"task file {f} does not exist")
            load_jsonl(f)  # every line checked now, before a model loads (raises naming the file and line)

    def _check_shared(self) -> None:
        """A shared-context protocol needs tasks that ask several questions of one context: refuse the others, and
        task files (one question per line)."""
        multi = [p for p in self.protocols if p in MULTI_PROTOCOLS]
        if not multi:
            return
        single = [t for t in self.tasks if t not in SHARED_TASKS]
        if single or self.task_files:
            what = f"task {single[0]!r}" if single else f"task file {self.task_files[0]}"
            raise ValueError(f"--protocol {multi[0]} asks several questions of one context, and {what} asks one per "
                             f"sample: run it with the tasks that ask several ({', '.join(SHARED_TASKS)}), or "
                             "another protocol")

    def signal_set(self) -> frozenset[str]:
        """The run's signal set: what its budgeted rules read (each rule's dry run), or every signal ("all")."""
        from ..kernel.signal_set import run_signals
        from ..rules import get

        if self.signals not in (None, "all"):
            raise ValueError(f"--signals must be 'all' or left out (what the run's rules read), got {self.signals!r}")
        return run_signals([get(r, **self.rule_params.get(r, {})) for r in self.rules if r != REFERENCE],
                           self.signals)

    def head_pool(self) -> bool:
        """Whether this run's budgeted rules run on the pooled cache layout (`head-pool`): when any of them is
        head-adaptive, every one of them does, so the run has one kernel fingerprint. Call after `validate`."""
        from ..rules import get

        return any(allocation(get(r, **self.rule_params.get(r, {}))) != "uniform" for r in self.rules
                   if r != REFERENCE)

    def layout(self) -> str:
        """`head-pool` or `slots` (see `head_pool`)."""
        return LAYOUTS[self.head_pool()]

    @property
    def shares_prefill(self) -> bool:
        """Whether rules share one prefill per sample (on the eager kernel): it must be a single call."""
        return self.share_prefill and self.chunk_size is None


@dataclass(frozen=True)
class Unit:
    """One sample of one task at one length: every configuration of the grid runs on it."""

    task: str
    length: int | None  # None for user task files
    index: int


def units(grid: Grid) -> list[Unit]:
    """Every sample of the grid in a fixed order (the order `--shard` splits)."""
    out = [Unit(t, n, i) for t in grid.tasks for n in grid.lengths for i in range(grid.samples)]
    for f in grid.task_files:
        n = len(load_jsonl(f))
        out += [Unit(str(f), None, i) for i in range(n if grid.task_file_samples is None
                                                     else min(n, grid.task_file_samples))]
    return out


def configs(grid: Grid) -> list[tuple[str, str, int | str | None]]:
    """(protocol, rule, budget) triples; the reference row has no budget. A budget is as given (int or "12.5%")."""
    return [(p, r, None) if r == REFERENCE else (p, r, b) for p in grid.protocols for r in grid.rules
            for b in ([None] if r == REFERENCE else grid.budgets)]


def turns(task: str, protocol: str) -> int | None:
    """How many rows (requests, `turn` 1..k) one configuration writes for a sample of `task` under `protocol`: None
    (one row, no turn) except for the shared-context protocols."""
    return SHARED_TASKS[task] if protocol in MULTI_PROTOCOLS else None


def plan_rows(plan) -> int:
    """How many rows a plan (`Runner.plan()`: units and their pending configurations) writes: one per configuration,
    one per request for a shared-context protocol."""
    return sum(turns(unit.task, c[0]) or 1 for unit, todo in plan for c in todo)


def config_keys(model_name: str, grid: Grid, unit: Unit, protocol: str, rule: str,
                budget: int | str | None) -> list[str]:
    """The keys of the rows one configuration writes on `unit` (one per request under a shared-context protocol)."""
    k = turns(unit.task, protocol)
    return [row_key(model_name, grid, unit, protocol, rule, budget, turn=t)
            for t in ([None] if k is None else range(1, k + 1))]


def row_key(model_name: str, grid: Grid, unit: Unit, protocol: str, rule: str, budget: int | str | None,
            turn: int | None = None) -> str:
    """What identifies a result: completed keys are skipped when a run resumes. `turn`: the request of a
    shared-context protocol (1..k), None otherwise."""
    params = json.dumps(grid.rule_params.get(rule, {}), sort_keys=True)
    key = "|".join(map(str, (model_name, unit.task, unit.length, unit.index, grid.seed, rule, params, budget,
                             protocol, grid.chunk_size, grid.backend)))
    # A rule runs pooled beside a head-adaptive rule, unpooled otherwise: another kernel, another row. The suffix only
    # on pooled rows keeps the keys of earlier (unpooled) results, so their runs still resume.
    key = key + "|head-pool" if rule != REFERENCE and grid.head_pool() else key
    # Likewise a streaming row at a decode interval (the reference row too: it heads that setting's section).
    key = key + f"|interval{grid.interval}" if protocol == "streaming" and grid.interval > 1 else key
    # And quantized slots (every row of the run: its reference row heads that setting's columns).
    key = key + f"|slots-{grid.slot_dtype}" if grid.slot_dtype != "model" else key
    return key if turn is None else f"{key}|turn{turn}"



def check_rule_params(rules: list[str], params: dict[str, dict]) -> None:
    """Refuse hyperparameters for a rule that is not run, or that the rule does not have (listing the ones it has).

    Raises:
        ValueError: naming the rule, the field and the valid fields.
    """
    from ..rules import available, wrapper_prefixes

    for rule, values in params.items():
        names = rule_fields(rule)
        if names is None:
            raise ValueError(f"--param {rule}.*: unknown rule {rule!r}; known rules: {', '.join(available())}, "
                             f"and {', '.join(p + '<rule>' for p in wrapper_prefixes())} for any of them")
        if rule not in rules:
            raise ValueError(f"--param {rule}.*: {rule} is not among the rules run ({', '.join(rules)})")
        for name in values:
            if name not in names:
                raise ValueError(f"--param {rule}.{name}: {rule} has no hyperparameter {name!r}; its "
                                 f"hyperparameters: {', '.join(names) or 'none'}")


def rule_fields(rule: str) -> list[str] | None:
    """The hyperparameter names of a rule name, None if it names no rule (`fxbudget.rules.rule_fields`: a wrapper
    form such as `adakv:snapkv` has the wrapper's own, `alpha`, and the wrapped rule's)."""
    from ..rules import rule_fields as fields_of

    return fields_of(rule)
