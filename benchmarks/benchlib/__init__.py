"""What the benchmark scripts share, split by what it does (no fxbudget import at module level):

- `env`: the machine, threads, allocator and command a result file's header states (`env_info`, `header_lines`);
- `timing`: interleaved timing and its statistics (`interleaved`, `paired_ratio`, `fmt_ratio`, ...);
- `output`: markdown tables and result files (`md_table`, `write_md`, `emit`, `analysis_link`);
- `cases`: what is timed: one attention layer (`LayerCase`) or a model (`bench_model`).

Scripts run as `python benchmarks/<name>.py` (or `benchmarks/studies/<name>.py`) put `benchmarks/` on `sys.path` and
import `from benchlib.env import ...`. Generated reports hold only what their script computed; analysis lives beside
them in a hand-written `<name>.analysis.md` (`output.analysis_link`), which quotes only numbers from the generated
file.
"""
