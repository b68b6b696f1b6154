"""The public names README, docs and tests use (issue 40: moving modules changes none of them). A name added to the
API is added here; one that disappears fails, naming it."""

import importlib

import pytest

# module -> names it must provide
PUBLIC = {
    "fxbudget": ["BudgetCache", "BudgetForward", "NoBudgetAttentionError", "budget_attention", "compile",
                 "frozen_runner", "inspect", "kernel_fingerprint", "make_backend", "rules", "__version__"],
    "flexbudget": ["compile", "BudgetCache", "rules"],
    "fxbudget.api": ["compile", "frozen_runner", "inspect", "kernel_fingerprint", "BudgetCache", "BudgetForward",
                     "layer_devices"],
    "fxbudget.rules": ["AdaKV", "Chunk", "NoProtect", "ProtectOnly", "Pyramid", "Rule", "Signals", "available", "canonical", "get", "load_file",
                       "plain_generation_rules", "pyramid_budgets", "recent", "register", "rule_fields",
                       "wrapper_prefixes"],
    "fxbudget.models": ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_WEIGHTS", "default_cache_dir", "default_model_available",
                        "embedded_available", "load_default", "load_embedded", "load_model", "load_tokenizer",
                        "model_name"],
    "fxbudget.cache": ["BudgetCache", "BudgetLayer", "LAYER_STATE"],
    "fxbudget.lmeval": ["FxBudgetLM"],
    "fxbudget.kernel": ["budget_attention", "DEFAULT_BLOCK", "DEFAULT_WINDOW"],
    "fxbudget.harness.kvzip_protocol": ["compress"],
    "fxbudget.harness.likelihood": ["rule_answer_logprobs"],
    "fxbudget.harness.malloc": ["tune_malloc"],
    "fxbudget.cli": ["main"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module):
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert missing == [], f"{module} lost {missing}"


def test_flexbudget_is_fxbudget():
    import flexbudget
    import fxbudget
    assert flexbudget is fxbudget and flexbudget.compile is fxbudget.api.compile


def test_dir_lists_the_lazy_names():
    import fxbudget
    assert set(fxbudget.__all__) <= set(dir(fxbudget))
