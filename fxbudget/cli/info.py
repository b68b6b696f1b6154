"""The small commands: `report` (merge result folders), `rules` (the registered rules), `inspect` (the rewritten
attention of a model)."""

from __future__ import annotations

from . import preflight
from .preflight import UsageError
from .rules_table import WRAPPERS, rules_table, static_rules_table


def cmd_report(args) -> int:
    """`fxbudget report DIR...`: write and print the merged report."""
    from ..harness.report import report

    try:
        path = report(args.dirs, args.out, sort=args.sort)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(path.read_text())
    print(f"written: {path}")
    return 0


def cmd_rules(args) -> int:
    """`fxbudget rules`: the table of rules; the built-in ones are read from their sources (no torch import)."""
    table = static_rules_table() if not args.rule_file else None
    if table is None:
        preflight.rule_files(args.rule_file)
        table = rules_table()
    print(table)
    print()
    print(WRAPPERS)
    return 0


def cmd_inspect(args) -> int:
    """`fxbudget inspect`: the rewritten attention of a model (one layer's kernel, or every layer)."""
    import torch

    from ..graph_summary import summary
    from ..models import load_model

    place, source = preflight.placement(args), preflight.model_source(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(source, progress=False, device=place.device, dtype=place.dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(place.device)
    try:
        text = summary(model, ids, rule=args.rule, budget=args.budget, layer=args.layer, full=args.full,
                       **preflight.params(args.param).get(args.rule, {}))
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    print(text)
    return 0
