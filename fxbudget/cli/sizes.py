"""Size checks of `fxbudget compare`, before any model work: the model's config is read (not its weights), and

- a `--lengths` value, or a sample, beyond the model's positions (`max_position_embeddings`) is refused;
- a budget at or above a sample's context is warned about, with what its cache costs against the unmodified model's;
- the grid's rows, the tokens they put through the model and an estimated time are printed before it starts.

The time estimate: tokens per second of the embedded 0.5B model on one CPU thread, measured in the committed quick
start (`docs/quickstart/results.jsonl`), scaled by the model's size, then calibrated on this machine's own earlier
runs (`rates`: their measured time per token and the time around the rows). Without an earlier run it is rough and
says so; on a GPU without one only the rows and tokens are printed.
"""

from __future__ import annotations

from .names import plural
from .preflight import UsageError

# The committed quick start (docs/quickstart/results.jsonl: the embedded model, float32, CPU, one thread): the
# unmodified model's prefill of 1043-token prompts ran at 113 tokens/s; decoding at about 3 steps/s (4.0 tokens/s for
# the unmodified model, 2.7 for budgeted rules, their question's call included). Answer tokens scored in one call
# count as prompt tokens. tests/test_first_hour.py holds these constants within a factor of two of that file.
CPU_PREFILL_TOKENS_S = 113.0
CPU_DECODE_STEPS_S = 3.0
# Where those rates were measured (docs/quickstart/wall.json, held to it by tests/test_first_hour_fourth_pass.py):
# the estimate says it is that machine's time, not the reader's, until a run here calibrates it.
REFERENCE_MACHINE = "an idle 2-core Intel Xeon with AVX-512"
# The embedded model's shape (Qwen2.5-Coder-0.5B-Instruct's config), what the rates above were measured on.
EMBEDDED_SHAPE = dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, vocab_size=151936,
                      num_attention_heads=14, num_key_value_heads=2, head_dim=64)
MIB = 2 ** 20


def model_config(source):
    """The model's transformers config, read from its `config.json` (no weights), or None where it cannot be read
    (then the size checks are skipped: the model load says what is wrong)."""
    from transformers import AutoConfig

    from ..models import default_cache_dir

    try:
        if source.kind == "default":
            from ..models.embedded import DEFAULT, EMBEDDED

            return AutoConfig.from_pretrained(default_cache_dir(EMBEDDED[source.location] if source.location
                                                                else DEFAULT))
        if source.kind == "random":
            from ..models.random_weights import load_config

            return load_config(source.location, source.layers)
        return AutoConfig.from_pretrained(source.location, **source.pretrained_kwargs())
    except Exception:  # noqa: BLE001  (a config transformers cannot read: the model load will say why)
        return None


def _text(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def context_limit(config) -> int | None:
    """The model's positions (`max_position_embeddings`, or `n_positions` for GPT-2-style configs), None if unknown."""
    cfg = _text(config)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_lengths(lengths: list[int], config, model: str) -> None:
    """Refuse a `--lengths` value beyond the model's positions, before a sample is built.

    Raises:
        UsageError: "--lengths 100000: MODEL holds 32768 positions (max_position_embeddings in its config) ...".
    """
    limit = context_limit(config) if config is not None else None
    over = [n for n in lengths if limit is not None and n > limit]
    if over:
        raise UsageError(f"--lengths {over[0]}: {model} holds {limit} positions (max_position_embeddings in its "
                         f"config), and the question and answer come on top of the context; use --lengths below "
                         f"{limit}")


def measure(samples: dict, tok, likelihood: bool = True) -> list[tuple]:
    """Every sample of `samples` (`runner.build_samples`) with its sizes in tokens, tokenized once:
    `(key, sample, context, question, answer)` (answer 0 without `likelihood`)."""
    from ..harness.tasks import answer_ids, chat_ids

    out = []
    for key, group in samples.items():
        for sample in group:
            ctx, question = chat_ids(tok, sample)
            answer = answer_ids(tok, sample).shape[1] if likelihood else 0
            out.append((key, sample, ctx.shape[1], question.shape[1], answer))
    return out


def _name(key, sample) -> str:
    return f"{key[0]} at {key[1]} tokens" if isinstance(key, tuple) else f"{key} (line {sample.meta.get('line')})"


def check_samples(sized: list[tuple], config, model: str, max_new_tokens: int | None) -> None:
    """Refuse a sample whose prompt and answer exceed the model's positions (a task file's long line, or a length
    just under the limit whose question and answer overflow it).

    Raises:
        UsageError: naming the task, its tokens and the limit.
    """
    limit = context_limit(config) if config is not None else None
    if limit is None:
        return
    for key, sample, ctx, question, answer in sized:
        new = max(max_new_tokens or sample.max_new_tokens, answer)
        if ctx + question + new > limit:
            raise UsageError(f"{_name(key, sample)}: the prompt ({ctx + question} tokens) and its answer ({new}) need "
                             f"{ctx + question + new} positions; {model} holds {limit} (max_position_embeddings in "
                             "its config): use shorter --lengths")


def kv_bytes(config, dtype: str, slots: int, *, budgeted: bool) -> int:
    """Bytes of keys and values a cache of `slots` entries per layer and KV head allocates: with `budgeted`, as
    `BudgetCache` allocates it (sliding-window layers: exactly their window); else as the unmodified model's own
    cache holds `slots` tokens (transformers' sliding layers keep at most `window - 1` of them)."""
    from ..models.architectures import layer_shapes
    from ..models.layer_config import layer_windows

    n_layers, kv_heads, head_dim, _, _ = layer_shapes(config)
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    total = 0
    for window in layer_windows(config):
        held = slots if not window else (window if budgeted else min(window - 1, slots))
        total += 2 * held * kv_heads * head_dim * size
    return total


def byte_tokens(grid, config, dtype: str, model: str) -> dict[str, int]:
    """Each byte budget of the grid as tokens for this model at `dtype` (`cache.byte_budget`), before the model loads;
    {} when there is none, or no config to size them from (the run sizes them from the loaded model).

    Raises:
        UsageError: a byte budget below one entry per layer and KV head (it says the smallest that works), or a
            model with no layer a budget limits.
    """
    from ..harness.grid import budget_kind

    specs = [b for b in grid.budgets if budget_kind(b) == "bytes"]
    if not specs or config is None:
        return {}
    import torch

    from ..cache.byte_budget import tokens_for_bytes

    try:
        return {s: tokens_for_bytes(s, config, dtype=getattr(torch, dtype), head_pool=grid.layout() == "head-pool",
                                    slot_dtype=grid.slot_dtype) for s in specs}
    except ValueError as e:
        raise UsageError(f"--budgets: {model}: {e}") from None


def budget_warnings(grid, sized: list[tuple], config, dtype: str, headroom: int,
                    max_new_tokens: int | None, byte_budgets: dict | None = None) -> list[str]:
    """One line per budget that is at or above a sample's context: nothing is evicted (every rule is the unmodified
    model), and what its cache allocates against the unmodified model's. `byte_budgets`: `byte_tokens`'."""
    from ..harness.grid import budget_kind, resolve_budget

    lines = []
    for spec in grid.budgets:
        if budget_kind(spec) == "bytes" and spec not in (byte_budgets or {}):
            continue  # not sized before the model loads (no config)
        worst = None  # the sample whose context the budget exceeds most
        for key, sample, ctx, question, _ in sized:
            budget = resolve_budget(spec, ctx, byte_budgets)
            if budget >= ctx and (worst is None or budget - ctx > worst[0] - worst[1]):
                worst = (budget, ctx, question + (max_new_tokens or sample.max_new_tokens), _name(key, sample))
        if worst is None:
            continue
        budget, context, rest, name = worst
        cost = ""
        if config is not None:
            try:
                ours = kv_bytes(config, dtype, budget + headroom, budgeted=True)
                theirs = kv_bytes(config, dtype, context + rest, budgeted=False)
                cost = (f"; its cache allocates {_size(ours)} ({budget} + {headroom} head-room entries per layer and "
                        f"KV head) against the unmodified model's {_size(theirs)}")
            except Exception:  # noqa: BLE001  (an architecture the size formula does not know: no cost said)
                cost = ""
        what = f"--budgets {spec}" + (f" (= {budget} entries)" if budget_kind(spec) != "tokens" else "")
        lines.append(f"warning: {what} is at or above the context ({context} tokens, {name}): nothing is evicted, "
                     f"so every rule is the unmodified model there{cost}; use a budget below the context")
    return lines


def _compute_params(shape) -> float:
    """Multiply-adds per token of a decoder (its projections, MLP and output head), from its config's shape."""
    get = shape.get if isinstance(shape, dict) else (lambda k, d=None: getattr(shape, k, d))
    h, layers = get("hidden_size"), get("num_hidden_layers")
    heads = get("num_attention_heads")
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or h // heads
    inter = get("intermediate_size") or 4 * h
    attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    return layers * (attn + 3 * h * inter) + get("vocab_size") * h


def grid_tokens(grid, plan, samples: dict, sized: list[tuple], max_new_tokens: int | None) -> tuple[int, int]:
    """(tokens through the model in calls of many tokens, decoding steps at most) of the rows in `plan`: one prefill
    per sample and prefilled sequence when rules share it, else one per row; each row appends its question
    (query-agnostic), scores the gold answer (one call; token by token under a compiled backend) and decodes at most
    its answer length (fewer where the model stops); a shared-context configuration does so once per request (the
    first request's sizes standing for the others)."""
    from ..harness.grid import REFERENCE, turns

    by_sample = {id(sample): (ctx, question, answer) for _, sample, ctx, question, answer in sized}
    prefill = steps = 0
    for unit, todo in plan:
        sample = samples[unit.task if unit.length is None else (unit.task, unit.length)][unit.index]
        ctx, question, answer = by_sample[id(sample)]
        max_new = max_new_tokens or sample.max_new_tokens
        asked = {c: turns(unit.task, c[0]) or 1 for c in todo}  # a shared-context protocol: one per request
        for aware in (False, True):
            group = [c for c in todo if (c[0] == "query-aware") == aware]
            budgeted = [c for c in group if c[1] != REFERENCE]
            seq = ctx + question if aware else ctx
            prefill += seq * (1 if grid.shares_prefill and budgeted else len(budgeted))
            prefill += (0 if aware else question) * sum(asked[c] for c in budgeted)
        references = [c for c in todo if c[1] == REFERENCE]
        if any(asked[c] == 1 for c in references):
            prefill += ctx + question
        prefill += sum(ctx + asked[c] * question for c in references if asked[c] > 1)
        stepwise = grid.backend is not None  # a compiled forward scores the answer token by token
        prefill += sum(asked.values()) * (0 if stepwise else answer)
        steps += sum(asked.values()) * (max_new + (answer if stepwise else 0))
    return prefill, steps


def formula_seconds(grid, plan, samples: dict, sized: list[tuple], config, max_new_tokens: int | None) -> float:
    """The grid's seconds at the committed quick start's rates (one CPU thread), scaled by model size: the base
    that `rates` calibrates on this machine."""
    prefill, steps = grid_tokens(grid, plan, samples, sized, max_new_tokens)
    return _scale(config) * (prefill / CPU_PREFILL_TOKENS_S + steps / CPU_DECODE_STEPS_S)


def _scale(config) -> float:
    return _compute_params(config) / _compute_params(EMBEDDED_SHAPE) if config is not None else 1.0


def estimate_line(grid, plan, samples: dict, sized: list[tuple], config, device: str,
                  max_new_tokens: int | None, calibration=None, rules: list[str] = ()) -> str:
    """The line printed before a grid starts: its rows, samples, tokens and an estimated time: calibrated on this
    machine's earlier runs (`rates.Calibration`) when there are some, else (on the CPU only) at the quick start's
    rates, which it says."""
    prefill, steps = grid_tokens(grid, plan, samples, sized, max_new_tokens)
    from ..harness.grid import plan_rows

    rows = plan_rows(plan)
    head = (f"{plural(rows, 'row')} on {plural(len(plan), 'sample')}: {_count(prefill)} prompt and answer tokens "
            f"through the model, at most {_count(steps)} decoding steps")
    formula = formula_seconds(grid, plan, samples, sized, config, max_new_tokens)
    if calibration is not None:
        c, new = calibration, len(calibration.new(rules))
        traces = "" if not new else (f", {_duration(new * c.trace)} tracing {plural(new, 'new kernel fingerprint')}"
                                     if c.trace else f"; {plural(new, 'new kernel fingerprint')} not included: no "
                                     "earlier run timed one")
        return (f"{head}; estimated {_duration(c.seconds(formula, rules))} to the end (calibrated on this machine's "
                f"last {plural(c.runs, 'run')} of this model, device, dtype, threads and backend: rows at "
                f"{c.factor:.2g}x the quick start's time per token, plus {_duration(c.fixed)} of model load and "
                f"report{traces})")
    if device != "cpu":
        return (f"{head}; no time estimate on {device} yet (fxbudget has no committed GPU measurement; the next run "
                "here is estimated from this one's)")
    return (f"{head}; estimated {_duration(formula)} on the reference machine, not this one ({REFERENCE_MACHINE}, "
            f"one torch thread: the embedded 0.5B model's {CPU_PREFILL_TOKENS_S:.0f} prompt tokens/s and "
            f"{CPU_DECODE_STEPS_S:.0f} steps/s in the committed quick start, every answer decoded to its limit, "
            f"scaled {_scale(config):.2g}x by model size; model load and kernel fingerprints not included; the next "
            "run on this machine is calibrated on this one's measured rate)")


def load_warning(device: str, threads: int, *, calibrated: bool, load: float | None = None,
                 cores: int | None = None) -> str | None:
    """A warning when other work already keeps this machine's CPUs busy (the 1-minute load average above the cores
    this run leaves free, plus a half), which the estimate line does not count; None otherwise, on a GPU, or where
    the load average cannot be read.

    Args:
        threads: this run's torch threads. calibrated: whether the estimate comes from this machine's earlier runs.
        load, cores: the 1-minute load average and the CPU count (default: read from the OS).
    """
    import os

    if device != "cpu":
        return None
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:
        return None
    cores = cores or os.cpu_count() or 1
    if load < max(0, cores - threads) + 0.5:
        return None
    assumes = ("counts only the load its earlier runs saw" if calibrated else "assumes an otherwise idle machine")
    return (f"warning: the load average is {load:.2f} on {plural(cores, 'core')} (this run takes "
            f"{plural(threads, 'torch thread')}): other work shares the CPU, so expect longer than estimated; "
            f"the estimate {assumes}")


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB / 10 else f"{n / 1024:.1f} KiB"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e4 else str(n)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"
