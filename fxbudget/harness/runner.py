"""The comparison grid: rules x budgets x tasks x context lengths on one model, one JSONL row per sample.

Protocols (DESIGN §6), a column of every row and never mixed (a run may hold several: `Grid.protocols`):
- `query-agnostic` (default): the context is prefilled with eviction down to the budget; the question and the answer
  are then appended with eviction frozen (head-room allocated up front). The rule never sees the question.
- `query-aware`: context and question are prefilled together with eviction; the answer is appended frozen.
- `streaming`: eviction on every call, the question and every decode step included; memory is the budget throughout.
  At a decode interval k > 1 (`Grid.interval`, kvpress's DecodingPress): decode steps evict every k-th step only and
  the cache grows by up to k - 1 entries beyond the budget in between (`BudgetCache(interval=)`; the rows say
  `decode_interval`, the report states the growth).

The rule `full` is the reference row: the unmodified model with transformers' own cache, no fxbudget in the path.

When the prefill is one call (no chunking), it is computed once per sample on the eager kernel and the cache is
branched per rule and budget (`fxbudget.harness.branch`, bit-identical to separate runs, tested); with a compiled
`backend` only the calls after it (question, answer) run compiled. Protocols that prefill the same tokens share it:
the context for query-agnostic and streaming, context + question for query-aware. The reference row does not depend
on the protocol: it runs once per sample and is written once per protocol.

Compiled forwards are built once per (rule, budget) and serve every sample of the run: the head-room is the run's
largest and every question is padded to one length (`BudgetForward.buckets`), so every sample's calls have the same
shapes. Frozen calls (the question and answer of query-agnostic, the answer of query-aware) do not depend on the
rule (`BudgetForward.share_frozen`): one compiled runner per observation window and budget serves every rule, so
their graphs are compiled once per budget.

Budgets are absolute (`128`: KV entries per layer and KV head) or relative (`"12.5%"`: that fraction of each sample's
context tokens, i.e. the prompt before the question, chat-template header included; floored as kvpress does); one
kind per run. Every row also records the teacher-forced log-likelihood of the gold answer (`likelihood.py`).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..api import BudgetForward, frozen_runner, kernel_fingerprint
from ..api import compile as fx_compile
from ..compiler.backend import kernel_window
from ..cache.byte_budget import model_tokens_for_bytes
from ..cache.keyword import output_cache
from ..fairness.fingerprint_store import cached_kernel_fingerprint
from ..kernel.settings import signals_label
from .kvzip_protocol import compress, replay_ids, template_parts
from ..rules import get
from . import interrupt, results
from .branch import branch, shared_prefill
# The grid lives in `grid` (no torch import: the CLI checks it before loading anything); re-exported here, where
# callers have always found it.
from ..checks import byte_size
from .grid import (MULTI_PROTOCOLS, PROTOCOLS, REFERENCE, Grid, Unit, allocation, budget_fraction, budget_kind,
                   config_keys,
                   configs, plan_rows, resolve_budget, row_key, turns, units)
from .likelihood import answer_logprobs, finish_prompt, frozen_tokens
from .measure import Clock, Peak, environment, eos_ids, greedy, kv_bytes
from . import shared_context
from .tasks import Sample, answer_ids, chat_ids, load_jsonl, make_samples, score

__all__ = ["PROTOCOLS", "REFERENCE", "Grid", "Runner", "Unit", "budget_fraction", "build_samples", "cache_shapes",
           "configs", "environment", "resolve_budget", "row_key", "units"]


def build_samples(grid: Grid, tokenizer, plan=None) -> dict:
    """The samples of the grid's units (of `plan`'s, if given), built with the tokenizer alone: the lengths are
    checked against each task's minimum here, before a model loads.

    Args:
        grid: a validated grid.
        tokenizer: the model's tokenizer.
        plan: `Runner.plan()` (None: every unit of the grid).
    Returns:
        The sample cache a `Runner` takes (`samples=`): (task, length) -> samples, task file -> samples.
    Raises:
        ValueError: "TASK at N tokens: ..." for a length below the task's minimum.
    """
    cache: dict = {}
    for unit in (units(grid) if plan is None else [u for u, _ in plan]):
        try:
            _load_sample(grid, unit, tokenizer, cache)
        except ValueError as e:
            raise ValueError(f"{unit.task} at {unit.length} tokens: {e}") from None
    return cache


def _load_sample(grid: Grid, unit: Unit, tokenizer, cache: dict) -> Sample:
    if unit.length is None:
        if unit.task not in cache:
            cache[unit.task] = load_jsonl(unit.task, tokenizer)
        return cache[unit.task][unit.index]
    key = (unit.task, unit.length)
    if key not in cache:  # the samples of a (task, length) are generated together (their depths are spread)
        cache[key] = make_samples(unit.task, tokenizer, unit.length, grid.samples, seed=grid.seed)
    return cache[key][unit.index]


def cache_shapes(grid: Grid, plan, tokenizer, samples: dict, max_new_tokens: int | None = None) -> tuple[int, int]:
    """The head-room a run of `plan` allocates (slots for what is appended with eviction frozen, the largest over
    the plan, rounded up to 64) and its question length bucket (the longest question rounded up to 16); known from
    the samples alone, so the CLI can say what a cache costs before the model loads.

    Args:
        grid: the run's grid. plan: `Runner.plan()`. tokenizer: the model's.
        samples: the sample cache (`build_samples`; samples missing from it are built into it).
        max_new_tokens: the run's answer length override (None: each sample's own).
    Raises:
        ValueError: a decode interval (`grid.interval`) longer than a streaming sample's generation: its decode
            would never evict.
    """
    headroom = question_bucket = 0
    for unit, todo in plan:
        sample = _load_sample(grid, unit, tokenizer, samples)
        q = chat_ids(tokenizer, sample)[1].shape[1]
        max_new = max_new_tokens or sample.max_new_tokens
        if grid.interval > max_new and "streaming" in {c[0] for c in todo}:
            raise ValueError(f"--interval {grid.interval} is larger than the generation ({max_new} new tokens, "
                             f"{unit.task}): its decode would never evict; give --interval <= {max_new} (or a larger "
                             "--max-new-tokens)")
        m = answer_ids(tokenizer, sample).shape[1] if grid.likelihood else None
        for protocol in {c[0] for c in todo}:
            if protocol in MULTI_PROTOCOLS:  # every request's frozen tokens, and its call's length
                for turn, calls in _turn_calls(tokenizer, sample, protocol, max_new_tokens):
                    headroom = max(headroom, shared_context.frozen_tokens(protocol, turn, grid.likelihood))
                    question_bucket = max(question_bucket, calls)
                continue
            frozen = {"query-agnostic": q + max_new, "query-aware": max_new, "streaming": 0}[protocol]
            if m is not None:
                frozen = max(frozen, frozen_tokens(protocol, q, m))
            headroom = max(headroom, frozen)
        question_bucket = max(question_bucket, q)
    return math.ceil(headroom / 64) * 64, math.ceil(question_bucket / 16) * 16


def _turn_calls(tokenizer, sample, protocol: str, max_new_tokens: int | None):
    """`(Turn, tokens its call appends)` of each request of a shared-context sample (multi-turn's calls carry the
    previous turn's gold answer)."""
    _, ts = shared_context.turns(tokenizer, sample, protocol, max_new_tokens)
    previous = [0] + [t.answer.shape[1] for t in ts[:-1]]
    return [(t, t.prompt.shape[1] + (p if protocol == "multi-turn" else 0)) for t, p in zip(ts, previous)]


def _spec_fields(spec) -> dict:
    """A row's record of how its budget was written: the fraction of a relative one, the bytes of a byte budget (its
    tokens are the row's `budget`); None for the reference row."""
    return {"budget_fraction": None if spec is None else budget_fraction(spec),
            "budget_bytes": None if spec is None else byte_size(spec)}


class Runner:
    """Runs a `Grid` on one model and appends rows to `out_dir/results*.jsonl` (resumable, shardable).

    `model=None` gives a runner that only plans and writes (the driver of `fxbudget.harness.ray_runner`, whose
    workers run the units with `unit_rows`)."""

    def __init__(self, model: nn.Module | None, tokenizer, model_name: str, grid: Grid, out_dir: str | Path, *,
                 shard: tuple[int, int] = (0, 1), progress: bool = True, max_new_tokens: int | None = None,
                 samples: dict | None = None):
        grid.validate()
        i, n = shard
        if not (n >= 1 and 0 <= i < n):
            raise ValueError(f"shard must be i/n with 0 <= i < n, got {i}/{n}")
        self.model, self.tok, self.model_name, self.grid = model, tokenizer, model_name, grid
        self.out_dir, self.shard, self.progress, self.max_new = Path(out_dir), shard, progress, max_new_tokens
        self.path = self.out_dir / ("results.jsonl" if n == 1 else f"results-shard{i}of{n}.jsonl")
        self.env = environment(model) if model is not None else {}
        # Any head-adaptive rule puts every rule of the run on the pooled layout (one kernel fingerprint per run).
        self.layout = grid.layout()
        self._pool = {"head_pool": True} if self.layout == "head-pool" else {}
        # One signal set for every rule of the run (a kernel setting, like the window): one kernel, one fingerprint.
        self.signals = grid.signal_set()
        self.signals_label = signals_label(self.signals)
        self.eos = eos_ids(model, tokenizer) if model is not None else set()
        self._fingerprints: dict[str, str] = {}
        self._byte_tokens: dict[str, int] = {}  # byte budget -> its tokens for this model (`_tokens`)
        self.fingerprint_cached: dict[str, bool] = {}  # rule -> read from disk, not traced (`fairness.fingerprint_store`)
        self._samples: dict = dict(samples or {})  # from build_samples, or built as the units run
        self._forwards: dict[tuple, BudgetForward] = {}  # (rule, params, budget) -> forward, reused across samples
        # (window, budget, block) -> compiled runner of frozen calls shared by every rule, and the graphs it compiled
        self._frozen: dict[tuple, tuple[object, list]] = {}
        # The same cache and question shapes for every sample (set by run() from the plan).
        self.headroom, self.question_bucket = 0, 0
        self.max_context = 0  # the plan's longest context: replay rules hold it all before compressing
        self.compile_s = self.run_s = 0.0
        self.fingerprint_s = 0.0  # tracing the kernel fingerprints (outside compile_s and run_s)

    def done_keys(self) -> set[str]:
        """Keys of the complete rows in `out_dir` (every shard's file): a row cut short by a kill is not done."""
        return {row["key"] for path in self.out_dir.glob("results*.jsonl") for row in results.read_rows(path)}

    def plan(self) -> list[tuple[Unit, list[tuple[str, str, int | str | None]]]]:
        """This shard's samples and, for each, the configurations not yet in the results."""
        done, (i, n) = self.done_keys(), self.shard
        plan = []
        for unit in units(self.grid)[i::n]:
            todo = [c for c in configs(self.grid)
                    if not all(k in done for k in config_keys(self.model_name, self.grid, unit, *c))]
            if todo:
                plan.append((unit, todo))
        return plan

    def prepare(self, **run_info) -> list[tuple[Unit, list[tuple[str, str, int | str | None]]]]:
        """Before a run writes: create `out_dir`, write `run.json` (the grid, this environment, `run_info`), make the
        results file safe to append to; returns `plan()`."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "run.json").write_text(json.dumps(
            {"model": self.model_name, "grid": asdict(self.grid), "shard": list(self.shard), **self.env, **run_info},
            indent=1, default=str))
        results.repair(self.path)  # a run killed mid-write left a cut last line: never append a row onto it
        return self.plan()

    def run(self) -> list[dict]:
        """Run every pending row; returns the rows written by this call."""
        from tqdm.auto import tqdm

        plan = self.prepare()
        self.headroom, self.question_bucket = self._shapes(plan)
        self.max_context = self._max_context(plan)
        bar = tqdm(total=plan_rows(plan), unit="row", disable=not self.progress,
                   dynamic_ncols=True)
        rows = []
        try:
            with torch.no_grad(), self.path.open("a") as f:
                for unit, todo in plan:
                    for row in self._run_unit(unit, todo, bar):
                        results.append_row(f, row)
                        rows.append(row)
                        bar.update(1)
                        bar.set_postfix_str(f"compile {self.compile_s:.0f}s, run {self.run_s:.0f}s")
                        interrupt.checkpoint("row")  # a Ctrl-C during the row stops here, the row saved
        finally:
            bar.close()
        return rows

    @torch.no_grad()
    def unit_rows(self, unit: Unit, todo: list[tuple[str, str, int | str | None]]) -> Iterator[dict]:
        """The rows of one unit for the configurations `todo`, in order, as each finishes; nothing is written (a
        distributed worker hands them to the driver, the only writer).

        Args:
            unit: a sample of this runner's grid (from `plan()`).
            todo: its `(protocol, rule, budget)` configurations to run.
        Returns:
            An iterator of complete rows (the same rows `run()` writes).
        """
        from tqdm.auto import tqdm

        if not self.headroom:  # a worker: the shapes of the whole grid, the same on every worker
            everything = [(u, configs(self.grid)) for u in units(self.grid)]
            self.headroom, self.question_bucket = self._shapes(everything)
            self.max_context = self._max_context(everything)
        yield from self._run_unit(unit, todo, tqdm(disable=True))

    def _shapes(self, plan) -> tuple[int, int]:
        """The run's head-room and question length bucket (`cache_shapes`)."""
        return cache_shapes(self.grid, plan, self.tok, self._samples, self.max_new)

    def _max_context(self, plan) -> int:
        """The longest context of the plan's samples (tokens)."""
        return max((chat_ids(self.tok, _load_sample(self.grid, u, self.tok, self._samples))[0].shape[1]
                    for u, _ in plan), default=0)

    def _forward(self, rule, budget: int) -> BudgetForward:
        """The model with `rule` and `budget` installed; built (and compiled, lazily) once per run."""
        g = self.grid
        key = (rule.name, json.dumps(rule.params(), sort_keys=True, default=str), budget)
        forward = self._forwards.get(key)
        if forward is not None:
            forward.install()
            return forward
        fx_compile(self.model, rule=rule, budget=budget, chunk_size=g.chunk_size, backend=g.backend,
                   headroom=self.headroom, signals=self.signals, progress=False, slot_dtype=g.slot_dtype, **self._pool)
        forward = self._forwards[key] = self.model.forward
        if g.backend is not None:
            forward.buckets = tuple(sorted({self.question_bucket, g.chunk_size} - {None, 0}))
            forward.share_frozen(self._frozen_for(forward)[0])
        return forward

    def _frozen_for(self, forward: BudgetForward) -> tuple[object, list]:
        """The compiled runner of frozen calls for `forward`'s window and budget, and the graphs it compiled."""
        key = (forward.window, forward.budget, forward.block)
        if key not in self._frozen:
            graphs: list = []
            self._frozen[key] = frozen_runner(self.model, self.grid.backend, forward.window, block=forward.block,
                                              on_graph=graphs.append, measure=forward.measure), graphs  # the cache
            # says its layout; the forward's measure phase (its form and the run's signal set)
        return self._frozen[key]

    def _tokens(self, spec, context_tokens: int) -> int:
        """The token budget of `spec` for a context of `context_tokens`: a byte budget's from the model's entry size
        at its dtype and the run's layout (`cache.byte_budget`), the same for every sample."""
        if budget_kind(spec) == "bytes" and spec not in self._byte_tokens:
            self._byte_tokens[spec] = model_tokens_for_bytes(spec, self.model, head_pool=self.layout == "head-pool",
                                                             slot_dtype=self.grid.slot_dtype)
        return resolve_budget(spec, context_tokens, self._byte_tokens)

    def _fingerprint(self, rule) -> str:
        """The kernel fingerprint of the rewritten graph (rule ops masked out): one per rule per run."""
        if rule.name not in self._fingerprints:
            interrupt.checkpoint("fingerprint")
            # Sizes are not part of the fingerprint: any budget gives the same one (relative budgets: 1024).
            budget = max((b for b in self.grid.budgets if budget_kind(b) == "tokens"), default=1024)
            with Clock() as clock:  # inspect's probe, traced once per model, rule, code and versions (on disk)
                self._fingerprints[rule.name], self.fingerprint_cached[rule.name] = cached_kernel_fingerprint(
                    self.model, rule, budget=budget, compute=kernel_fingerprint, signals=self.signals,
                    slot_dtype=self.grid.slot_dtype, **self._pool)
            self.fingerprint_s += clock.run + clock.compile
            interrupt.checkpoint("fingerprinted")  # between the fingerprint and the compile
        return self._fingerprints[rule.name]

    def _run_unit(self, unit: Unit, todo, bar):
        g, model = self.grid, self.model
        sample = _load_sample(g, unit, self.tok, self._samples)
        device = next(model.parameters()).device
        ctx, question = (x.to(device) for x in chat_ids(self.tok, sample))
        answer = answer_ids(self.tok, sample).to(device) if g.likelihood else None
        max_new = self.max_new or sample.max_new_tokens
        base = {"model": self.model_name, "task": sample.task, "length": unit.length, "sample": unit.index,
                "seed": sample.seed, "n_tokens": sample.n_tokens, "prompt_tokens": ctx.shape[1] + question.shape[1],
                "context_tokens": ctx.shape[1], "question_tokens": question.shape[1],
                "answer_tokens": None if answer is None else answer.shape[1],
                "depth": sample.depth, "answers": sample.answers, "chunk_size": g.chunk_size,
                "backend": g.backend or "none", "slot_dtype": g.slot_dtype, **self.env}
        bar.set_description(f"{sample.task[:24]} {unit.length or ''} #{unit.index}")
        reference = None  # the unmodified model ignores the protocol: one run per sample, one row per protocol
        # One prefill per distinct prefilled sequence: the context (query-agnostic, streaming) or context + question.
        for aware in (False, True):
            group = [c for c in todo if (c[0] == "query-aware") == aware]
            if not group:
                continue
            prefill_ids = torch.cat([ctx, question], dim=1) if aware else ctx
            shared, shared_s, shared_peak = None, None, None
            if g.shares_prefill and any(rule != REFERENCE and not get(rule).replay_only
                                        for _, rule, _ in group):
                peak = Peak(prefill_ids.device)
                with Clock() as c:
                    shared = shared_prefill(model, prefill_ids, slot_dtype=g.slot_dtype)
                shared_s, shared_peak = c.run, peak.read()
                self.run_s += c.run
            for protocol, rule_name, spec in group:
                if protocol in MULTI_PROTOCOLS:  # one row per request
                    yield from self._shared_rows(unit, sample, base, protocol, rule_name, spec, ctx, shared, shared_s,
                                                 shared_peak)
                    continue
                if rule_name == REFERENCE:
                    reference = reference or self._reference(ctx, question, answer, max_new)
                    row = dict(reference)
                else:
                    row = self._budgeted(protocol, rule_name, self._tokens(spec, ctx.shape[1]), prefill_ids,
                                         question, answer, max_new, shared, shared_s)
                row["shared_prefill_peak_mem_bytes"] = shared_peak if row["shared_prefill"] else None
                prediction = self.tok.decode(row.pop("output_ids"), skip_special_tokens=True).strip()
                # max_new_tokens: the cap the answer ran under (an answer at it was cut, not finished: the report's
                # output-length comparison counts those)
                row.update(base, protocol=protocol, **_spec_fields(spec), max_new_tokens=max_new,
                           decode_interval=g.interval if protocol == "streaming" else None,
                           prediction=prediction, score=score(sample, prediction),
                           key=row_key(self.model_name, g, unit, protocol, rule_name, spec))
                yield row
            del shared  # a shared prefill holds every layer's queries and keys: free it before the next one

    def _timed(self, clock: Clock) -> None:
        self.compile_s += clock.compile
        self.run_s += clock.run

    def _reference(self, ctx, question, answer, max_new) -> dict:
        """The unmodified model, transformers' own cache: the full-cache reference row."""
        peak = Peak(ctx.device)
        with Clock() as pre:
            out = self.model(input_ids=torch.cat([ctx, question], dim=1), use_cache=True, logits_to_keep=1)
        likelihood = self._likelihood(output_cache(out), out.logits[:, -1], answer)
        with Clock() as dec:
            ids, cache = greedy(self.model, output_cache(out), out.logits[:, -1], max_new, self.eos)
        self._timed(pre), self._timed(dec)
        return {"rule": REFERENCE, "rule_params": {}, "budget": None, "window": None, "kernel_fingerprint": None,
                "signals": None, "fingerprint_cached": None,
                "allocation": None, "layout": None,
                "shared_prefill": False, "prefill_s": pre.run, "decode_s": dec.run,
                "compile_s": pre.compile + dec.compile + likelihood.pop("compile_s"), **likelihood,
                "output_ids": ids, "output_tokens": len(ids), **kv_bytes(cache), "peak_mem_bytes": peak.read()}

    # --- answer likelihood (issue 13): scored on a copy of the cache right after the prefill ---------------------
    def _likelihood(self, cache, last_logits, answer, *, evict: bool = False, stepwise: bool = False) -> dict:
        """Row fields of the teacher-forced answer log-likelihood from the state after the whole prompt
        (`likelihood.py`); None when switched off."""
        if answer is None:
            return {"answer_logprob": None, "answer_logprob_mean": None, "likelihood_s": None, "compile_s": 0.0}
        with Clock() as clock:
            lp = answer_logprobs(self.model, cache, last_logits, answer, evict=evict, stepwise=stepwise)
        self._timed(clock)
        return {"answer_logprob": float(lp.sum()), "answer_logprob_mean": float(lp.mean()),
                "likelihood_s": clock.run, "compile_s": clock.compile}

    def _budgeted(self, protocol, rule_name, budget, prefill_ids, question, answer, max_new, shared,
                  shared_s) -> dict:
        g, model = self.grid, self.model
        rule = get(rule_name, **g.rule_params.get(rule_name, {}))
        if rule.replay_only and "prefix_length" not in g.rule_params.get(rule_name, {}):
            # kvzip: the template header is not replayed and scores 0; the reference reads it off the tokenizer
            rule = get(rule_name, **g.rule_params.get(rule_name, {}), prefix_length=template_parts(self.tok)[0])
        fingerprint = self._fingerprint(rule)
        forward = self._forward(rule, budget)
        # With a shared prefill, the forward's own peak is recorded apart (`shared_prefill_peak_mem_bytes`); this one
        # covers the branch and decode (the recorded prefill is still held).
        peak = Peak(prefill_ids.device)
        replay = rule.replay_only  # kvzip: its own protocol (query-agnostic, checked by the grid)
        shared = None if replay else shared
        done = None
        try:
            if not replay:
                cache = model.forward.new_cache(prefill_ids.shape[0], prompt=prefill_ids.shape[1],
                                                interval=g.interval if protocol == "streaming" else 1)
            with Clock() as pre:
                if replay:  # the context prefill and its replay: both are prefill time
                    # One cache size per budget for the run (its compiled graphs serve every sample).
                    slots = max(self.max_context - budget, self.headroom)
                    ids = replay_ids(self.tok, prefill_ids, prefix_length=rule.prefix_length)
                    done = compress(model, prefill_ids, ids, clock=Clock,
                                    cache=model.forward.new_cache(prefill_ids.shape[0], headroom=slots))
                    cache, logits = done.cache, done.logits
                elif shared is not None:
                    branch(shared, cache, rule, self.signals)
                    logits = shared.logits
                else:
                    logits = model(input_ids=prefill_ids, cache=cache, logits_to_keep=1).logits[:, -1]
            with Clock() as question_clock:  # the question, as the protocol appends it (part of decode_s)
                logits = finish_prompt(model, cache, logits, question, protocol)
            before = peak.read()
            # A compiled forward scores the answer token by token: its decode graph, no graph for the answer's length.
            likelihood = self._likelihood(cache, logits, answer, evict=protocol == "streaming",
                                          stepwise=g.backend is not None)
            # The likelihood's saved cache state is not part of the configuration's memory: leave it out.
            peak = Peak(prefill_ids.device)
            with Clock() as dec:
                with cache.frozen() if protocol != "streaming" else contextlib.nullcontext():
                    ids, _ = greedy(model, cache, logits, max_new, self.eos)
        finally:
            model.forward.restore()
        self._timed(pre), self._timed(question_clock), self._timed(dec)
        return {"rule": rule_name, "rule_params": rule.params(), "budget": budget, "window": kernel_window(rule),
                "allocation": allocation(rule), "layout": self.layout,
                "layer_budgets": cache.layer_budgets if len(set(cache.layer_budgets)) > 1 else None,
                "headroom": self.headroom, "kernel_fingerprint": fingerprint, "signals": self.signals_label,
                "fingerprint_cached": self.fingerprint_cached.get(rule.name), "shared_prefill": shared is not None,
                # Graphs this rule and budget used so far: its own, and the frozen calls' (shared with other rules).
                "compiled_graphs": len(forward.graphs) + len(self._frozen_for(forward)[1]) if g.backend else None,
                # With a shared prefill, prefill_s is what a separate run would take: the shared forward + the branch.
                "prefill_s": pre.run + (shared_s or 0.0), "branch_s": pre.run if shared is not None else None,
                "replay_s": done and done.replay_s, "replay_tokens": done and done.replay_tokens,
                "decode_s": question_clock.run + dec.run,
                "compile_s": pre.compile + question_clock.compile + dec.compile + likelihood.pop("compile_s"),
                **likelihood, "output_ids": ids, "output_tokens": len(ids), **kv_bytes(cache),
                "peak_mem_bytes": None if before is None else max(before, peak.read())}

    # --- the shared-context protocols (`shared_context.py`): one row per request ----------------------------------
    def _rule(self, rule_name: str):
        """The rule instance of the run (kvzip: with the template header it does not replay)."""
        g = self.grid
        rule = get(rule_name, **g.rule_params.get(rule_name, {}))
        if rule.replay_only and "prefix_length" not in g.rule_params.get(rule_name, {}):
            rule = get(rule_name, **g.rule_params.get(rule_name, {}), prefix_length=template_parts(self.tok)[0])
        return rule

    def _shared_rows(self, unit: Unit, sample, base: dict, protocol: str, rule_name: str, spec, ctx, shared,
                     shared_s, shared_peak) -> Iterator[dict]:
        """The rows of one configuration under `multi-request` or `multi-turn`: the context compressed once (the
        shared prefill branched, or the rule's own prefill; the unmodified model's own cache for the reference), then
        every request on it (`shared_context.RUN`). `prefill_s` is the context's, the same on every request's row;
        `decode_s` is the request's call and answer."""
        g, model = self.grid, self.model
        _, turns = shared_context.turns(self.tok, sample, protocol, self.max_new)
        for t in turns:
            t.prompt, t.answer = t.prompt.to(ctx.device), t.answer.to(ctx.device)
        run = shared_context.RUN[protocol]
        peak = Peak(ctx.device)
        if rule_name == REFERENCE:
            with Clock() as pre:
                cache = output_cache(model(input_ids=ctx, use_cache=True, logits_to_keep=1))
            self._timed(pre)
            config = {"rule": REFERENCE, "rule_params": {}, "budget": None, "window": None,
                      "kernel_fingerprint": None, "signals": None, "fingerprint_cached": None, "allocation": None,
                      "layout": None,
                      "shared_prefill": False, "prefill_s": pre.run, "branch_s": None}
            results = run(model, cache, turns, eos=self.eos, likelihood=g.likelihood)
            restore = None
        else:
            budget = self._tokens(spec, ctx.shape[1])
            rule = self._rule(rule_name)
            fingerprint = self._fingerprint(rule)
            forward = self._forward(rule, budget)
            shared = None if rule.replay_only else shared
            done = None
            with Clock() as pre:
                if rule.replay_only:  # kvzip (multi-request only, checked by the grid): its replay compresses
                    slots = max(self.max_context - budget, self.headroom)
                    ids = replay_ids(self.tok, ctx, prefix_length=rule.prefix_length)
                    done = compress(model, ctx, ids, clock=Clock,
                                    cache=model.forward.new_cache(ctx.shape[0], headroom=slots))
                    cache = done.cache
                else:
                    cache = model.forward.new_cache(ctx.shape[0], prompt=ctx.shape[1])
                    if shared is not None:
                        branch(shared, cache, rule, self.signals)
                    else:
                        model(input_ids=ctx, cache=cache, logits_to_keep=1)
            self._timed(pre)
            config = {"rule": rule_name, "rule_params": rule.params(), "budget": budget, "window": kernel_window(rule),
                      "allocation": allocation(rule), "layout": self.layout,
                      "layer_budgets": cache.layer_budgets if len(set(cache.layer_budgets)) > 1 else None,
                      "headroom": self.headroom, "kernel_fingerprint": fingerprint, "signals": self.signals_label,
                      "fingerprint_cached": self.fingerprint_cached.get(rule.name),
                      "shared_prefill": shared is not None,
                      "prefill_s": pre.run + (shared_s or 0.0), "branch_s": pre.run if shared is not None else None,
                      "replay_s": done and done.replay_s, "replay_tokens": done and done.replay_tokens}
            results = run(model, cache, turns, eos=self.eos, likelihood=g.likelihood, stepwise=g.backend is not None)
            restore = model.forward.restore
        tokens = ctx.shape[1]
        try:
            for turn, res in zip(turns, results):
                # the tokens this request's answer follows: the context and its question (multi-request), the whole
                # conversation so far (multi-turn)
                tokens = (tokens if protocol == "multi-turn" else ctx.shape[1]) + res.appended_tokens
                self.run_s += res.question_s + res.decode_s + (res.likelihood_s or 0.0)
                self.compile_s += res.compile_s
                lp = res.logprobs
                r = turn.sample
                prediction = self.tok.decode(res.output_ids, skip_special_tokens=True).strip()
                row = {**config, "compile_s": (pre.compile if res.turn == 1 else 0.0) + res.compile_s,
                       "compiled_graphs": None, "decode_s": res.question_s + res.decode_s,
                       "answer_logprob": None if lp is None else float(lp.sum()),
                       "answer_logprob_mean": None if lp is None else float(lp.mean()),
                       "likelihood_s": res.likelihood_s, "output_tokens": len(res.output_ids), **res.kv,
                       "peak_mem_bytes": peak.read(),
                       "shared_prefill_peak_mem_bytes": shared_peak if config["shared_prefill"] else None}
                if rule_name != REFERENCE and g.backend is not None:
                    row["compiled_graphs"] = len(forward.graphs) + len(self._frozen_for(forward)[1])
                row.update(base, protocol=protocol, turn=res.turn, turns=len(turns),
                           prompt_tokens=tokens, question_tokens=res.appended_tokens,
                           answer_tokens=turn.answer.shape[1] if g.likelihood else None, answers=r.answers,
                           depth=r.depth, max_new_tokens=turn.max_new,
                           **_spec_fields(spec), prediction=prediction,
                           score=score(r, prediction),
                           key=row_key(self.model_name, g, unit, protocol, rule_name, spec, turn=res.turn))
                yield row
        finally:
            if restore is not None:
                restore()
