"""FlexBudget: compare KV-cache eviction rules on one shared, compiled kernel, then run the winner.

    model = fxbudget.compile(model, rule="snapkv", budget=1024)

`import fxbudget` is cheap: the API (and with it torch and transformers) is imported on first use of any name below,
so the `fxbudget` command answers `--help` without waiting for them. That first use also registers the `fxbudget`
Dynamo backend and the `fxbudget_sdpa` attention implementation; `import fxbudget.api` does so explicitly (e.g.
before `torch.compile(model, backend="fxbudget")` with nothing else of fxbudget used yet).
"""

import importlib

__version__ = "0.1.0"

# name -> module that defines it (imported on first access, PEP 562)
_LAZY = {
    "BudgetCache": "cache", "BudgetForward": "api", "NoBudgetAttentionError": "compiler.backend",
    "budget_attention": "kernel", "compile": "api", "frozen_runner": "api", "inspect": "api",
    "kernel_fingerprint": "api", "make_backend": "compiler.backend",
}

__all__ = [*sorted(_LAZY), "rules"]


def __getattr__(name: str):
    if name == "rules":
        importlib.import_module(".api", __name__)  # rules are used through the API: register it with them
        return importlib.import_module(".rules", __name__)
    if name in _LAZY:
        api = importlib.import_module(".api", __name__)  # registers the backend and the attention implementation
        module = api if _LAZY[name] == "api" else importlib.import_module(f".{_LAZY[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
