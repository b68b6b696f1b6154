"""The `fxbudget` command line: every subcommand's options (no torch import: `--help` answers at once)."""

from __future__ import annotations

import argparse

from ..checks import SLOT_DTYPES


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (and exit status 2): what is wrong, and where the help is."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _lengths(text: str) -> list[int]:
    """`1000,2000`: context lengths, each a positive int (argparse then names the flag and the help)."""
    values = _ints(text)
    bad = [v for v in values if v < 1]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"lengths must be positive ints (tokens), got {text!r}")
    return values


def _budgets(text: str) -> list[int | str]:
    """`128,256` (KV entries), `256MiB,1GiB` (bytes of KV cache per sequence) or `12.5%,25%` (fractions of each
    sample's context)."""
    from ..harness.grid import budget_kind

    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        spec = item if item.endswith(("%", "B")) else None
        if spec is None:
            try:
                spec = int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"a budget is an int, a size such as 256MiB or a percentage such as "
                                                 f"12.5%, got {item!r}") from None
        try:
            budget_kind(spec)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        out.append(spec)
    return out


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` once: not where the help already names its default, nor for None/False/empty."""

    def _get_help_string(self, action):
        text, d = action.help or "", action.default
        if "default" in text or d is None or d is False or d is argparse.SUPPRESS or d == []:
            return text
        return super()._get_help_string(action)


def _backend(text: str) -> str | None:
    return None if text == "none" else text


def _joined(values) -> str:
    """A default as one would type it: argparse passes string defaults through the option's `type`."""
    return ",".join(map(str, values))


def _model_options(c) -> None:
    """Which model, on what device, in what dtype: `compare`, `search` and `inspect`."""
    from ..models.devices import DEVICES, DTYPES

    from ..models.embedded import EMBEDDED

    c.add_argument("--model", default=None, help="a local HF model directory, a .gguf file, a hub id such as "
                   "Qwen/Qwen2.5-0.5B-Instruct (through the HF cache; HF_HUB_OFFLINE=1: the cache only) or an "
                   f"embedded model: {', '.join(EMBEDDED)} (default: the embedded Qwen2.5-Coder-0.5B-Instruct)")
    c.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit (default: main)")
    c.add_argument("--trust-remote-code", action="store_true", help="let a model run its own code (hub models "
                   "that ship modelling code); never without this flag")
    c.add_argument("--device", default=None, help=f"{', '.join(DEVICES)} (default: cuda when a GPU is visible, "
                   "else cpu)")
    c.add_argument("--dtype", default=None, help=f"{', '.join(DTYPES)}, or bf16, fp16, fp32, or auto (bfloat16 on "
                   "a GPU or a CPU with native bf16: avx512_bf16, amx_bf16; else float32) (default: bfloat16 on a GPU, "
                   "float32 on the CPU; the start line says which and why)")


def _task_options(c, d, *, task_files: bool = True) -> None:
    """The task flags of `compare` (and `search`): model, tasks, lengths, samples, seed, protocol."""
    from ..harness.grid import PROTOCOLS
    from ..harness.tasks import TASK_FILE_FIELDS, TASKS

    _model_options(c)
    if task_files:
        c.add_argument("--tasks", type=_names, default=None, help=f"comma-separated, from: {', '.join(TASKS)}; "
                       f"see `fxbudget tasks` (default: {_joined(d.tasks)}, unless --task-file is given: then only "
                       "the files run)")
        fields = "; ".join(f"{k}: {v}" for k, v in TASK_FILE_FIELDS.items())
        c.add_argument("--task-file", action="append", default=[], help="a JSONL task file, one JSON object per "
                       f"line with the fields {fields}; meta: an object of your own, kept with the sample (any other "
                       "field is refused). Repeatable")
    else:
        c.add_argument("--tasks", type=_names, default=_joined(d.tasks), help=f"comma-separated, from: "
                       f"{', '.join(TASKS)}")
    c.add_argument("--lengths", type=_lengths, default=_joined(d.lengths), help="context lengths in tokens of the "
                   "generated tasks")
    c.add_argument("--samples", type=_positive, default=None, help=f"samples per task and length (default: {d.samples})"
                   + ("; also the most lines of each task file run (default: all)" if task_files else ""))
    c.add_argument("--seed", type=int, default=d.seed, help="seed of the generated task samples")
    c.add_argument("--protocol", type=_names, default=_joined(d.protocols), help=f"comma-separated, from: "
                   f"{', '.join(PROTOCOLS)}; several run in one pass (each protocol's prefill once per sample). The "
                   "default, query-agnostic (kvpress's), compresses the context BEFORE the question is seen: rules "
                   "that choose with the latest queries (snapkv, tova, pyramidkv, chunkkv, ...) were designed with "
                   "the question there and can score 0 on retrieval without it. query-aware compresses context and "
                   "question together (SnapKV's setting); streaming evicts on every call. Compare rules within one "
                   "protocol; run both with --protocol query-agnostic,query-aware. multi-request and multi-turn ask several "
                   "questions of one compressed context (tasks shared_niah, shared_passkey): one row per request")


def _rule_file_option(c) -> None:
    c.add_argument("--rule-file", action="append", default=[], help="a Python file registering rules (@register), "
                   "e.g. one written by `fxbudget search`; repeatable")


def _run_options(c) -> None:
    """The run flags of `compare` (and `search`): answer length, threads, progress bar, malloc."""
    c.add_argument("--max-new-tokens", type=int, default=None, help="override the tasks' answer lengths")
    c.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--default-malloc", action="store_true", help="keep glibc's default malloc (by default freed "
                   "heap pages are kept: large per-call temporaries then cost no page faults; see harness/malloc.py)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand; the chosen one is `args.command`."""
    from ..harness.grid import Grid

    from .. import __version__

    d = Grid()
    p = _Parser(prog="fxbudget", description="Compare KV-cache eviction rules on one shared kernel "
                                "and budget.")
    p.add_argument("--version", action="version", version=f"fxbudget {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compare", help="run a grid of rules x budgets x tasks x lengths; write results and a report",
                       formatter_class=_HelpFormatter)
    _task_options(c, d)
    c.add_argument("--rules", type=_names, default=_joined(d.rules),
                   help="'full' = the unmodified model (reference row); see `fxbudget rules`")
    c.add_argument("--decompose", type=_names, default=None, metavar="RULES",
                   help="comma-separated rules of --rules to split into score and protection: adds "
                        "noprotect:<rule>, protectonly:<rule> and random; the report says where each one's gain "
                        "comes from")
    c.add_argument("--budgets", type=_budgets, default=_joined(d.budgets), help="KV entries per layer and KV head "
                   "(128), bytes of KV cache per sequence (256MiB: the most entries that fit, at the run's dtype), "
                   "or percentages of each sample's context tokens (12.5%%); one kind per run")
    c.add_argument("--chunk-size", type=int, default=None, help="prefill chunk size (default: one call)")
    c.add_argument("--backend", default="none", choices=["none", "inductor", "aot_eager", "eager"],
                   help="'none' runs fxbudget's kernel eagerly; 'inductor' compiles it (slow first compiles on CPU)")
    c.add_argument("--interval", type=int, default=d.interval, help="streaming protocol: decode steps between "
                   "evictions (kvpress DecodingPress's compression_interval; target = the budget). Between evictions "
                   "the cache grows by up to interval - 1 entries beyond the budget (allocated up front) and the "
                   "rule's scoring is skipped; 1 (default) evicts on every call")
    c.add_argument("--signals", choices=["all"], default=None, help="the kernel's signal set: by default what the "
                   "run's rules read (one set for every rule, recorded in each row); 'all' measures every signal, so "
                   "the rows' cost columns pool with other runs'")
    c.add_argument("--slot-dtype", choices=SLOT_DTYPES, default="model", help="how the cache stores keys and "
                   "values (a kernel setting): the model's dtype, quantized with a float32 scale per entry and head, or "
                   "bfloat16 (16-bit slots of a float32 model); a byte budget buys more entries in fewer bits")
    c.add_argument("--no-share-prefill", action="store_true", help="run every rule's prefill separately")
    c.add_argument("--param", action="append", default=[], help="rule hyperparameter, e.g. snapkv.window=64")
    _rule_file_option(c)
    c.add_argument("--shard", type=_shard, default="0/1", help="run only part i/n of the samples")
    c.add_argument("--out", default="runs/compare", help="results folder (rerunning resumes)")
    c.add_argument("--dry-run", action="store_true", help="check every option, build the samples and print the "
                   "plan (rows, tokens, the estimate line), then stop: no model weights loaded, nothing written; "
                   "--device is checked by name only, so a GPU command can be checked on a CPU machine")
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

    r = sub.add_parser("report", help="merge result folders (e.g. shards) into one report")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--out", default=None, help="where to write (default: the first folder)")
    r.add_argument("--sort", choices=["accuracy", "likelihood"], default="accuracy", help="order of the rules in "
                   "the tables")

    rl = sub.add_parser("rules", help="list the registered rules")
    _rule_file_option(rl)

    sub.add_parser("tasks", help="list the generated tasks: what each measures, what its samples hold, and the "
                   "fields of a --task-file")

    i = sub.add_parser("inspect", help="the rewritten attention of a model: SDPA calls rewritten per layer, the "
                       "kernel fingerprint (read from the on-disk cache `compare` shares, else traced and stored) and "
                       "one layer's kernel", formatter_class=_HelpFormatter)
    _model_options(i)
    i.add_argument("--rule", default="snapkv", help="see `fxbudget rules`")
    i.add_argument("--budget", type=int, default=64, help="KV entries per layer and KV head")
    i.add_argument("--tokens", type=int, default=16, help="length of the traced input")
    i.add_argument("--param", action="append", default=[], help="rule hyperparameter, e.g. snapkv.window=8")
    i.add_argument("--layer", type=int, default=None, help="whose kernel to print (default: the first "
                   "full-attention layer)")
    i.add_argument("--full", action="store_true", help="print the whole rewritten graph (every layer)")
    i.add_argument("--signals", choices=["all", "rule"], default="all", help="the kernel's signal set: 'all' "
                   "(default) every signal, the kernel every rule can run; 'rule' what the rule reads (as "
                   "fxbudget.compile and a compare run of this rule alone)")
    i.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p


