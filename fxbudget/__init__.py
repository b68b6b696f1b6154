"""FlexBudget: compare KV-cache eviction rules on one shared, compiled kernel, then run the winner.

    model = fxbudget.compile(model, rule="snapkv", budget=1024)
"""

from . import rules
from .api import BudgetForward, compile, frozen_runner, inspect, kernel_fingerprint
from .backend import NoBudgetAttentionError, make_backend
from .cache import BudgetCache
from .kernel import budget_attention

__version__ = "0.1.0"

__all__ = [
    "BudgetCache", "BudgetForward", "NoBudgetAttentionError", "budget_attention", "compile", "frozen_runner",
    "inspect", "kernel_fingerprint", "make_backend", "rules",
]
