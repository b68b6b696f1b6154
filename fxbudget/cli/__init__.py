"""The `fxbudget` command: `compare` (the comparison grid), `search` (fit a rule), `report`, `rules`, `inspect`.

    fxbudget compare --tasks passkey,niah_multikey --lengths 2000 --budgets 64,128,256 --samples 3 --out runs/demo
    fxbudget compare --budgets 12.5%,25%,50% --protocol query-agnostic,query-aware --out runs/both
    fxbudget compare --model Qwen/Qwen2.5-0.5B-Instruct --device cuda --dtype bfloat16 --out runs/gpu
    fxbudget search --tasks passkey,niah_multikey --lengths 2000 --samples 4 --budget 256 --trials 50 --out runs/s
    fxbudget report runs/a runs/b --out runs/merged --sort likelihood
    fxbudget rules
    fxbudget tasks
    fxbudget --version
    fxbudget inspect --rule snapkv --budget 64 --tokens 16 [--layer 3] [--full]

Modules: `parser` (the options), `preflight` (what is checked before a model loads), one module per command
(`compare`, `search`, `info`: report, rules, tasks, inspect), `names` (rule, task, protocol and dtype names),
`sizes` (the size checks and the time estimate), `folder` (one `--out` holds one grid) and `rules_table`. torch and transformers are imported by the
commands that need them, not here.

May import every package (`harness`, `api` and all below them); nothing imports it but `demo`.
"""

from __future__ import annotations

import importlib
import os
import sys

from .parser import build_parser
from .preflight import UsageError

_COMMANDS = {"compare": ("compare", "cmd_compare"), "search": ("search", "cmd_search"),
             "report": ("info", "cmd_report"), "rules": ("info", "cmd_rules"), "tasks": ("info", "cmd_tasks"),
             "inspect": ("info", "cmd_inspect")}


def main(argv: list[str] | None = None, *, whole_process: bool | None = None) -> int:
    """Run the `fxbudget` command line.

    Args:
        argv: the arguments (None: `sys.argv[1:]`).
        whole_process: whether this command is the whole process, so that its closing line counts from the process
            start (None: when `argv` is None, i.e. run as `fxbudget ...`).
    Returns:
        The exit status: 0, 2 for a bad input (one line on stderr saying what to do), 130 after Ctrl-C (one line;
        `compare` says what is saved and how to resume).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # recorded by `search`
    args.is_process = argv is None if whole_process is None else whole_process
    module, name = _COMMANDS[args.command]
    try:
        command = getattr(importlib.import_module(f".{module}", __name__), name)
        return command(args)
    except UsageError as e:
        print(f"fxbudget {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before `compare` runs rows (it says what it saved itself), or another command
        print(f"fxbudget {args.command}: interrupted" + (" before any row ran; nothing written"
                                                          if args.command == "compare" else ""), file=sys.stderr)
        return 130


__all__ = ["UsageError", "build_parser", "main"]
