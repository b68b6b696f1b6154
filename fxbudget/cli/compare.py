"""`fxbudget compare`: check everything, plan, build the samples, load the model only if rows are left to run, run,
report. A rerun of a finished grid loads nothing, writes the report only if it is missing or older than the rows, and
prints the tables and where the report is; a rerun of a part-done one says how many rows it skips. Ctrl-C stops at
the next safe point (`harness.interrupt`; a second one at once): exit status 130, one line saying what was saved and
the command that resumes."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from . import decompose, folder, names, preflight, sizes
from .preflight import Stages, UsageError

INTERRUPTED = 130  # the shell's status of a process ended by SIGINT


def _setup_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def _cached_note(cached: dict[str, bool]) -> str:
    """` (2 of 3 read from the cache)`: how many of the run's kernel fingerprints `fairness.fingerprint_store` served."""
    return f" ({sum(cached.values())} of {len(cached)} read from the cache)" if cached else ""


def _interval_words(grid) -> str:
    """The run line's words on the streaming protocol's decode interval (and the memory it adds), if above 1."""
    if grid.interval <= 1:
        return ""
    k = grid.interval
    return (f"; streaming decode evicts every {k} steps (kvpress DecodingPress, target = the budget): its caches grow "
            f"to budget + {k - 1} entries between evictions, and allocate budget + max(head-room, {k - 1}) slots")


def _why(place) -> str:
    """` (dtype: the CPU default (...))`: how the run's dtype was chosen, for its start line."""
    return f" [dtype: {place.why}]" if place.why else ""


def grid_of(args):
    """The `Grid` of the compare options (`--task-file` alone runs only the files; `--samples` also caps them)."""
    from ..harness.grid import Grid

    d = Grid()
    tasks = args.tasks if args.tasks is not None else ([] if args.task_file else d.tasks)
    return Grid(tasks=tasks, lengths=args.lengths, rules=args.rules, budgets=args.budgets,
                samples=d.samples if args.samples is None else args.samples, seed=args.seed,
                protocols=args.protocol, chunk_size=args.chunk_size,
                backend=None if args.backend == "none" else args.backend, share_prefill=not args.no_share_prefill,
                rule_params=preflight.params(args.param), task_files=args.task_file,
                likelihood=not args.no_likelihood, task_file_samples=args.samples, interval=args.interval,
                signals=args.signals, slot_dtype=args.slot_dtype)


def cmd_compare(args) -> int:
    """Run `fxbudget compare` (see the module docstring); returns the exit status. Ctrl-C is deferred to the next
    safe point while it runs (`harness.interrupt.deferred`), and the previous SIGINT handler restored after."""
    from ..harness import interrupt

    with interrupt.deferred():
        return _compare(args)


def _compare(args) -> int:
    from ..harness import interrupt

    stages = Stages(from_process_start=args.is_process)
    if args.ray is None and any(x is not None for x in (args.workers, args.cpus_per_worker, args.gpus_per_worker)):
        raise UsageError("--workers, --cpus-per-worker and --gpus-per-worker need --ray")
    preflight.rule_files(args.rule_file)
    _match_names(args)
    preflight.task_files(args.task_file)
    grid = grid_of(args)
    try:
        grid.validate()
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    preflight.rule_probes(grid)
    place = preflight.placement(args, ray=args.ray is not None, names_only=args.dry_run)
    source = preflight.model_source(args)
    if args.ray is not None:
        runner = _ray_runner(args, grid, source, place)
    else:
        from ..harness.runner import Runner

        _setup_threads(args.threads)
        runner = Runner(None, None, source.name, grid, args.out, shard=args.shard, progress=not args.quiet,
                        max_new_tokens=args.max_new_tokens)
    try:
        from ..kernel.settings import signals_label

        from ..harness.grid import REFERENCE

        plan = runner.plan()
        budgeted = any(r != REFERENCE for r in grid.rules)  # a run of `full` alone writes no budgeted rows
        folder.check(args.out, folder.Identity(source.name, place.dtype, place.device, tuple(grid.protocols),
                                               signals_label(grid.signal_set()) if budgeted else None,
                                               grid.slot_dtype))
    except ValueError as e:  # a results file with a line that is not a row (a cut last line is only a warning)
        raise UsageError(str(e)) from None
    stages.mark("checks (torch and transformers imports included)")
    interrupt.checkpoint("checks")
    if not plan:
        written = _report_if_stale(args)
        print(f"[fxbudget] {source.name}: nothing to run, every row of this grid is in {runner.path.parent}; the "
              "model is not loaded" + ("; the report was missing or older than the rows: written now" if written else
                                       "; the report is left as it is"), file=sys.stderr)
        _tables(args, grid)
        _where(Path(args.out) / "report.md")
        stages.mark("reading the rows" + (" and the report" if written else ""))
        print(f"[fxbudget] {stages.line()}; Python's exit follows", file=sys.stderr)
        return 0
    from ..harness.grid import plan_rows

    total, todo = _rows_of_shard(grid, args.shard), plan_rows(plan)
    if todo < total:
        print(f"[fxbudget] resuming: {total - todo} of {names.plural(total, 'row')} done (in {runner.out_dir}); "
              f"{todo} to run", file=sys.stderr)
    with interrupt.immediate():  # minutes without a safe point; the cache is renamed into place when complete
        converted = preflight.prepare_model(source)
    if converted:
        stages.mark("the embedded model's first-use conversion")
    tok = preflight.tokenizer(source)
    config = sizes.model_config(source)
    if grid.tasks:
        sizes.check_lengths(grid.lengths, config, source.name)
    samples = preflight.samples(grid, tok, plan)
    sized = sizes.measure(samples, tok, grid.likelihood)
    sizes.check_samples(sized, config, source.name, args.max_new_tokens)
    from ..harness.runner import cache_shapes

    try:  # a decode interval longer than a streaming sample's generation is refused here, before the model loads
        headroom = cache_shapes(grid, plan, tok, samples, args.max_new_tokens)[0]
    except ValueError as e:
        raise UsageError(str(e)) from None
    byte_budgets = sizes.byte_tokens(grid, config, place.dtype, source.name)
    for line in sizes.budget_warnings(grid, sized, config, place.dtype, headroom, args.max_new_tokens, byte_budgets):
        print(f"[fxbudget] {line}", file=sys.stderr)
    timing = _Timing(grid, plan, samples, sized, config, args, source, place)
    line = sizes.estimate_line(grid, plan, samples, sized, config, place.device, args.max_new_tokens,
                               timing.calibration, timing.rules)
    print(f"[fxbudget] {line}", file=sys.stderr)
    busy = sizes.load_warning(place.device, timing.threads, calibrated=timing.calibration is not None)
    if busy:
        print(f"[fxbudget] {busy}", file=sys.stderr)
    if config is not None:
        from ..models.layer_config import budgeted_layers_line

        print(f"[fxbudget] {source.name}: {budgeted_layers_line(config)}", file=sys.stderr)
    from ..harness.protocol_note import run_note

    note = run_note(grid.rules, grid.protocols, grid.rule_params)
    if note:
        print(f"[fxbudget] {note}", file=sys.stderr)
    if args.dry_run:
        print(f"[fxbudget] --dry-run: {names.plural(todo, 'row')} on {names.plural(len(plan), 'sample')} planned "
              f"({place.dtype} on {place.device}{_why(place)}, the device checked by name only); no model loaded, "
              f"nothing written in {args.out}; drop --dry-run to run", file=sys.stderr)
        return 0
    stages.mark("tokenizer and samples")
    interrupt.checkpoint("samples")
    try:
        return _run(args, grid, source, place, samples, runner, plan, stages, total, tok, timing)
    except KeyboardInterrupt:
        return _interrupted(args, runner, total)


class _Timing:
    """The start estimate's calibration (`rates`) and, at the end of a run that is not on Ray, the record of what
    it measured against the estimate."""

    def __init__(self, grid, plan, samples, sized, config, args, source, place):
        import time

        import torch

        from ..harness.grid import plan_rows
        from . import rates

        self.start, self.rows = time.perf_counter(), plan_rows(plan)
        self.formula = sizes.formula_seconds(grid, plan, samples, sized, config, args.max_new_tokens)
        self.threads = torch.get_num_threads()
        self.key = None if args.ray is not None else rates.key(place.device, place.dtype, self.threads,
                                                                grid.backend, source.name)
        self.rules = rates.rule_ids(grid.rules, grid.rule_params)
        self.calibration = rates.calibration(self.key) if self.key else None

    def record(self, runner) -> None:
        import time

        from . import rates

        if self.key is None or self.formula <= 0:
            return
        total = time.perf_counter() - self.start
        rows_s = runner.compile_s + runner.run_s
        traced = sum(not cached for cached in runner.fingerprint_cached.values())
        rates.record(self.key, self.formula, rows_s, max(0.0, total - rows_s - runner.fingerprint_s), self.rows,
                     trace_s=runner.fingerprint_s / traced if traced else None, rules=self.rules)


def _run(args, grid, source, place, samples, runner, plan, stages, total, tok, timing=None) -> int:
    """Load the model (unless on Ray), run the rows, report."""
    from ..harness import interrupt

    if args.ray is None:
        interrupt.checkpoint("model load")
        runner = _load(args, grid, source, place, samples, tok)
        stages.mark("model load")
        interrupt.checkpoint("model loaded")
    from ..harness.grid import plan_rows

    todo = plan_rows(plan)
    print(f"[fxbudget] {source.name}: {names.plural(todo, 'row')} to run on {names.plural(len(plan), 'sample')} "
          f"(protocol {','.join(grid.protocols)}, {place.dtype} on {place.device}{_why(place)}, "
          f"prefill {'shared per sample' if grid.shares_prefill else 'per rule'}, "
          f"backend {grid.backend or 'none (eager kernel)'}, cache layout {grid.layout()}"
          f"{_interval_words(grid)}"
          f"{' (a head-adaptive rule: every rule pooled)' if grid.head_pool() else ''}); results in {runner.path}",
          file=sys.stderr)
    if grid.share_prefill and not grid.shares_prefill:
        print("[fxbudget] prefill is not shared: it needs one-call prefill (no --chunk-size) on the eager kernel "
              "(--backend none)", file=sys.stderr)
    try:
        runner.run()
    except RuntimeError as e:  # a Ray cluster too small, unreachable, or a sample that kept losing its worker
        if args.ray is None:
            raise
        raise UsageError(f"--ray: {e}") from None
    if args.ray is None:
        stages.split("rows and progress (outside the timed calls)", [
            ("kernel fingerprints" + _cached_note(runner.fingerprint_cached), runner.fingerprint_s),
            ("compile", runner.compile_s), ("run", runner.run_s)])
        workers = ""
    else:
        stages.split("running the samples", [("Ray start, workers loading the model, fingerprints",
                                              runner.startup_s)])
        workers = (f" (worker seconds, summed over {names.plural(len(runner.workers), 'worker')} in parallel: compile "
                   f"{runner.compile_s:.1f} s, run {runner.run_s:.1f} s)")
    from ..harness.report import report

    interrupt.checkpoint("report")
    path = report([args.out], sort=args.sort)
    interrupt.checkpoint("report written")
    _tables(args, grid)
    _where(path)
    stages.mark("report")
    if timing is not None:
        timing.record(runner)
    print(f"[fxbudget] {stages.line()}{workers}; Python's exit follows", file=sys.stderr)
    return 0


def _match_names(args) -> None:
    """Rules, tasks, protocols and `--param` rule names as the registry spells them (`snapKV` -> `snapkv`), or one
    line with the nearest known name."""
    args.rules = names.rule_names(args.rules)
    args.tasks = names.task_names(args.tasks)
    args.protocol = names.protocol_names(args.protocol)
    args.param = names.params(args.param)
    args.rules, args.param = decompose.expand(args.rules, getattr(args, "decompose", None), args.param)


def _rows_of_shard(grid, shard) -> int:
    """How many rows this shard of the grid has in all (done or not)."""
    from ..harness.grid import configs, plan_rows, units

    i, n = shard
    return plan_rows([(u, configs(grid)) for u in units(grid)[i::n]])


def _interrupted(args, runner, total: int) -> int:
    """After Ctrl-C: one line saying what is saved and the command that resumes; the exit status 130."""
    try:
        from ..harness.grid import plan_rows

        left = plan_rows(runner.plan())
    except Exception:  # noqa: BLE001  (a file cut mid-row: the rerun repairs it)
        left = total
    command = "fxbudget " + shlex.join(args.argv)
    saved = total - left
    if not left:  # every row was saved: the report was being written, or was just written
        rows = "its one row is" if total == 1 else f"all {total} rows are"
        if _report_fresh(args.out):
            print(f"[fxbudget] interrupted after the report: {rows} saved in {runner.path}, the report in "
                  f"{Path(args.out) / 'report.md'}; rerunning prints the tables: {command}", file=sys.stderr)
        else:
            print(f"[fxbudget] interrupted while writing the report: {rows} saved in {runner.path}; write it with: "
                  f"fxbudget report {shlex.quote(str(args.out))}", file=sys.stderr)
        return INTERRUPTED
    where = f"in {runner.path}" if saved else f"(nothing written in {runner.out_dir} yet)"
    print(f"[fxbudget] interrupted: {saved} of {names.plural(total, 'row')} saved {where}; resume with: {command}",
          file=sys.stderr)
    return INTERRUPTED


def _report_fresh(out) -> bool:
    """Whether `out/report.md` exists and is newer than every results file in `out`."""
    out = Path(out)
    report = out / "report.md"
    if not report.is_file():
        return False
    newest = max((p.stat().st_mtime_ns for p in out.glob("results*.jsonl")), default=0)
    return report.stat().st_mtime_ns >= newest


def _report_if_stale(args) -> bool:
    """Write the report of `--out` when it is missing or older than its rows (a run stopped before or while
    writing it); True when it did."""
    if _report_fresh(args.out):
        return False
    from ..harness.report import report

    report([args.out], sort=args.sort)
    return True


def _where(path: Path) -> None:
    """The two lines that say where the report, the plots and the CSV files are."""
    print(f"\nreport (paired comparisons per budget): {path}\nplots, summary.csv, paired.csv: {path.parent}")


def _load(args, grid, source, place, samples, tok):
    """Load the model (the samples are already built with `tok`, its tokenizer, which is not loaded again) and
    return its `Runner`."""
    from ..harness.malloc import tune_malloc
    from ..harness.runner import Runner
    from ..models import load_model

    if not args.default_malloc:
        tune_malloc()
    model, _, name = load_model(source, device=place.device, dtype=place.dtype, with_tokenizer=False)
    return Runner(model, tok, name, grid, args.out, shard=args.shard, progress=not args.quiet,
                  max_new_tokens=args.max_new_tokens, samples=samples)


def _tables(args, grid) -> None:
    """Print the accuracy and likelihood tables of the rows in `--out` (of this grid's protocols)."""
    from ..harness.report import accuracy_table, likelihood_table, load_rows
    from ..harness.tables import likelihood_heading

    rows = [r for r in load_rows([args.out]) if r["protocol"] in grid.protocols]
    print(f"\naccuracy, protocols side by side (mean [95% interval] (samples); rules by {args.sort}):\n")
    print(accuracy_table(rows, args.sort, by_setting=True))
    likelihood = likelihood_table(rows, args.sort, by_setting=True)
    if likelihood:
        print(f"\n{likelihood_heading(rows)}:\n")
        print(likelihood)


def _ray_runner(args, grid, source, place):
    """The driver of a `--ray` run (it does not load the model: the workers do)."""
    from ..harness.ray_runner import RayMissingError, RayOptions, RayRunner

    options = RayOptions(address=args.ray, workers=args.workers, threads=args.threads,
                         cpus_per_worker=1.0 if args.cpus_per_worker is None else args.cpus_per_worker,
                         gpus_per_worker=0.0 if args.gpus_per_worker is None else args.gpus_per_worker)
    try:
        return RayRunner(source, grid, args.out, shard=args.shard, progress=not args.quiet,
                         max_new_tokens=args.max_new_tokens, options=options, tune_malloc=not args.default_malloc,
                         dtype=place.dtype)
    except (RayMissingError, ValueError) as e:
        raise UsageError(str(e)) from None
