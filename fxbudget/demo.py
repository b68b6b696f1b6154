"""`make demo`: the demo grid on the embedded model, then its tables, report and plots.

    python -m fxbudget.demo [any `fxbudget compare` option, e.g. --samples 1 --out runs/quick]

Passkey retrieval and multi-key needle-in-a-haystack (RULER) at ~1K tokens, four samples each (needles at depths
1/8, 3/8, 5/8, 7/8): the unmodified model (full cache) as the reference row, then streamingllm, h2o, snapkv, tova
and knorm keeping 12.5% and 25% of each sample's context, under both protocols side by side: query-agnostic (the
rule never sees the question) and query-aware (it does; SnapKV's setting). Every row also scores the gold answer's
log-likelihood. Why these budgets and samples: docs/compare.md, "make demo" (at 12.5-25% the two protocols rank the rules
differently on this model; eight paired samples per cell are the fewest at which a paired test over five rules can
separate two of them: 2/2^8 x 4 rivals < 0.05). One shared prefill per protocol and sample, the cache branched per
rule and budget. About 8 minutes on an idle 2-core CPU with both cores (`make demo`: torch's own thread count),
11 with one thread; rerunning resumes (completed rows are skipped). Results:
runs/demo/ (with `--model M`: runs/demo_M/).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .cli import main as cli_main

DEMO_ARGS = ["compare", "--tasks", "passkey,niah_multikey", "--lengths", "1000",
             "--rules", "full,streamingllm,h2o,snapkv,tova,knorm", "--budgets", "12.5%,25%", "--samples", "4",
             "--protocol", "query-agnostic,query-aware", "--out", "runs/demo"]


def demo_args(extra: list[str]) -> list[str]:
    """`DEMO_ARGS` then `extra`; with `--model M` and no `--out`, the folder is `runs/demo_M` (one folder holds one
    grid: `compare` refuses a folder holding another model's rows)."""
    args = list(DEMO_ARGS)
    model = next((x.split("=", 1)[1] if "=" in x else extra[i + 1] for i, x in enumerate(extra)
                  if x.split("=", 1)[0] == "--model" and ("=" in x or i + 1 < len(extra))), None)
    if model and not any(x.split("=", 1)[0] == "--out" for x in extra):
        args[args.index("runs/demo")] = "runs/demo_" + "".join(c if c.isalnum() or c in "-." else "_"
                                                               for c in Path(model).name)
    return args + extra


def main(argv: list[str] | None = None) -> int:
    return cli_main(demo_args(list(sys.argv[1:] if argv is None else argv)), whole_process=argv is None)


if __name__ == "__main__":
    sys.exit(main())
