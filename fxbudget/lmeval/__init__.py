"""lm-evaluation-harness integration: the lm-eval model `fxbudget` (`FxBudgetLM`), docs/lmeval.md.

Needs the `[lmeval]` extra (`pip install 'flexbudget[lmeval]'`). Importing this package registers the model with
lm-eval, so `lm_eval.simple_evaluate(model="fxbudget", model_args=...)` works after `import fxbudget.lmeval`;
`python -m fxbudget.lmeval --model fxbudget ...` is lm-eval's command line with the model registered (lm-eval
0.4.13 discovers no plugins; later releases find it through the `lm_eval.models` entry point, so plain
`lm_eval --model fxbudget` works there). Without lm-eval, this package still imports (the rest of fxbudget never
needs it) and `FxBudgetLM` raises an ImportError naming the extra.

May import: `harness`, `api` and every package below them.
"""

from __future__ import annotations

import importlib.util

from .options import INSTALL_HINT, ModelArgsError

__all__ = ["FxBudgetLM", "INSTALL_HINT", "ModelArgsError", "require_lm_eval"]


def require_lm_eval() -> None:
    """Raise an ImportError naming the extra to install if lm-evaluation-harness is missing."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ImportError(f"fxbudget's lm-eval model needs lm-evaluation-harness, which is not installed: "
                          f"{INSTALL_HINT}")


def __getattr__(name: str):
    if name == "FxBudgetLM":
        require_lm_eval()
        from .model import FxBudgetLM

        return FxBudgetLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if importlib.util.find_spec("lm_eval") is not None:
    from .model import FxBudgetLM  # noqa: E402,F401  (registers "fxbudget" with lm-eval)
