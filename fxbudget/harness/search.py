"""Rule search: fit a `weighted` rule (rules/weighted.py) on calibration samples, then compare it on held-out ones.

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
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

import torch
from torch import Tensor, nn

from ..checks import check_int
from ..kernel import DEFAULT_WINDOW
from ..rules import _LOADED, Rule, available, get, load_file
from ..rules.weighted import WEIGHTS, Weighted, builtin_points
from .branch import SharedPrefill, shared_prefill
from .likelihood import rule_answer_logprobs
from .runner import REFERENCE, Grid, Runner, environment
from .tasks import answer_ids, chat_ids, make_samples

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


@dataclass
class SearchConfig:
    """What a search fits on and how it is judged. The fields up to `protocol` define the study (a resumed study
    must match them); the others may change between runs."""

    model: str
    tasks: list[str]
    lengths: list[int]
    samples: int
    seed: int
    budget: int
    protocol: str = "query-agnostic"
    trials: int = 50
    baselines: list[str] = field(default_factory=lambda: ["streamingllm", "h2o", "snapkv", "tova", "knorm"])
    holdout_samples: int = 8
    holdout_seed: int | None = None  # None: seed + 1000
    name: str | None = None  # None: searched_b<budget>
    max_new_tokens: int | None = None

    STUDY_FIELDS = ("model", "tasks", "lengths", "samples", "seed", "budget", "protocol")

    def __post_init__(self):
        if self.holdout_seed is None:
            self.holdout_seed = self.seed + 1000
        if self.name is None:
            self.name = f"searched_b{self.budget}"

    def validate(self) -> None:
        if self.holdout_seed == self.seed:
            raise ValueError("the held-out seed must differ from the calibration seed (the samples would be the same)")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"rule name must be lower-case letters, digits and '_', got {self.name!r}")
        for name in ("samples", "budget", "trials", "holdout_samples"):
            check_int(name, getattr(self, name))
        if self.name in available() and self.name not in {n for _, names in _LOADED.values() for n in names}:
            raise ValueError(f"rule name {self.name!r} is taken by a registered rule; choose another --name")
        if REFERENCE in self.baselines or self.name in self.baselines:
            raise ValueError(f"baselines are built-in rules to beat; {REFERENCE!r} (the reference row) and the "
                             "searched rule are added by the search")
        # The held-out grid's checks (tasks, lengths, protocol, the baselines), `weighted` standing for the searched
        # rule: every rule of the comparison must use its observation window, the kernel default.
        grid = self.holdout_grid()
        grid.rules[-1] = "weighted"
        grid.validate()

    def study_key(self) -> dict:
        return {k: getattr(self, k) for k in self.STUDY_FIELDS} | {"family": "weighted", "window": DEFAULT_WINDOW}

    def holdout_grid(self, params: dict | None = None) -> Grid:
        """The held-out comparison: the reference, the baselines and the searched rule on the held-out seed."""
        return Grid(tasks=list(self.tasks), lengths=list(self.lengths), rules=[REFERENCE, *self.baselines, self.name],
                    budgets=[self.budget], samples=self.holdout_samples, seed=self.holdout_seed,
                    protocols=[self.protocol], rule_params={self.name: params} if params else {})


@dataclass
class CalibrationSample:
    """One calibration sample: its recorded shared prefill and the question and gold answer ids."""

    task: str
    length: int
    seed: int
    prefill: SharedPrefill
    question: Tensor
    answer: Tensor


def calibration_set(model: nn.Module, tokenizer, config: SearchConfig, *, progress: bool = True
                    ) -> list[CalibrationSample]:
    """Generate the calibration samples and run each one's shared prefill once.

    Args:
        model: the unmodified model.
        tokenizer: its tokenizer.
        config: tasks, lengths, samples per task and length, seed and protocol (what is prefilled).
        progress: a progress bar over the prefills.
    Returns:
        The samples in task, length, index order.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    todo = [(t, n) for t in config.tasks for n in config.lengths]
    out = []
    with tqdm(total=len(todo) * config.samples, desc="calibration prefills", unit="sample",
              disable=not progress, dynamic_ncols=True) as bar:
        for task, length in todo:
            for sample in make_samples(task, tokenizer, length, config.samples, seed=config.seed):
                ctx, question = (x.to(device) for x in chat_ids(tokenizer, sample))
                ids = torch.cat([ctx, question], dim=1) if config.protocol == "query-aware" else ctx
                with torch.no_grad():
                    prefill = shared_prefill(model, ids)
                out.append(CalibrationSample(task, length, sample.seed, prefill, question,
                                             answer_ids(tokenizer, sample).to(device)))
                bar.update(1)
    return out


def prefill_bytes(calibration: list[CalibrationSample]) -> int:
    """Bytes held by the recorded prefills (each storage counted once)."""
    seen, total = set(), 0

    def add(x):
        nonlocal total
        if isinstance(x, Tensor):
            s = x.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(x, (list, tuple)):
            for y in x:
                add(y)
        elif isinstance(x, dict):
            for y in x.values():
                add(y)
        elif hasattr(x, "tensors"):
            add(x.tensors)

    for c in calibration:
        add(c.prefill.calls), add(c.prefill.signals)
    return total


def objective(model: nn.Module, calibration: list[CalibrationSample], rule: Rule, budget: int,
              protocol: str) -> tuple[float, list[float]]:
    """The search objective of `rule`: the mean over calibration samples of the gold answer's mean log-probability
    per token, each scored from the sample's shared prefill (no prefill).

    Returns:
        `(objective, per-sample values)`.
    """
    per = [float(rule_answer_logprobs(model, c.prefill, rule, budget, c.question, c.answer, protocol=protocol).mean())
           for c in calibration]
    return float(mean(per)), per


def suggest(trial, budget: int) -> dict:
    """A point of the `weighted` family drawn by `trial` (the search space; documented in the README).

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
    elif key != json.loads(json.dumps(config.study_key())):
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


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def write_rule_file(path: Path, config: SearchConfig, trial, n_trials: int, model_name: str, command: str) -> Path:
    """Write the best trial as a rule file: a `Weighted` subclass registered as `config.name`, whose field defaults
    are the fitted values and whose docstring says how, on what and when it was found."""
    params = {k: trial.params[k] for k in (*WEIGHTS, "n_sink", "n_recent", "pool")}
    rule = Weighted(**params)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    calib = ", ".join(config.tasks) + f" at {', '.join(map(str, config.lengths))} tokens"
    prose = (f"Found {when} as trial #{trial.number} of {n_trials} (Optuna TPE, seed {config.seed}) on "
             f"{model_name}, budget {config.budget}, protocol {config.protocol}, observation window {DEFAULT_WINDOW}: "
             f"the best mean gold-answer log-probability per token, {trial.value:.6f} nats, over {config.samples} "
             f"calibration sample(s) per task and length ({calib}; generator seed {config.seed}). Training-free: no "
             "gradient, no weight change. Judge it on held-out samples (the search's held-out comparison), not on "
             "this number. Command:")
    safe = command.replace("\\", "\\\\").replace('"""', '\\"""')  # the command inside a docstring
    wrap = dict(width=112, initial_indent="    ", subsequent_indent="    ")
    doc = "\n\n".join([textwrap.fill(f'"""{rule.formula()}.', **wrap), textwrap.fill(prose, **wrap),
                        textwrap.fill(safe, width=112, initial_indent="        ", subsequent_indent="            ",
                                      break_on_hyphens=False, break_long_words=False)]) + '\n    """'
    fields = "\n".join(f"    {k}: {type(v).__name__} = {v!r}" for k, v in params.items())
    text = f'''"""`{config.name}`: a `weighted` rule fitted by `fxbudget search` (family: fxbudget/rules/weighted.py)."""

from dataclasses import dataclass

from fxbudget.rules import register
from fxbudget.rules.weighted import Weighted


@register("{config.name}")
@dataclass
class {_class_name(config.name)}(Weighted):
{doc}

{fields}
'''
    path.write_text(text)
    return path


# --- the held-out verdict --------------------------------------------------------------------------------------
def verdict(rows: list[dict], name: str, metric: str) -> tuple[bool | None, str]:
    """Whether the searched rule `name` beats every other budgeted rule in `rows` by `metric` on held-out data:
    it has the best mean and is alone in tier 1 of the paired test (Holm-adjusted sign-flip p < 0.05 against each).

    Returns:
        `(beats, sentence)`; `beats` is None when the metric is missing.
    """
    from .report import paired

    ranked_by_budget = paired(rows, metric)
    if not ranked_by_budget:
        return None, f"by {metric}: no paired values"
    (n, ranked), = ranked_by_budget.values()
    by_rule = {r.rule: r for r in ranked}
    if name not in by_rule:
        return None, f"by {metric}: {name} has no values"
    digits = 2 if metric == "accuracy" else 3
    if len({r.mean for r in ranked}) == 1:
        return False, f"by {metric} ({n} paired samples): no difference, every rule has the mean {ranked[0].mean:.3g}"
    best = ranked[0]
    if best.rule == name:
        rival, ties = ranked[1], [r.rule for r in ranked[1:] if r.tier == 1]
        d = rival.vs_best  # rival minus the searched rule
        lead = (f"ahead of {rival.rule}, the best built-in rule, by {-d.mean:.{digits}f} [{-d.hi:.{digits}f}, "
                f"{-d.lo:.{digits}f}], Holm p = {rival.p_holm:.3f}")
        if not ties:
            return True, f"by {metric} ({n} paired samples): **{name} beats every built-in rule**: {lead}"
        return False, (f"by {metric} ({n} paired samples): {name} has the best mean but is **not separated** from "
                       f"{', '.join(ties)} at this sample size: {lead}")
    own = by_rule[name]
    d = own.vs_best
    where = "not separated from it (tier 1)" if own.tier == 1 else f"worse (tier {own.tier})"
    return False, (f"by {metric} ({n} paired samples): {name} **does not beat** the best built-in rule "
                   f"{best.rule}: {d.mean:+.{digits}f} [{d.lo:.{digits}f}, {d.hi:.{digits}f}], Holm p = "
                   f"{own.p_holm:.3f}, {where}")


def holdout_means(rows: list[dict]) -> dict[str, dict]:
    """Per rule: held-out samples, mean answer log-prob per token (absolute, as the objective) and accuracy."""
    out = {}
    for rule in dict.fromkeys(r["rule"] for r in rows):
        rs = [r for r in rows if r["rule"] == rule]
        lp = [r["answer_logprob_mean"] for r in rs if r.get("answer_logprob_mean") is not None]
        out[rule] = {"samples": len(rs), "likelihood": mean(lp) if lp else None,
                     "accuracy": mean(r["score"] for r in rs)}
    return out


# --- the whole command -------------------------------------------------------------------------------------------
@dataclass
class SearchResult:
    """What `search` found and how it fared (the summary is written from it)."""

    config: SearchConfig
    study: object
    rule_file: Path
    best: object
    reproduced: float
    calibration_baselines: dict
    holdout_dir: Path
    holdout_rows: list
    verdicts: dict
    timings: dict
    prefill_mib: float
    environment: dict
    command: str
    model_name: str
    new_trials: int


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
    from .report import load_rows, report

    report([holdout_dir], sort="likelihood")
    rows = load_rows([holdout_dir])
    verdicts = {m: verdict(rows, config.name, m) for m in ("accuracy", "likelihood")}
    return SearchResult(config, study, rule_file, best, reproduced, baselines, holdout_dir, rows, verdicts, timings,
                        mib, environment(model), command, model_name, new_trials)


# --- the summary --------------------------------------------------------------------------------------------------
def load_average() -> str:
    """The 1/5/15-minute load averages as `a/b/c` (`-` where the platform has none)."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "-"


def summary_markdown(res: SearchResult, note: str | None = None, wall_s: float | None = None,
                     load_start: str | None = None) -> str:
    """The search's report: setup, wall time, the found formula and rule file, calibration vs held-out, the held-out
    verdict and paired comparison, the best trials.

    Args:
        res: what `search` returned.
        note: a line under the title (e.g. that it is a smoke run).
        wall_s: the run's wall time, model load included.
        load_start: the load average when the run started (`load_average()`); the one at the end is added here.
    """
    from .report import accuracy_table, likelihood_table, paired_tables

    c, env = res.config, res.environment
    trials = complete_trials(res.study)
    durations = [t.duration.total_seconds() for t in trials if t.duration is not None]
    rule = get(c.name)
    hold = holdout_means(res.holdout_rows)
    seeded = {t.user_attrs.get("seeded_from"): t for t in trials if t.user_attrs.get("seeded_from")}
    n_cal = len(c.tasks) * len(c.lengths) * c.samples
    parts = [f"# Rule search: `{c.name}`", ""]
    if note:
        parts += [f"**{note}**", ""]
    parts += [
        f"- command: `{res.command}`",
        f"- model: {res.model_name}; dtype {env['dtype']}, device {env['device']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, fxbudget {env['fxbudget']}, {env['threads']} torch thread(s), "
        f"{env['machine']} {env['platform']}, {os.cpu_count()} CPU(s), malloc: {env['malloc']}",
        f"- date {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; load average (1/5/15 min) "
        f"{'' if load_start is None else load_start + ' at the start, '}{load_average()} at the end",
        f"- family: `weighted` (fxbudget/rules/weighted.py), observation window {DEFAULT_WINDOW}, budget {c.budget}, "
        f"protocol {c.protocol}",
        f"- calibration: {', '.join(c.tasks)} at {', '.join(map(str, c.lengths))} tokens, {c.samples} sample(s) each "
        f"({n_cal} in all), generator seed {c.seed}; objective: mean over samples of the gold answer's mean "
        "log-probability per token (nats)",
        f"- held-out: {c.holdout_samples} sample(s) per task and length, generator seed {c.holdout_seed} (never seen "
        f"by the search), against {', '.join(c.baselines)} and the unmodified model",
        f"- search: Optuna TPE (seed {c.seed}), {len(trials)} completed trials ({res.new_trials} in this run), the "
        f"first ones the family's points equal to {', '.join(seeded) or 'no built-in rule'}",
        "", "## Wall time", "",
        *([f"- this run, end to end (model load included): {wall_s:.1f} s"] if wall_s is not None else []),
        f"- calibration prefills (this run): {res.timings['calibration_prefill_s']:.1f} s for {n_cal} samples; "
        f"recorded prefills held: {res.prefill_mib:.0f} MiB",
        f"- trials: {sum(durations):.1f} s for {len(durations)} trials, {mean(durations) if durations else 0:.2f} s "
        f"per trial ({mean(durations) / n_cal if durations else 0:.2f} s per calibration sample)",
        f"- built-in rules on the calibration set: {res.timings['calibration_baselines_s']:.1f} s (this run; stored "
        "in the study)",
        f"- held-out comparison: {res.timings['holdout_s']:.1f} s (this run; rows already in "
        f"`{res.holdout_dir}` are reused)",
        "", "## Found rule", "",
        f"Trial #{res.best.number}: `{rule.formula()}`", "",
        *([f"This is the family's point equal to {res.best.user_attrs['seeded_from']} (a built-in rule, seeded): "
           "no trial did better on the calibration set.", ""] if res.best.user_attrs.get("seeded_from") else []),
        f"Calibration objective {res.best.value:.4f}; the written rule file `{res.rule_file}` reproduces "
        f"{res.reproduced:.4f} ({'equal' if res.reproduced == res.best.value else 'DIFFERENT'}). "
        f"Load it with `fxbudget compare --rule-file {res.rule_file} --rules {c.name},...`.", "",
        "<details><summary>the rule file</summary>", "", "```python", res.rule_file.read_text().rstrip(), "```", "",
        "</details>", "",
        "## Calibration vs held-out (overfitting check)", "",
        "Answer log-probability per token (nats, absolute; higher is better). The search picked the best of "
        f"{len(trials)} trials on the calibration set, so its calibration value is optimistic; the held-out "
        "column is the fair one.", "",
        "| rule | calibration | family point, calibration | held-out | held-out accuracy |", "|---|---|---|---|---|"]

    def cell(x, digits=4):
        return "-" if x is None else f"{x:.{digits}f}"

    rows = [(c.name, res.best.value, None)] + [(b, res.calibration_baselines[b], seeded.get(b)) for b in c.baselines]
    for name, cal, point in rows:
        h = hold.get(name, {})
        pt = f"{point.value:.4f} (#{point.number})" if point is not None else "-"
        parts.append(f"| {name} | {cell(cal)} | {pt} | {cell(h.get('likelihood'))} | {cell(h.get('accuracy'), 2)} |")
    ref = hold.get(REFERENCE, {})
    parts.append(f"| full (unmodified model) | - | - | {cell(ref.get('likelihood'))} | "
                 f"{cell(ref.get('accuracy'), 2)} |")
    best_cal = max(c.baselines, key=lambda b: res.calibration_baselines[b])
    held = {b: hold[b]["likelihood"] for b in c.baselines if hold.get(b, {}).get("likelihood") is not None}
    margin_cal = res.best.value - res.calibration_baselines[best_cal]
    parts += ["", f"- calibration: {c.name} minus the best built-in rule there ({best_cal}): {margin_cal:+.4f}"]
    if held and hold.get(c.name, {}).get("likelihood") is not None:
        best_held = max(held, key=held.get)
        margin_held = hold[c.name]["likelihood"] - held[best_held]
        parts.append(f"- held-out: {c.name} minus the best built-in rule there ({best_held}): {margin_held:+.4f}")
        if margin_cal > 0 and margin_held <= 0:
            parts.append("- the calibration gain did **not** carry over to held-out data: the search overfit the "
                         "calibration samples (or the held-out set cannot show the gain)")
    parts += ["", "## Held-out verdict", ""]
    parts += [f"- {text}" for _, text in res.verdicts.values()]
    parts += ["", "Decide on accuracy; the likelihood separates rules with fewer samples (README, \"How to read this "
              "report\"). Tier 1 alone means a Holm-adjusted sign-flip p < 0.05 against every built-in rule.", "",
              "### Paired comparison on held-out samples", "", paired_tables(res.holdout_rows, "likelihood"), "",
              "### Held-out accuracy", "", accuracy_table(res.holdout_rows, "likelihood"), ""]
    lik = likelihood_table(res.holdout_rows, "likelihood")
    if lik:
        parts += ["### Held-out answer log-likelihood per token, rule minus the unmodified model (nats)", "", lik, ""]
    prints = {r["kernel_fingerprint"] for r in res.holdout_rows if r.get("kernel_fingerprint")}
    kernel = "one fingerprint for every rule, the searched one included" if len(prints) == 1 else \
        f"**{len(prints)} different fingerprints**: the rules did not run one kernel"
    parts += [f"Kernel: {kernel} (full report: `{res.holdout_dir / 'report.md'}`).", "",
              "## Best trials (calibration objective)", "",
              "| trial | objective | " + " | ".join(WEIGHTS + ("n_sink", "n_recent", "pool")) + " | seeded from |",
              "|---" * (len(WEIGHTS) + 6) + "|"]
    for t in sorted(trials, key=lambda t: -t.value)[:10]:
        vals = " | ".join(f"{t.params[w]:+.3f}" for w in WEIGHTS)
        parts.append(f"| #{t.number} | {t.value:.4f} | {vals} | {t.params['n_sink']} | {t.params['n_recent']} | "
                     f"{t.params['pool']} | {t.user_attrs.get('seeded_from', '')} |")
    return "\n".join(parts) + "\n"
