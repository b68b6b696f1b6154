"""The small commands: `report` (merge result folders), `rules` (the registered rules), `tasks` (the generated
tasks), `inspect` (the rewritten attention of a model)."""

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


def tasks_table() -> str:
    """Markdown table of the generated tasks: name, what it measures (the generator's docstring), what a sample
    holds (its `Returns:`); then the task file fields. No torch import."""
    import inspect
    import re

    from ..harness.tasks import TASK_FILE_FIELDS, TASKS
    from ..harness.tasks.haystack import SAFE_TOKENS

    def clean(text: str) -> str:
        text = re.sub(r":\w+:`([^`]*)`", r"`\1`", " ".join(text.split()))
        return text.replace("``", "`").replace("|", "\\|")

    lines = ["| task | what it measures | a sample holds |", "|---|---|---|"]
    for name, fn in TASKS.items():
        doc = inspect.getdoc(fn) or ""
        summary = doc.split("\n\n")[0]
        returns = doc.split("Returns:")[-1].strip().split("\n\n")[0] if "Returns:" in doc else ""
        lines.append(f"| `{name}` | {clean(summary)} | {clean(returns)} |")
    fields = "\n".join(f"- `{k}`: {v}" for k, v in TASK_FILE_FIELDS.items())
    return ("\n".join(lines) + f"\n\nEach is generated at every `--lengths` (context tokens of the model's tokenizer, "
            f"within 2%; at least {SAFE_TOKENS}, more for tasks with several needles), `--samples` per length with "
            "needle depths spread evenly, seeded by `--seed`; a sample scores the fraction of its answers found in "
            f"the output.\n\nYour own task: `--task-file FILE.jsonl`, one JSON object per line with the fields\n"
            f"{fields}\n- `meta`: optional, an object of your own, kept with the sample (any other field is refused)")


def cmd_tasks(args) -> int:
    """`fxbudget tasks`: the generated tasks and the task file fields."""
    print(tasks_table())
    return 0


def cmd_inspect(args) -> int:
    """`fxbudget inspect`: the rewritten attention of a model (one layer's kernel, or every layer)."""
    import torch

    from ..fairness.graph_summary import summary
    from ..models import load_model

    from .names import rule_name

    args.rule = rule_name(args.rule, option="--rule")
    place, source = preflight.placement(args), preflight.model_source(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(source, progress=False, device=place.device, dtype=place.dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(place.device)
    try:
        text = summary(model, ids, rule=args.rule, budget=args.budget, layer=args.layer, full=args.full, cached=True,
                       signals=None if args.signals == "rule" else args.signals,
                       **preflight.params(args.param).get(args.rule, {}))
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    print(text)
    return 0
