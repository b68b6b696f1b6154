"""`fxbudget search`: check the settings, the model and the samples, then load the model and run the search."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from . import preflight
from .preflight import UsageError


def cmd_search(args) -> int:
    """Run `fxbudget search`; returns the exit status."""
    from ..harness.grid import Grid
    from ..harness.search import SearchConfig, import_optuna

    try:
        import_optuna()
    except ImportError as e:
        raise UsageError(str(e)) from None
    preflight.rule_files(args.rule_file)
    from . import names

    args.rules, args.tasks = names.rule_names(args.rules), names.task_names(args.tasks)
    args.protocol = names.protocol_names(args.protocol)
    if len(args.protocol) != 1:
        raise UsageError(f"one --protocol per search, got {','.join(args.protocol)}")
    from ..harness.grid import MULTI_PROTOCOLS

    if args.protocol[0] in MULTI_PROTOCOLS:
        raise UsageError(f"--protocol {args.protocol[0]}: a search fits one question per sample; the shared-context "
                         "protocols are `fxbudget compare`'s (search with query-agnostic, query-aware or streaming)")
    samples = Grid().samples if args.samples is None else args.samples
    config = SearchConfig(model="", tasks=args.tasks, lengths=args.lengths, samples=samples, seed=args.seed,
                          budget=args.budget, protocol=args.protocol[0], trials=args.trials, baselines=args.rules,
                          holdout_samples=args.holdout_samples, holdout_seed=args.holdout_seed, name=args.name,
                          max_new_tokens=args.max_new_tokens)
    try:
        config.validate()
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    place = preflight.placement(args)
    source = preflight.model_source(args)
    config.model, config.device, config.dtype = source.name, place.device, place.dtype
    tok = preflight.tokenizer(source)
    calibration = Grid(tasks=config.tasks, lengths=config.lengths, rules=["full"], budgets=[config.budget],
                       samples=config.samples, seed=config.seed)
    for grid in (calibration, config.holdout_grid()):  # every length checked against each task's minimum
        preflight.samples(grid, tok)
    return _run(args, config, source, place, tok)


def _run(args, config, source, place, tok) -> int:
    """Load the model (its tokenizer `tok` is the one the checks loaded), search, write the summary."""
    from ..harness.malloc import tune_malloc
    from ..harness.search import load_average, search, summary_markdown
    from ..models import load_model

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.default_malloc:
        tune_malloc()
    start, load_start = time.perf_counter(), load_average()
    model, _, _ = load_model(source, device=place.device, dtype=place.dtype, with_tokenizer=False)
    command = shlex.join(["fxbudget", *args.argv])
    try:
        res = search(model, tok, config.model, config, args.out, progress=not args.quiet, command=command)
    except ValueError as e:  # e.g. --out holds a study made with other settings
        raise UsageError(str(e)) from None
    text = summary_markdown(res, note=args.note, wall_s=time.perf_counter() - start, load_start=load_start)
    paths = [Path(args.out) / "search.md"] + ([Path(args.summary)] if args.summary else [])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"\nfound: {res.rule_file} (trial #{res.best.number}, calibration objective {res.best.value:.4f})")
    print("held-out verdict:")
    for _, sentence in res.verdicts.values():
        print(f"  {sentence.replace('**', '')}")
    print(f"summary: {', '.join(map(str, paths))}; held-out report: {res.holdout_dir / 'report.md'}")
    return 0
