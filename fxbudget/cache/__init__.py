"""The budget cache: `BudgetCache`, its per-layer slots and state (`budget_cache`), the cache built for a model and
its budget checks (`for_model`), the RoPE frequencies rules read (`rope`), and the cache's keyword (`keyword`).

May import: `kernel`, `passes` (the eager interceptor a cache update requires), `rules`, `models`, `checks`.
"""

from .budget_cache import LAYER_STATE, BudgetCache, BudgetLayer

__all__ = ["LAYER_STATE", "BudgetCache", "BudgetLayer"]
