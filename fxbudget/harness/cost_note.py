"""The line above the report's cost table: what its times are (the eager kernel or a compiled one, on how many torch
threads of which device) and where the benchmarks separate the shared kernel's own overhead from a rule's cost."""

from __future__ import annotations

# benchmarks/RESULTS.md: "overhead vs plain SDPA" (the kernel against the unmodified attention) and "fairness
# spread" (rules against each other on the same kernel).
OVERHEAD = "benchmarks/results/overhead.md"
SPREAD = "benchmarks/results/fairness_spread.md"


def _kernel(backends: set) -> str:
    named = sorted(str(b) for b in backends if b not in (None, "none"))
    eager = any(b in (None, "none") for b in backends)
    parts = (["fxbudget's eager kernel (`--backend none`, no compilation)"] if eager else []) + \
        [f"the kernel compiled with `{b}`" for b in named]
    return " and ".join(parts)


def cost_note(rows: list[dict]) -> str:
    """One paragraph: the times' kernel, threads and device, and why an evicting rule can cost more than the
    unmodified model (the kernel measures every signal for every candidate; eager on a CPU that is not free)."""
    threads = sorted({str(r.get("threads")) for r in rows})
    devices = sorted({str(r.get("device")) for r in rows})
    plural = "" if threads == ["1"] else "s"
    return (f"Times are wall-clock seconds of {_kernel({r.get('backend') for r in rows})}, on "
            f"{' / '.join(threads)} torch thread{plural} of {' / '.join(devices)}, measured once per sample while the "
            "run went (not a benchmark). An evicting rule runs fxbudget's shared kernel, which measures every "
            "signal for every candidate whatever the rule, and the unmodified model does not; so a rule's time here "
            "is the kernel's overhead plus the rule's own ops. The repository's benchmarks separate the two "
            f"(`benchmarks/RESULTS.md`): the kernel against plain attention in `{OVERHEAD}`, the rules against each "
            f"other on the same kernel in `{SPREAD}`.")
