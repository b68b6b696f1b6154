"""`python -m fxbudget.lmeval ARGS`: lm-eval's command line (`lm_eval ARGS`) with the `fxbudget` model registered.

lm-eval 0.4.13 has no plugin discovery, so its own `lm_eval` command does not know `--model fxbudget`; this does.
A bad `--model_args` or a missing lm-eval is one line on stderr and exit status 2, before any model is loaded.
"""

from __future__ import annotations

import sys

from . import ModelArgsError, require_lm_eval


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI on `argv` (default: this process's arguments). Returns the exit status."""
    try:
        require_lm_eval()
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    from . import model  # noqa: F401  (registers the model)

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except ModelArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
