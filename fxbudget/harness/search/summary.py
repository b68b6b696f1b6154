"""What a search writes: the found rule as a rule file, and its report (search.md)."""

from __future__ import annotations

import datetime
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from ...kernel import DEFAULT_WINDOW
from ...rules import get
from ...rules.weighted import WEIGHTS, Weighted
from ..grid import REFERENCE
from .config import SearchConfig
from .study import complete_trials
from .verdict import holdout_means

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


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def write_rule_file(path: Path, config: SearchConfig, trial, n_trials: int, model_name: str, command: str) -> Path:
    """Write the best trial as a rule file: a `Weighted` subclass registered as `config.name`, whose field defaults
    are the fitted values and whose docstring says how, on what and when it was found."""
    # A weight added to the family after a resumed study's older trials is 0 there (the family without it).
    known = Weighted.__dataclass_fields__
    params = {**{w: 0.0 for w in WEIGHTS}, **{k: v for k, v in trial.params.items() if k in known}}
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
    from ..report import accuracy_table, likelihood_table, paired_tables
    from ..tables import likelihood_heading

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
    parts += ["", "Decide on accuracy; the likelihood separates rules with fewer samples (docs/compare.md, \"Reading a "
              "report\"). Tier 1 alone means a Holm-adjusted sign-flip p < 0.05 against every built-in rule.", "",
              "### Paired comparison on held-out samples", "", paired_tables(res.holdout_rows, "likelihood"), "",
              "### Held-out accuracy", "", accuracy_table(res.holdout_rows, "likelihood"), ""]
    lik = likelihood_table(res.holdout_rows, "likelihood")
    if lik:
        parts += ["### Held-out answer log-likelihood per token", "", likelihood_heading(res.holdout_rows) + ":", "",
                  lik, ""]
    prints = {r["kernel_fingerprint"] for r in res.holdout_rows if r.get("kernel_fingerprint")}
    kernel = "one fingerprint for every rule, the searched one included" if len(prints) == 1 else \
        f"**{len(prints)} different fingerprints**: the rules did not run one kernel"
    parts += [f"Kernel: {kernel} (full report: `{res.holdout_dir / 'report.md'}`).", "",
              "## Best trials (calibration objective)", "",
              "| trial | objective | " + " | ".join(WEIGHTS + ("n_sink", "n_recent", "pool")) + " | seeded from |",
              "|---" * (len(WEIGHTS) + 6) + "|"]
    for t in sorted(trials, key=lambda t: -t.value)[:10]:
        vals = " | ".join(f"{t.params.get(w, 0.0):+.3f}" for w in WEIGHTS)
        parts.append(f"| #{t.number} | {t.value:.4f} | {vals} | {t.params['n_sink']} | {t.params['n_recent']} | "
                     f"{t.params['pool']} | {t.user_attrs.get('seeded_from', '')} |")
    return "\n".join(parts) + "\n"
