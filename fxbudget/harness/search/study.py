"""The Optuna study of a search: its space, its first trials (the built-in rules' points), resuming, running."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ...kernel import DEFAULT_WINDOW
from ...rules import get
from ...rules.weighted import WEIGHTS, Weighted, builtin_points
from .calibration import CalibrationSample, objective
from .config import SearchConfig

INSTALL_HINT = "pip install 'flexbudget[search]'"
STUDY = "fxbudget-search"
MAX_SINK, MAX_POOL = 16, 15  # the search space's upper bounds for n_sink and pool (n_recent: budget // 2)


def import_optuna():
    """Optuna, or an ImportError saying how to install it (it is the optional extra `flexbudget[search]`)."""
    try:
        import optuna
    except ImportError:
        raise ImportError(f"fxbudget search needs Optuna: {INSTALL_HINT}") from None
    return optuna


def suggest(trial, budget: int) -> dict:
    """A point of the `weighted` family drawn by `trial` (the search space; documented in docs/search.md).

    Weights in [-1, 1] (the ranking ignores a positive factor), `n_sink` in [0, 16], `n_recent` in [0, budget // 2],
    `pool` odd in [1, 15].
    """
    p = {w: trial.suggest_float(w, -1.0, 1.0) for w in WEIGHTS}
    p["n_sink"] = trial.suggest_int("n_sink", 0, MAX_SINK)
    p["n_recent"] = trial.suggest_int("n_recent", 0, budget // 2)
    p["pool"] = trial.suggest_int("pool", 1, MAX_POOL, step=2)
    return p


def seed_points(budget: int) -> dict[str, dict]:
    """The family's points equal to built-in rules that lie in the search space: the study's first trials."""
    return {name: p for name, p in builtin_points(budget, DEFAULT_WINDOW).items()
            if p["n_recent"] <= budget // 2 and p["n_sink"] <= MAX_SINK and p["pool"] <= MAX_POOL}


def open_study(out: Path, config: SearchConfig):
    """Create or resume the study in `out/study.db`; a resumed study must have been made with the same data.

    Trials left running by a killed process are marked failed (one process runs a study at a time).
    """
    optuna = import_optuna()
    out.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'study.db'}")
    study = optuna.create_study(study_name=STUDY, storage=storage, load_if_exists=True, direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=config.seed))
    key = study.user_attrs.get("config")
    if key is None:
        study.set_user_attr("config", config.study_key())
        for name, p in seed_points(config.budget).items():
            study.enqueue_trial(p, user_attrs={"seeded_from": name})
    elif {"dtype": "float32", **key} != json.loads(json.dumps(config.study_key())):
        key = {"dtype": "float32", **key}  # a study stored before the dtype was keyed ran float32
        diff = {k: (key.get(k), v) for k, v in config.study_key().items() if key.get(k) != v}
        raise ValueError(f"{out / 'study.db'} holds a study made with other settings (study, now: {diff}); "
                         "use another --out")
    for t in study.get_trials(deepcopy=False):
        if t.state == optuna.trial.TrialState.RUNNING:
            storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
    return study


def complete_trials(study) -> list:
    optuna = import_optuna()
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def run_trials(study, model: nn.Module, calibration: list[CalibrationSample], config: SearchConfig, *,
               progress: bool = True) -> int:
    """Run trials until the study has `config.trials` completed ones; returns how many ran now."""
    from tqdm.auto import tqdm

    todo = max(0, config.trials - len(complete_trials(study)))
    if not todo:
        return 0
    bar = tqdm(total=todo, desc="trials", unit="trial", disable=not progress, dynamic_ncols=True)

    def run_one(trial):
        rule = Weighted(**suggest(trial, config.budget))
        value, per = objective(model, calibration, rule, config.budget, config.protocol)
        trial.set_user_attr("per_sample", per)
        return value

    def after(study, trial):
        bar.update(1)
        best = study.best_trial
        bar.set_postfix_str(f"best {best.value:.4f} (#{best.number})")

    try:
        study.optimize(run_one, n_trials=todo, callbacks=[after])
    finally:
        bar.close()
    return todo


def baseline_objectives(study, model, calibration, config: SearchConfig) -> dict[str, float]:
    """The calibration objective of each baseline rule itself (stored in the study: computed once)."""
    stored = dict(study.user_attrs.get("calibration_baselines", {}))
    for name in config.baselines:
        if name not in stored:
            stored[name] = objective(model, calibration, get(name), config.budget, config.protocol)[0]
            study.set_user_attr("calibration_baselines", stored)
    return {name: stored[name] for name in config.baselines}
