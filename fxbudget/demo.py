"""`make demo`: the default comparison grid on the embedded model, then its table, report and plots.

    python -m fxbudget.demo [any `fxbudget compare` option, e.g. --samples 1 --out runs/quick]

Passkey retrieval and multi-key needle-in-a-haystack (RULER) at ~2K tokens; the unmodified model (full cache) as
the reference row, then streamingllm, h2o, snapkv, tova and knorm at budgets 128/256/512/1024 (6-50% of the
context), query-agnostic protocol, three samples per task. The prefill is computed once per sample and the cache
branched per rule and budget. About 9 minutes on a 2-core CPU; rerunning resumes (completed rows are skipped).
Results: runs/demo/.
"""

from __future__ import annotations

import sys

from .cli import main as cli_main

DEMO_ARGS = ["compare", "--tasks", "passkey,niah_multikey", "--lengths", "2000",
             "--rules", "full,streamingllm,h2o,snapkv,tova,knorm", "--budgets", "128,256,512,1024", "--samples", "3",
             "--out", "runs/demo"]


def main(argv: list[str] | None = None) -> int:
    return cli_main(DEMO_ARGS + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
