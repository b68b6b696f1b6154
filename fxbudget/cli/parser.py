"""The `fxbudget` command: `compare` (the comparison grid), `search` (fit a rule), `report`, `rules`, `inspect`.

    fxbudget compare --tasks passkey,niah_multikey --lengths 2000 --budgets 64,128,256 --samples 3 --out runs/demo
    fxbudget compare --budgets 12.5%,25%,50% --protocol query-agnostic,query-aware --out runs/both
    fxbudget search --tasks passkey,niah_multikey --lengths 2000 --samples 4 --budget 256 --trials 50 --out runs/s
    fxbudget report runs/a runs/b --out runs/merged --sort likelihood
    fxbudget rules
    fxbudget inspect --rule snapkv --budget 64 --tokens 16 [--layer 3] [--full]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _budgets(text: str) -> list[int | str]:
    """`128,256` (KV entries) or `12.5%,25%` (fractions of each sample's context)."""
    from .harness.runner import budget_fraction

    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        spec = item if item.endswith("%") else None
        if spec is None:
            try:
                spec = int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"a budget is an int or a percentage such as 12.5%, got {item!r}") \
                    from None
        try:
            budget_fraction(spec)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        out.append(spec)
    return out


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes i/n, e.g. 0/2, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text!r}")
    return i, n


def _params(items: list[str]) -> dict[str, dict]:
    """`rule.name=value` items (value parsed as JSON, else kept as a string) -> {rule: {name: value}}."""
    out: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        rule, dot, name = key.partition(".")
        if not (sep and dot and rule and name):
            raise SystemExit(f"--param takes rule.name=value, e.g. snapkv.window=64; got {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(rule, {})[name] = parsed
    return out


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` once: not where the help already names its default, nor for None/False/empty."""

    def _get_help_string(self, action):
        text, d = action.help or "", action.default
        if "default" in text or d is None or d is False or d is argparse.SUPPRESS or d == []:
            return text
        return super()._get_help_string(action)


def _backend(text: str) -> str | None:
    return None if text == "none" else text


def _setup_threads(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def cmd_compare(args) -> int:
    from .harness.report import accuracy_table, likelihood_table, load_rows, report
    from .harness.malloc import tune_malloc
    from .harness.runner import Grid, Runner
    from .models import load_model

    _load_rule_files("compare", args.rule_file)
    grid = Grid(tasks=args.tasks, lengths=args.lengths, rules=args.rules, budgets=args.budgets,
                samples=args.samples, seed=args.seed, protocols=args.protocol, chunk_size=args.chunk_size,
                backend=_backend(args.backend), share_prefill=not args.no_share_prefill, rule_params=_params(args.param),
                task_files=args.task_file, likelihood=not args.no_likelihood)
    try:
        grid.validate()
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise SystemExit(f"fxbudget compare: {e}") from None
    start = time.perf_counter()
    if args.ray is not None:
        runner = _ray_runner(args, grid)
        name = runner.model_name
    else:
        if args.workers is not None or args.cpus_per_worker is not None or args.gpus_per_worker is not None:
            raise SystemExit("fxbudget compare: --workers, --cpus-per-worker and --gpus-per-worker need --ray")
        _setup_threads(args.threads)
        if not args.default_malloc:
            tune_malloc()
        model, tokenizer, name = load_model(args.model)
        runner = Runner(model, tokenizer, name, grid, args.out, shard=args.shard, progress=not args.quiet,
                        max_new_tokens=args.max_new_tokens)
    try:
        plan = runner.plan()
    except ValueError as e:  # a results file with a line that is not a row (a cut last line is only a warning)
        raise SystemExit(f"fxbudget compare: {e}") from None
    todo = sum(len(t) for _, t in plan)
    print(f"[fxbudget] {name}: {todo} rows to run on {len(plan)} samples "
          f"(protocol {','.join(grid.protocols)}, "
          f"prefill {'shared per sample' if grid.shares_prefill else 'per rule'}, "
          f"backend {grid.backend or 'none (eager kernel)'}); results in {runner.path}", file=sys.stderr)
    if grid.share_prefill and not grid.shares_prefill:
        print("[fxbudget] prefill is not shared: it needs one-call prefill (no --chunk-size) on the eager kernel "
              "(--backend none)", file=sys.stderr)
    try:
        runner.run()
    except RuntimeError as e:  # a Ray cluster too small, unreachable, or a sample that kept losing its worker
        if args.ray is None:
            raise
        raise SystemExit(f"fxbudget compare --ray: {e}") from None
    wall = time.perf_counter() - start
    print(f"[fxbudget] done in {wall:.0f} s (compile {runner.compile_s:.0f} s, run {runner.run_s:.0f} s)",
          file=sys.stderr)
    path = report([args.out], sort=args.sort)
    rows = [r for r in load_rows([args.out]) if r["protocol"] in grid.protocols]
    print(f"\naccuracy, protocols side by side (mean [95% interval] (samples); rules by {args.sort}):\n")
    print(accuracy_table(rows, args.sort, by_setting=True))
    likelihood = likelihood_table(rows, args.sort, by_setting=True)
    if likelihood:
        print("\nanswer log-likelihood per token, rule minus the unmodified model on the same sample (nats; "
              "mean [95% interval] (samples)):\n")
        print(likelihood)
    print(f"\nreport (paired comparisons per budget): {path}\nplots, summary.csv, paired.csv: {path.parent}")
    return 0


def cmd_search(args) -> int:
    from .harness.malloc import tune_malloc
    from .harness.search import SearchConfig, import_optuna, load_average, search, summary_markdown
    from .models import load_model

    try:
        import_optuna()
    except ImportError as e:
        raise SystemExit(f"fxbudget search: {e}") from None
    _load_rule_files("search", args.rule_file)
    if len(args.protocol) != 1:
        raise SystemExit(f"fxbudget search: one --protocol per search, got {','.join(args.protocol)}")
    config = SearchConfig(model="", tasks=args.tasks, lengths=args.lengths, samples=args.samples, seed=args.seed,
                          budget=args.budget, protocol=args.protocol[0], trials=args.trials, baselines=args.rules,
                          holdout_samples=args.holdout_samples, holdout_seed=args.holdout_seed, name=args.name,
                          max_new_tokens=args.max_new_tokens)
    try:
        config.validate()
    except (ValueError, TypeError) as e:
        raise SystemExit(f"fxbudget search: {e}") from None
    _setup_threads(args.threads)
    if not args.default_malloc:
        tune_malloc()
    start, load_start = time.perf_counter(), load_average()
    model, tokenizer, config.model = load_model(args.model)
    command = shlex.join(["fxbudget", *args.argv])
    try:
        res = search(model, tokenizer, config.model, config, args.out, progress=not args.quiet, command=command)
    except ValueError as e:  # e.g. --out holds a study made with other settings
        raise SystemExit(f"fxbudget search: {e}") from None
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


def _ray_runner(args, grid):
    """The driver of a `--ray` run (it does not load the model: the workers do)."""
    from .harness.ray_runner import RayMissingError, RayOptions, RayRunner

    options = RayOptions(address=args.ray, workers=args.workers, threads=args.threads,
                         cpus_per_worker=1.0 if args.cpus_per_worker is None else args.cpus_per_worker,
                         gpus_per_worker=0.0 if args.gpus_per_worker is None else args.gpus_per_worker)
    try:
        return RayRunner(args.model, grid, args.out, shard=args.shard, progress=not args.quiet,
                         max_new_tokens=args.max_new_tokens, options=options, tune_malloc=not args.default_malloc)
    except (RayMissingError, ValueError) as e:
        raise SystemExit(f"fxbudget compare: {e}") from None


def cmd_report(args) -> int:
    from .harness.report import report

    try:
        path = report(args.dirs, args.out, sort=args.sort)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"fxbudget report: {e}") from None
    print(path.read_text())
    print(f"written: {path}")
    return 0


def rules_table() -> str:
    """Markdown table of the registered rules: name, description, hyperparameters with defaults."""
    import inspect

    from .rules import _REGISTRY, available

    lines = ["| rule | what it keeps | hyperparameters (defaults) |", "|---|---|---|"]
    for name in available():
        cls = _REGISTRY[name]
        doc = inspect.getdoc(sys.modules[cls.__module__]) or inspect.getdoc(cls) or ""
        summary = doc.split("\n")[0].split(":", 1)[-1].strip() if doc else ""
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls)
                           if f.default is not dataclasses.MISSING and not f.name.startswith("_"))
        lines.append(f"| `{name}` | {summary} | {fields or '-'} |")
    return "\n".join(lines)


def cmd_rules(args) -> int:
    _load_rule_files("rules", args.rule_file)
    print(rules_table())
    return 0


def cmd_inspect(args) -> int:
    import torch

    from .graph_summary import summary
    from .models import load_model

    _setup_threads(args.threads)
    model, tokenizer, _ = load_model(args.model, progress=False)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    try:
        text = summary(model, ids, rule=args.rule, budget=args.budget, layer=args.layer, full=args.full,
                       **_params(args.param).get(args.rule, {}))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"fxbudget inspect: {e}") from None
    print(text)
    return 0


def _joined(values) -> str:
    """A default as one would type it: argparse passes string defaults through the option's `type`."""
    return ",".join(map(str, values))


def _task_options(c, d, *, task_files: bool = True) -> None:
    """The task flags of `compare` (and `search`): model, tasks, lengths, samples, seed, protocol."""
    from .harness.runner import PROTOCOLS
    from .harness.tasks import TASKS

    c.add_argument("--model", default=None, help="local HF model directory or .gguf file (default: the embedded "
                   "Qwen2.5-Coder-0.5B-Instruct)")
    c.add_argument("--tasks", type=_names, default=_joined(d.tasks), help=f"comma-separated, from: {', '.join(TASKS)}")
    if task_files:
        c.add_argument("--task-file", action="append", default=[], help="a JSONL task file (context, question, "
                       "answer, optional answer_prefix); repeatable")
    c.add_argument("--lengths", type=_ints, default=_joined(d.lengths), help="context lengths in tokens")
    c.add_argument("--samples", type=int, default=d.samples, help="samples per task and length")
    c.add_argument("--seed", type=int, default=d.seed, help="seed of the generated task samples")
    c.add_argument("--protocol", type=_names, default=_joined(d.protocols), help=f"comma-separated, from: "
                   f"{', '.join(PROTOCOLS)}; several run in one pass (each protocol's prefill once per sample)")


def _rule_file_option(c) -> None:
    c.add_argument("--rule-file", action="append", default=[], help="a Python file registering rules (@register), "
                   "e.g. one written by `fxbudget search`; repeatable")


def _load_rule_files(command: str, paths: list[str]) -> None:
    from .rules import load_file

    for path in paths:
        try:
            load_file(path)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"fxbudget {command}: {e}") from None


def _run_options(c) -> None:
    """The run flags of `compare` (and `search`): answer length, threads, progress bar, malloc."""
    c.add_argument("--max-new-tokens", type=int, default=None, help="override the tasks' answer lengths")
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--default-malloc", action="store_true", help="keep glibc's default malloc (by default freed "
                   "heap pages are kept: large per-call temporaries then cost no page faults; see harness/malloc.py)")


def build_parser() -> argparse.ArgumentParser:
    from .harness.runner import Grid

    d = Grid()
    p = argparse.ArgumentParser(prog="fxbudget", description="Compare KV-cache eviction rules on one shared kernel "
                                "and budget.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compare", help="run a grid of rules x budgets x tasks x lengths; write results and a report",
                       formatter_class=_HelpFormatter)
    _task_options(c, d)
    c.add_argument("--rules", type=_names, default=_joined(d.rules),
                   help="'full' = the unmodified model (reference row); see `fxbudget rules`")
    c.add_argument("--budgets", type=_budgets, default=_joined(d.budgets), help="KV entries per layer and KV head "
                   "(128), or percentages of each sample's context tokens (12.5%%); one kind per run")
    c.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default: one call)")
    c.add_argument("--backend", default="none", choices=["none", "inductor", "aot_eager", "eager"],
                   help="'none' runs fxbudget's kernel eagerly; 'inductor' compiles it (slow first compiles on CPU)")
    c.add_argument("--no-share-prefill", action="store_true", help="run every rule's prefill separately")
    c.add_argument("--param", action="append", default=[], help="rule hyperparameter, e.g. snapkv.window=64")
    _rule_file_option(c)
    c.add_argument("--shard", type=_shard, default="0/1", help="run only part i/n of the samples")
    c.add_argument("--out", default="runs/compare", help="results folder (rerunning resumes)")
    c.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run the samples on Ray workers (needs the [ray] extra): 'auto' (the default ADDRESS) = the "
                   "running cluster (`ray start --head`), 'local' = a new Ray on this machine only, or an address "
                   "such as ray://HOST:10001; this process writes the results")
    c.add_argument("--workers", type=int, default=None, help="with --ray: workers to start, each loading the "
                   "model once (default: as many as the cluster has room for, at most one per sample)")
    c.add_argument("--cpus-per-worker", type=float, default=None, help="with --ray: CPUs each worker holds "
                   "(default: 1)")
    c.add_argument("--gpus-per-worker", type=float, default=None, help="with --ray: GPUs each worker holds "
                   "(default: 0 = CPU; more than 1 spreads the model's layers over them)")
    c.add_argument("--no-likelihood", action="store_true", help="skip the answer log-likelihood forward")
    c.add_argument("--sort", choices=["accuracy", "likelihood"], default="accuracy", help="order of the rules in "
                   "the tables")
    _run_options(c)
    c.set_defaults(func=cmd_compare)

    s = sub.add_parser("search", help="fit a `weighted` rule on calibration samples (Optuna), then compare it with "
                       "the built-in rules on held-out samples", formatter_class=_HelpFormatter)
    _task_options(s, d, task_files=False)
    s.add_argument("--budget", type=int, default=256, help="KV entries per layer and KV head")
    s.add_argument("--trials", type=int, default=50, help="completed trials in the study (rerunning with more "
                   "continues it)")
    s.add_argument("--rules", type=_names, default="streamingllm,h2o,snapkv,tova,knorm", help="the built-in rules "
                   "to beat on held-out samples")
    s.add_argument("--holdout-samples", type=int, default=8, help="held-out samples per task and length")
    s.add_argument("--holdout-seed", type=int, default=None, help="seed of the held-out samples (default: seed + "
                   "1000)")
    s.add_argument("--name", default=None, help="name of the found rule (default: searched_b<budget>)")
    s.add_argument("--out", default="runs/search", help="the study (study.db; rerunning resumes), the rule file, "
                   "the held-out results and search.md")
    s.add_argument("--summary", default=None, help="also write the summary (search.md) here, e.g. "
                   "benchmarks/rule_search.md")
    s.add_argument("--note", default=None, help="a line under the summary's title (e.g. that it is a smoke run)")
    _rule_file_option(s)
    _run_options(s)
    s.set_defaults(func=cmd_search)

    r = sub.add_parser("report", help="merge result folders (e.g. shards) into one report")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--out", default=None, help="where to write (default: the first folder)")
    r.add_argument("--sort", choices=["accuracy", "likelihood"], default="accuracy", help="order of the rules in "
                   "the tables")
    r.set_defaults(func=cmd_report)

    rl = sub.add_parser("rules", help="list the registered rules")
    _rule_file_option(rl)
    rl.set_defaults(func=cmd_rules)

    i = sub.add_parser("inspect", help="the rewritten attention of a model: SDPA calls rewritten per layer, the "
                       "kernel fingerprint and one layer's kernel", formatter_class=_HelpFormatter)
    i.add_argument("--model", default=None, help="local HF model directory or .gguf file (default: embedded)")
    i.add_argument("--rule", default="snapkv", help="see `fxbudget rules`")
    i.add_argument("--budget", type=int, default=64, help="KV entries per layer and KV head")
    i.add_argument("--tokens", type=int, default=16, help="length of the traced input")
    i.add_argument("--param", action="append", default=[], help="rule hyperparameter, e.g. snapkv.window=8")
    i.add_argument("--layer", type=int, default=None, help="whose kernel to print (default: the first "
                   "full-attention layer)")
    i.add_argument("--full", action="store_true", help="print the whole rewritten graph (every layer)")
    i.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # recorded by `search`
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
