"""The rewrite of each SDPA call fed by a budget cache into the shared kernel: compiled (`sdpa`, the graph pass) and
eager (`eager`, the same rewrite at call time), with one reading of the SDPA call's arguments (`sdpa_args`).

May import: `kernel`, `rules` (the rule interface), `checks`.
"""

from .sdpa import RewriteReport, rewrite

__all__ = ["RewriteReport", "rewrite"]
