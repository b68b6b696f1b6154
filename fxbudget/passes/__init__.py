"""Graph passes of the fxbudget backend."""

from .sdpa import RewriteReport, rewrite

__all__ = ["RewriteReport", "rewrite"]
