"""The whole search: calibration prefills, trials, the rule file, the held-out comparison."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from torch import nn

from ...rules import get, load_file
from ..runner import Runner, environment
from .calibration import calibration_set, objective, prefill_bytes
from .config import SearchConfig
from .study import baseline_objectives, complete_trials, open_study, run_trials
from .summary import SearchResult, write_rule_file
from .verdict import verdict


def search(model: nn.Module, tokenizer, model_name: str, config: SearchConfig, out: str | Path, *,
           progress: bool = True, command: str = "") -> SearchResult:
    """Run (or resume) a search and its held-out comparison; write the rule file and the report into `out`.

    Args:
        model, tokenizer, model_name: as `load_model` returns them.
        config: the search's settings.
        out: the study's folder (`study.db`, `<name>.py`, `holdout-t<trial>/`).
        progress: progress bars.
        command: the command line, recorded in the rule file and the summary.
    Returns:
        A `SearchResult`.
    """
    config.validate()
    if config.model != model_name:
        raise ValueError(f"config.model {config.model!r} is not the model given ({model_name!r})")
    env = environment(model)
    for name in ("device", "dtype"):  # the model's, recorded in the study key and the summary
        if getattr(config, name) is None:
            setattr(config, name, env[name])
        elif getattr(config, name) != env[name]:
            raise ValueError(f"config.{name} {getattr(config, name)!r} is not the model's ({env[name]!r})")
    out = Path(out)
    study = open_study(out, config)
    timings = {}
    t0 = time.perf_counter()
    calibration = calibration_set(model, tokenizer, config, progress=progress)
    timings["calibration_prefill_s"] = time.perf_counter() - t0
    mib = prefill_bytes(calibration) / 2**20
    if progress:
        print(f"[fxbudget] {len(calibration)} calibration prefills in {timings['calibration_prefill_s']:.0f} s, "
              f"{mib:.0f} MiB held", file=sys.stderr)
    t0 = time.perf_counter()
    new_trials = run_trials(study, model, calibration, config, progress=progress)
    timings["trials_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    baselines = baseline_objectives(study, model, calibration, config)
    timings["calibration_baselines_s"] = time.perf_counter() - t0
    best = study.best_trial
    n_complete = len(complete_trials(study))
    rule_file = write_rule_file(out / f"{config.name}.py", config, best, n_complete, model_name, command)
    load_file(rule_file, replace=True)
    # The file, not the trial's parameters, is what is evaluated: check it scores what the trial scored.
    reproduced = objective(model, calibration, get(config.name), config.budget, config.protocol)[0]
    del calibration  # the recorded prefills are large: free them before the held-out comparison
    holdout_dir = out / f"holdout-t{best.number}"
    t0 = time.perf_counter()
    runner = Runner(model, tokenizer, model_name, config.holdout_grid(get(config.name).params()), holdout_dir,
                    progress=progress, max_new_tokens=config.max_new_tokens)
    runner.run()
    timings["holdout_s"] = time.perf_counter() - t0
    from ..report import load_rows, report

    report([holdout_dir], sort="likelihood")
    rows = load_rows([holdout_dir])
    verdicts = {m: verdict(rows, config.name, m) for m in ("accuracy", "likelihood")}
    return SearchResult(config, study, rule_file, best, reproduced, baselines, holdout_dir, rows, verdicts, timings,
                        mib, env, command, model_name, new_trials)
