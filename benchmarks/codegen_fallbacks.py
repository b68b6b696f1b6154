"""The calls Inductor leaves outside Triton, per graph and target (sm_90, sm_80, gfx942, gfx90a), in both dtypes.

Lowers every case of the codegen leg (`tests/test_cuda_codegen.CASES`) to Triton source only (no cubins or hsacos:
the choices are made before Triton compiles) with the fake devices of `tests/fake_cuda.py` and `tests/fake_hip.py`,
and writes the table docs/gpu-internals.md quotes, with the Triton kernel counts and the HIP-only hints, to
`benchmarks/results/codegen_fallbacks.md`. Needs the codegen venv (torch's CUDA build, the pinned pair):

    OMP_NUM_THREADS=1 .venv-cuda/bin/python benchmarks/codegen_fallbacks.py    # 56 lowerings, ~4.5 min of one core
"""

from __future__ import annotations

import copy
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fake_cuda  # noqa: E402
import fake_hip  # noqa: E402
from test_cuda_codegen import CASES, VARIANTS, traced  # noqa: E402

TARGETS = {"sm_90": lambda gm, s: fake_cuda.lower(gm, s, sm=90, cubins=False),
           "sm_80": lambda gm, s: fake_cuda.lower(gm, s, sm=80, cubins=False),
           "gfx942": lambda gm, s: fake_hip.lower(gm, s, arch="gfx942", hsaco=False),
           "gfx90a": lambda gm, s: fake_hip.lower(gm, s, arch="gfx90a", hsaco=False)}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "codegen_fallbacks.md")


def main() -> None:
    import torch
    import triton

    rows, start = [], time.process_time()
    for case in CASES:
        for variant in VARIANTS:
            gm, specs = traced(case, variant)
            for target, lower in TARGETS.items():
                low = lower(copy.deepcopy(gm), specs)
                code = "\n".join(low.source)
                rows.append((case, variant, target, len(low.kernels), ", ".join(low.fallbacks) or "none",
                             ", ".join(e.removeprefix("extern_kernels.") for e in low.externs) or "none",
                             code.count("tt.pointer_range"), len(fake_hip.dot_kernels(code))))
                print(*rows[-1], sep=" | ", flush=True)
    lines = [f"# Calls outside Triton per graph and target (torch {torch.__version__}, Triton {triton.__version__})",
             "", "Written by `benchmarks/codegen_fallbacks.py` (Triton source only; fake devices of tests/fake_cuda.py "
             "and tests/fake_hip.py).", "",
             "| graph | dtype | target | Triton kernels | ATen fallbacks | extern kernels | pointer_range hints "
             "| kernels with tl.dot |", "|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    same = {(r[0], r[4], r[5]) for r in rows}
    lines += ["", f"Distinct (graph, fallbacks, externs): {len(same)} for {len(CASES)} graphs "
              f"({'the same for every dtype and target' if len(same) == len(CASES) else 'they differ: see the rows'}).",
              f"{len(rows)} lowerings, {time.process_time() - start:.0f} s of CPU (this process)."]
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
