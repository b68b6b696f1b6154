"""Rule search (`fxbudget search`): fit a `weighted` rule (rules/weighted.py) on calibration samples, then compare it on held-out ones.

Every rule is a score over the same signals, and a sample's prefill is recorded once and branched per rule in
milliseconds (`branch.py`), so a search over rules costs no prefill per trial: each calibration sample's shared
prefill runs once and stays in memory for the whole study; a trial scores its candidate rule on every calibration
sample with `rule_answer_logprobs` (branch, the question, the teacher-forced answer). The objective is the mean over
calibration samples of the gold answer's mean log-probability per token (the likelihood metric of the reports).
Training-free: a handful of scalars, no gradient, no weight change.

The study (Optuna, TPE sampler seeded with `--seed`) lives in `out/study.db`: rerunning resumes it, and `--trials`
is the total number of completed trials. Its first trials are the family's points equal to built-in rules.
The best trial is written as an ordinary rule file, then `compare`'s Runner runs it against the built-in rules on
held-out samples (the generators' samples of another seed, never seen by the search) at the searched budget, and the
paired test of the report says whether it beats the best built-in rule. The calibration objective is reported next
to the held-out one, so a search that overfits shows as such.

Modules: `config` (what a search fits on), `calibration` (the recorded prefills and the objective), `study` (Optuna),
`verdict` (the held-out judgement), `summary` (the rule file and search.md), `run` (the whole command).
"""

from .calibration import CalibrationSample, calibration_set, objective, prefill_bytes
from .config import SearchConfig
from .run import SearchResult, search
from .study import (INSTALL_HINT, MAX_POOL, MAX_SINK, STUDY, baseline_objectives, complete_trials, import_optuna,
                    open_study, run_trials, seed_points, suggest)
from .summary import load_average, summary_markdown, write_rule_file
from .verdict import holdout_means, verdict

__all__ = ["INSTALL_HINT", "MAX_POOL", "MAX_SINK", "STUDY", "CalibrationSample", "SearchConfig", "SearchResult",
           "baseline_objectives", "calibration_set", "complete_trials", "holdout_means", "import_optuna",
           "load_average", "objective", "open_study", "prefill_bytes", "run_trials", "search", "seed_points",
           "suggest", "summary_markdown", "verdict", "write_rule_file"]
