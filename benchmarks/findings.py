"""The findings run (issue 42, item 2): one grid sized to decide a few things, run through `fxbudget compare` in
resumable parts, and the docs page `docs/findings.md` regenerated from its committed rows.

    python benchmarks/findings.py --plan                  # the grid, its sample size and rows; runs nothing
    python benchmarks/findings.py                         # run (or resume) every part, then write the page
    python benchmarks/findings.py --parts main --tasks ruler:niah_single_1 --rules snapkv,streamingllm \\
        --budgets 12.5% --samples-per-task 2              # a first slice of the same grid (its rows are the grid's)
    python benchmarks/findings.py --ray auto              # the samples on a Ray cluster (`fxbudget compare --ray`)
    python benchmarks/findings.py --page-only             # only rewrite docs/findings.md from the committed rows

**The grid.** RULER's six offline tasks at 2048 tokens (`ruler:niah_single_1`, `ruler:niah_multikey_2`,
`ruler:niah_multikey_3`: the noise- and needle-haystack NIAH family; `ruler:vt`; `ruler:cwe`; `ruler:fwe`), the rules
in `RULES` (8 rules plus `random`, the floor) and the decomposition of `DECOMPOSED` (`noprotect:<rule>`,
`protectonly:<rule>`), at 12.5% and 25% of each sample's context. Everything is data (`PARTS`): a part is one
`fxbudget compare` folder under `benchmarks/results/findings/`, run in rounds of one sample per task, each round a
`compare` that resumes the folder from its rows (`compare` skips every row whose key is already there), so a run
cut anywhere leaves every cell at the same sample count, and rerunning the same command continues it. A slice
(`--tasks/--rules/--budgets/--samples-per-task`) writes the same keys as the full grid: its rows count for it.

**Sample size.** `samples_per_task()`: the power projection of `benchmarks/ruler_cpu_samples.py` (resampling paired
differences of committed rows, the best against the worst rule on answer log-likelihood per token, the p multiplied
by the number of rule pairs the page Holm-adjusts over) gives the paired samples that separate them at 80% power;
divided over the tasks, rounded up. On the committed CPU RULER rows it gives 24: 4 samples per task.

**Sized to about 4 hours of one CPU thread (this 2-core machine, shared), and how.** Not every part runs every
setting; in priority order (a part runs after the one before it finishes):
1. `main`: the embedded model, query-agnostic, every rule at both budgets (456 rows);
2. `decomposition`: the 6 wrapper rows at 12.5% only (144 rows; they pair with `main`'s rows on the same samples;
   tova protects no token, so it has no decomposition: `UNDECOMPOSABLE`);
3. `second-model`: gemma3-270m, query-agnostic, every rule at 12.5% only (240 rows; the ranking compared there);
4. `query-aware`: the embedded model only, every rule at 12.5% only (216 rows).
`--plan` projects each part's hours from the committed rows' own seconds (`projected_hours`); where that adds up to
more than 4 hours, the last parts are what a 4-hour session leaves out (the first ones are decided by then).

**dtype.** bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), or on a GPU; else float32 (an AVX2-only
CPU emulates bfloat16: slower, not faster). Recorded in every row.

**The page.** `docs/findings.md` from the rows alone: which pairs of rules are separated (paired sign-flip test,
Holm over every pair of a setting, with the effect and its interval) and which are not; Kendall's tau between the two
models' rankings with a bootstrap interval; whether protection alone recovers most of a rule's gain over `random`
(arXiv 2605.18053's claim); rows per hour and wall time from `runs.jsonl`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import ROOT, load_str  # noqa: E402

TASKS = ("ruler:niah_single_1", "ruler:niah_multikey_2", "ruler:niah_multikey_3", "ruler:vt", "ruler:cwe",
         "ruler:fwe")
LENGTH = 2048
BUDGETS = ("12.5%", "25%")
SEED = 0
FLOOR = "random"
RULES = ("streamingllm", "h2o", "snapkv", "tova", "knorm", "keydiff", "expected_attention", "pyramidkv", FLOOR)
# The issue names tova too, but tova protects no token: `noprotect:tova` would change nothing and `protectonly:tova`
# is `random` (both refused by name), so its whole gain over random is its score; the page says so.
DECOMPOSED = ("snapkv", "h2o", "expected_attention")
UNDECOMPOSABLE = {"tova": "protects no token: its whole gain over random is its score"}
WRAPPERS = ("noprotect", "protectonly")
SECOND_MODEL = "gemma3-270m"
EMBEDDED = "embedded"
LIKELIHOOD, ACCURACY = "answer_logprob_mean", "score"
METRICS = {LIKELIHOOD: "answer log-likelihood per token", ACCURACY: "accuracy"}
PILOT = ROOT / "benchmarks" / "results" / "ruler_cpu"  # the rows the sample size is projected from
OUT = ROOT / "benchmarks" / "results" / "findings"
PAGE = ROOT / "docs" / "findings.md"
ALPHA = 0.05
FIRST = float(BUDGETS[0].rstrip("%")) / 100  # the budget every part runs: agreement and decomposition are read there
# The paper's claim (arXiv 2605.18053): reserving the boundaries recovers 69-90% of reference quality; "most" here:
# the share of a rule's gain over random that its protected set alone recovers is above one half.
MOST = 0.5


@dataclass(frozen=True)
class Part:
    """One `fxbudget compare` folder of the grid: a model, a protocol, rules and budgets, on `TASKS`."""

    name: str
    model: str  # EMBEDDED or a `--model` value
    protocol: str
    rules: tuple[str, ...]
    budgets: tuple[str, ...]
    why: str


def decomposition(rules=DECOMPOSED) -> tuple[str, ...]:
    """The wrapper rules of the decomposition: `noprotect:r` and `protectonly:r` for each rule."""
    return tuple(f"{w}:{r}" for r in rules for w in WRAPPERS)


PARTS = (
    Part("main", EMBEDDED, "query-agnostic", ("full",) + RULES, BUDGETS,
         "every rule at both budgets: the ranking this grid decides"),
    Part("decomposition", EMBEDDED, "query-agnostic", decomposition(), BUDGETS[:1],
         "where each rule's gain comes from, at one budget; pairs with main's rows"),
    Part("second-model", SECOND_MODEL, "query-agnostic", ("full",) + RULES, BUDGETS[:1],
         "does the ranking hold on another model family, at one budget"),
    Part("query-aware", EMBEDDED, "query-aware", RULES, BUDGETS[:1],
         "the rules with the question in the cache (SnapKV's setting), on one model and one budget"),
)


def pairs_of(n_rules: int) -> int:
    return n_rules * (n_rules - 1) // 2


def samples_per_task(pilot: Path = PILOT, rules: int = len(RULES), tasks: int = len(TASKS)) -> tuple[int, str]:
    """Samples per task so the best and the worst rule separate on answer likelihood at 80% power (Holm over the
    `rules` rules' pairs bounded by multiplying the p by their number), from `ruler_cpu_samples.projection` on the
    `pilot` rows; and a sentence saying how. The larger need over the pilot's budgets counts."""
    from ruler_cpu_samples import SIZES, projection

    rows = _rows(pilot)
    m = pairs_of(rules)
    needs = [p for p in projection(rows, comparisons=m) if p["metric"] == "likelihood"]
    if not needs:
        raise SystemExit(f"{pilot}: no budgeted rows to project a sample size from")
    if any(p["need"] is None for p in needs):
        raise SystemExit(f"{pilot}: no size up to {SIZES[-1]} separates best and worst at 80% power")
    n = max(p["need"] for p in needs)
    per = math.ceil(n / tasks)
    how = (f"{n} paired samples separate the best from the worst rule on answer likelihood at 80% power "
           f"(`benchmarks/ruler_cpu_samples.py`'s projection from {len(rows)} rows of "
           f"{pilot.relative_to(ROOT).as_posix()}, p x {m} rule pairs < {ALPHA}); over {tasks} tasks: {per} per task")
    return per, how


def cpu_dtype(device: str = "cpu", cpuinfo: str | None = None) -> tuple[str, str]:
    """(dtype, why): bfloat16 on a GPU or a CPU with native bfloat16 arithmetic (AVX512-BF16, AMX-BF16), else
    float32."""
    if device.startswith("cuda"):
        return "bfloat16", "a GPU"
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if native:
        return "bfloat16", f"the CPU has {', '.join(native)}"
    return "float32", "the CPU has no native bfloat16 (no avx512_bf16 or amx_bf16 flag): emulated bf16 is slower"


def part_dir(part: Part) -> Path:
    return OUT / part.name


def compare_command(part: Part, samples: int, *, tasks=TASKS, dtype: str = "float32", device: str = "cpu",
                    threads: int = 1, ray: str | None = None, workers: int | None = None,
                    out: Path | None = None) -> list[str]:
    """The `fxbudget compare` arguments of one round of `part` (after `python -m fxbudget.cli`)."""
    cmd = ["compare", "--tasks", ",".join(tasks), "--lengths", str(LENGTH), "--samples", str(samples),
           "--seed", str(SEED), "--rules", ",".join(part.rules), "--budgets", ",".join(part.budgets),
           "--protocol", part.protocol, "--device", device, "--dtype", dtype, "--threads", str(threads), "--quiet",
           "--out", _rel(out or part_dir(part))]
    if part.model != EMBEDDED:
        cmd[1:1] = ["--model", part.model]
    if ray is not None:
        cmd += ["--ray", ray] + (["--workers", str(workers)] if workers else [])
    return cmd


def _rel(path: Path) -> str:
    """`path` from the repository root (the rounds run there) when it is inside it."""
    try:
        return Path(path).relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def missing(part: Part) -> str | None:
    """Why `part` cannot run here yet (a rule or a model this checkout does not know), or None."""
    from fxbudget.harness.grid import rule_fields

    unknown = [r for r in part.rules if r != "full" and rule_fields(r) is None]
    if unknown:
        return f"rule {unknown[0]} is not known to this checkout"
    if part.model != EMBEDDED:
        from fxbudget.models.source import resolve_model

        try:
            source = resolve_model(part.model)
        except ValueError as e:
            return f"--model {part.model}: {str(e).splitlines()[0]}"
        if source.kind == "hub" and "/" not in source.location:  # not embedded here: read as a hub id it is not
            return f"--model {part.model} is not an embedded model of this checkout (it comes with the reach issue)"
    return None


def _rows(folder: Path) -> list[dict]:
    from fxbudget.harness.results import read_rows

    path = Path(folder) / "results.jsonl"
    return read_rows(path) if path.is_file() else []


def run_parts(parts, per_task: int, args) -> list[str]:
    """Run every part in rounds of one sample per task (each round resumes the part's folder); append one line per
    round to `runs.jsonl`. Returns the lines of the parts that could not run."""
    skipped = []
    OUT.mkdir(parents=True, exist_ok=True)
    for part in parts:
        why = missing(part)
        if why:
            skipped.append(f"{part.name}: not run: {why}")
            print(f"[findings] {skipped[-1]}", file=sys.stderr)
            continue
        for n in range(1, per_task + 1):
            cmd = compare_command(part, n, tasks=args.tasks, dtype=args.dtype, device=args.device,
                                  threads=args.threads, ray=args.ray, workers=args.workers)
            before, load_before, t0 = len(_rows(part_dir(part))), load_str(), time.perf_counter()
            started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            print(f"[findings] {part.name}, round {n}/{per_task}: fxbudget {shlex.join(cmd)}", file=sys.stderr)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
            proc = subprocess.Popen([sys.executable, "-m", "fxbudget.cli", *cmd], cwd=ROOT, env=env)
            try:
                rc = proc.wait()
            except KeyboardInterrupt:  # compare gets the Ctrl-C too: it saves its rows, says so, exits 130
                rc = proc.wait()
            wall = time.perf_counter() - t0
            after = len(_rows(part_dir(part)))
            with (OUT / "runs.jsonl").open("a") as f:
                f.write(json.dumps({"part": part.name, "round": n, "command": "fxbudget " + shlex.join(cmd),
                                    "started": started, "wall_s": round(wall, 1), "rows_before": before,
                                    "rows_after": after, "exit": rc, "load_before": load_before,
                                    "load_after": load_str()}) + "\n")
            if rc != 0:
                raise SystemExit(f"[findings] {part.name}: fxbudget compare exited {rc}; rerun the same "
                                 f"`python benchmarks/findings.py ...` command to resume (the rows written are kept)")
    return skipped


# ----------------------------------------------------------------------------------------------------------------
# The page: everything below reads rows only.


def by_setting(rows: list[dict], metric: str) -> dict:
    """{(model, protocol, budget_fraction): {rule: {(task, length, sample): value}}} of the budgeted rows."""
    out: dict = {}
    for r in rows:
        if r["rule"] == "full" or r.get(metric) is None:
            continue
        key = (r["model"], r["protocol"], r["budget_fraction"])
        out.setdefault(key, {}).setdefault(r["rule"], {})[(r["task"], r["length"], r["sample"])] = float(r[metric])
    return out


def aligned(by_rule: dict, rules=None) -> tuple[list[tuple], dict]:
    """The samples every rule in `rules` (default: all) has, and each rule's values on them, in sample order."""
    rules = [r for r in (rules or by_rule) if r in by_rule]
    if not rules:
        return [], {}
    keys = sorted(set.intersection(*(set(by_rule[r]) for r in rules)))
    import numpy as np

    return keys, {r: np.array([by_rule[r][k] for k in keys]) for r in rules}


def decide(values: dict, alpha: float = ALPHA) -> list[dict]:
    """Every pair of rules (higher mean first): the paired difference, its interval, its sign-flip p and the
    p Holm-adjusted over all pairs; `separated` when that is below `alpha`."""
    from fxbudget.harness.stats import holm, paired_diff

    order = sorted(values, key=lambda r: (-float(values[r].mean()), r))
    pairs = [(a, b, paired_diff(values[a], values[b])) for i, a in enumerate(order) for b in order[i + 1:]]
    adjusted = holm([d.p for _, _, d in pairs]) if pairs else []
    return [{"a": a, "b": b, "diff": d, "p_holm": p, "separated": p < alpha}
            for (a, b, d), p in zip(pairs, adjusted)]


def model_agreement(rows: list[dict], models: tuple[str, str], protocol: str, fraction: float, rules,
                    n_boot: int = 2000):
    """Kendall's tau between the two models' rankings (mean answer likelihood) of `rules` at one budget, with its
    bootstrap interval, or None when either model lacks rows of two rules."""
    from fxbudget.harness.rank_agreement import kendall_tau_interval

    settings = by_setting(rows, LIKELIHOOD)
    per = [settings.get((m, protocol, fraction), {}) for m in models]
    common = [r for r in rules if all(r in p for p in per)]
    if len(common) < 2:
        return None
    a, b = (aligned(p, common)[1] for p in per)
    if any(len(next(iter(v.values()))) == 0 for v in (a, b)):
        return None
    return kendall_tau_interval(a, b, n_boot=n_boot), common, [len(next(iter(v.values()))) for v in (a, b)]


def protection(rows: list[dict], model: str, protocol: str, fraction: float, rule: str, metric: str,
               n_boot: int = 2000):
    """The decomposition of `rule` on its samples: means of the rule, `noprotect:rule`, `protectonly:rule` and
    `random`, and the share of the rule's gain over `random` that `protectonly:` recovers, with a paired bootstrap
    interval (samples resampled together); None without all four on common samples."""
    import numpy as np

    from fxbudget.harness.decomposition import protection_share
    from fxbudget.harness.stats import paired_diff

    by_rule = by_setting(rows, metric).get((model, protocol, fraction), {})
    names = [rule, f"noprotect:{rule}", f"protectonly:{rule}", FLOOR]
    keys, v = aligned(by_rule, names)
    if len(v) < 4 or not keys:
        return None
    share = protection_share(v[rule], v[f"protectonly:{rule}"], v[FLOOR])
    return {"n": len(keys), "means": {r: float(np.mean(x)) for r, x in v.items()},
            "gain": paired_diff(v[rule], v[FLOOR]), "share": share}


def _last(values: dict) -> str:
    """The rule `decide` orders last (lowest mean; ties by name)."""
    return sorted(values, key=lambda r: (-float(values[r].mean()), r))[-1]


def _fmt_diff(d, digits: int = 3) -> str:
    if not d.bounded:
        return f"{d.mean:+.{digits}f} (n={d.n}: too few samples for an interval)"
    return f"{d.mean:+.{digits}f} [{d.lo:+.{digits}f}, {d.hi:+.{digits}f}]"


def rate(runs: list[dict]) -> tuple[int, float]:
    """(rows added, wall seconds) over every logged round."""
    return sum(max(0, r["rows_after"] - r["rows_before"]) for r in runs), sum(r["wall_s"] for r in runs)


def projected_hours(part: Part, samples: int, rows: list[dict]) -> float | None:
    """Hours of the whole `part` on `samples` samples from the timed seconds of committed `rows` of its model (any
    part): per sample one shared prefill (the median of the budgeted rows' `prefill_s`), the unmodified model's row
    if the part has one (its own prefill and decode: taken as prefill + one row's work) and each budgeted row's own
    work (the median branch + replay + decode + likelihood seconds); rounds' fixed seconds not included. None without
    budgeted rows of the model."""
    import numpy as np

    model = {EMBEDDED: "Qwen2.5-Coder-0.5B-Instruct"}.get(part.model, part.model)
    mine = [r for r in rows if r["model"] == model and r["rule"] != "full" and r.get("shared_prefill")]
    if not mine:
        return None
    prefill = float(np.median([r["prefill_s"] for r in mine]))
    work = float(np.median([sum(r.get(k) or 0.0 for k in ("branch_s", "replay_s", "decode_s", "likelihood_s"))
                            for r in mine]))
    budgeted = sum(len(part.budgets) for r in part.rules if r != "full")
    full = prefill + work if "full" in part.rules else 0.0
    return samples * (prefill + full + budgeted * work) / 3600


def planned_rows(part: Part, per_task: int, tasks=TASKS) -> int:
    n = len(tasks) * per_task
    return n * sum(1 if r == "full" else len(part.budgets) for r in part.rules)


def page(parts=PARTS, per_task: int | None = None, how: str = "", n_boot: int = 2000) -> str:
    """The findings page, from the rows in each part's folder and `runs.jsonl`."""
    rows_of = {p.name: _rows(part_dir(p)) for p in parts}
    rows = [r for p in parts for r in rows_of[p.name]]
    runs = [json.loads(x) for x in (OUT / "runs.jsonl").read_text().splitlines() if x] \
        if (OUT / "runs.jsonl").is_file() else []
    done = sum(len(v) for v in rows_of.values())
    planned = sum(planned_rows(p, per_task) for p in parts) if per_task else None
    partial = planned is None or done < planned
    lines = ["# Findings", "",
             "<!-- generated by `python benchmarks/findings.py --page-only` from benchmarks/results/findings/: "
             "do not edit by hand -->", ""]
    if partial:
        lines += ["!!! warning \"Partial: a first part of the run, not its findings\"",
                  f"    {done} of {planned} planned rows are in ({coverage(rows)}). The lists below are what these "
                  "rows decide so far; they are not the grid's answer. Continue with `python benchmarks/findings.py` "
                  "(it resumes: every row already in is skipped).", ""]
    lines += ["RULER's offline tasks at 2048 tokens, `fxbudget compare` on one shared kernel, each rule paired with "
              "every other on the same samples. Answer log-likelihood per token (the mean log-probability of the "
              "gold answer's tokens) is the primary metric: it separates rules with fewer samples than accuracy.", "",
              "## The grid", "",
              "| part | model | protocol | rules | budgets | rows planned | rows in |", "|---|---|---|---|---|---|---|"]
    for p in parts:
        lines.append(f"| {p.name} | {_model_name(p)} | {p.protocol} | {len(p.rules)} | {', '.join(p.budgets)} | "
                     f"{planned_rows(p, per_task) if per_task else '?'} | {len(rows_of[p.name])} |")
    blocked = [(p.name, missing(p)) for p in parts if not rows_of[p.name]]
    blocked = [f"`{name}`: {why}" for name, why in blocked if why]
    if blocked:
        lines += ["", "Not runnable in this checkout yet: " + "; ".join(blocked) + "."]
    lines += ["", f"Tasks: {_names(TASKS)}. Rules: {_names(RULES)} "
              f"(`{FLOOR}`: the floor), `full` the unmodified model. Decomposed: "
              f"{_names(DECOMPOSED)}. Sample size: {how or 'not computed'}. Sized to about "
              "4 hours of one CPU thread by giving the second model, the decomposition and query-aware one budget "
              "each, and query-aware one model (see `benchmarks/findings.py`).", ""]
    agreement, splits = agreement_of(rows, n_boot), decompositions(rows, n_boot)
    lines += _lead_section(rows, agreement, splits)
    lines += _decided_section(rows, per_task * len(TASKS) if per_task else None)
    lines += _agreement_section(agreement, n_boot)
    lines += _protection_section(splits)
    lines += _cost_section(rows, runs, done)
    return "\n".join(lines).rstrip() + "\n"


def coverage(rows: list[dict]) -> str:
    """What the rows cover, in words: per model and protocol, tasks, rules, budgets and samples per task."""
    if not rows:
        return "none yet"
    out = []
    for (model, protocol) in sorted({(r["model"], r["protocol"]) for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["protocol"] == protocol]
        tasks = sorted({r["task"] for r in mine})
        rules = sorted({r["rule"] for r in mine})
        budgets = sorted({r["budget_fraction"] for r in mine if r["budget_fraction"] is not None})
        per = max(len({r["sample"] for r in mine if r["task"] == t}) for t in tasks)
        out.append(f"{model}, {protocol}: {', '.join(tasks)}; {', '.join(rules)}; "
                   f"{', '.join(f'{b:.1%}' for b in budgets)}; {per} sample{'s' if per != 1 else ''} per task")
    return "; ".join(out)


def _model_name(part: Part) -> str:
    return "the embedded Qwen2.5-Coder-0.5B-Instruct" if part.model == EMBEDDED else part.model


def agreement_of(rows: list[dict], n_boot: int) -> tuple[list[str], tuple | None]:
    """(the models with query-agnostic rows, `model_agreement` of the first two at the first budget or None)."""
    models = sorted({r["model"] for r in rows if r["protocol"] == "query-agnostic"})
    return models, (model_agreement(rows, tuple(models[:2]), "query-agnostic", FIRST, RULES, n_boot)
                    if len(models) >= 2 else None)


def decompositions(rows: list[dict], n_boot: int) -> dict:
    """{(rule, metric): `protection`'s result or None} for every decomposed rule and metric at the first budget."""
    model = next((r["model"] for r in rows if r["rule"].startswith("protectonly:")), None)
    return {(rule, metric): protection(rows, model, "query-agnostic", FIRST, rule, metric, n_boot) if model else None
            for rule in DECOMPOSED for metric in METRICS}


def _names(rules) -> str:
    return ", ".join(f"`{r}`" for r in rules)


def _lead_section(rows: list[dict], agreement: tuple, splits: dict) -> list[str]:
    """The answer first: per setting, on answer likelihood (the primary metric), the rule with the highest mean, the
    rules not separated from it and those separated below it; then the two models' agreement and the protection
    claim in a line each (their sections below give the numbers)."""
    out = ["## The answer so far", ""]
    for (model, protocol, frac), by_rule in sorted(by_setting(rows, LIKELIHOOD).items(), key=str):
        keys, values = aligned(by_rule, [r for r in by_rule if r.split(":", 1)[0] not in WRAPPERS])
        if len(values) < 2 or not keys:
            continue
        verdicts = decide(values)
        best = verdicts[0]["a"]  # `decide` orders the rules by mean
        tied = [v["b"] for v in verdicts if v["a"] == best and not v["separated"]]
        below = [v["b"] for v in verdicts if v["a"] == best and v["separated"]]
        out.append(f"- **{model}, {protocol}, {frac:.1%} budget** ({len(values)} rules, {len(keys)} paired "
                   f"sample{'s' if len(keys) != 1 else ''}): "
                   f"`{best}` has the highest answer likelihood"
                   + (f", not separated from {_names(tied)}" if tied else ", separated from every other rule")
                   + (f"; separated below it: {_names(below)}" if below and tied else "") + "; "
                   f"{sum(v['separated'] for v in verdicts)} of {len(verdicts)} pairs separated in all.")
    if len(out) == 2:
        return out + ["Nothing decided yet: no setting has two rules on common samples.", ""]
    if agreement[1] is not None:
        (tau, lo, hi), _, ns = agreement[1]
        out.append(f"- The two models' rankings at {BUDGETS[0]}: Kendall's tau {tau:+.2f} [{lo:+.2f}, {hi:+.2f}] "
                   f"({ns[0]} and {ns[1]} samples): " + ("they agree more than chance." if lo > 0 else
                                                          "agreement is not shown."))
    claims = {rule: _claim(splits[(rule, LIKELIHOOD)]) for rule in DECOMPOSED}
    claims = {rule: c for rule, c in claims.items() if c is not None}
    if claims:
        out.append("- Protection alone recovering most of a rule's gain over `random` (arXiv 2605.18053), on answer "
                   "likelihood: " + "; ".join(f"`{r}`: {c}" for r, c in claims.items()) + ".")
    return out + ["", "Each list in full, with its effects and p values, follows.", ""]


def _claim(res) -> str | None:
    """The protection claim's verdict on one rule's decomposition (`protection`'s result), or None without one."""
    if res is None:
        return None
    share, gain = res["share"], res["gain"]
    if gain.p >= ALPHA or gain.mean <= 0:
        return "no gain over random to split"
    if share.lo is None:
        return "undecided"
    if share.lo > MOST:
        return "holds"
    if share.hi < MOST:
        return "fails"
    return "undecided"


def _decided_section(rows: list[dict], planned_n: int | None = None) -> list[str]:
    out = ["## What is decided", "",
           "Per setting (model, protocol, budget) and metric, every pair of rules (the decomposition's wrappers "
           "apart) on their common samples: the "
           "paired sign-flip test, Holm-adjusted over all pairs of the setting; separated at p < 0.05. The effect "
           "is the mean paired difference (first rule minus second) with the interval of the same test.", ""]
    undecided = []
    any_rows = False
    for metric, label in METRICS.items():
        for (model, protocol, frac), by_rule in sorted(by_setting(rows, metric).items(), key=str):
            ranked = [r for r in by_rule if r.split(":", 1)[0] not in WRAPPERS]  # the decomposition has its section
            keys, values = aligned(by_rule, ranked)
            if len(values) < 2 or not keys:
                continue
            any_rows = True
            verdicts = decide(values)
            head = f"{model}, {protocol}, {frac:.1%} budget, {label}, {len(values)} rules on {len(keys)} samples"
            sep = [v for v in verdicts if v["separated"]]
            out.append(f"- **{head}**: {len(sep)} of {len(verdicts)} pairs separated"
                       + (":" if sep else "."))
            for v in sep:
                out.append(f"    - `{v['a']}` > `{v['b']}`: {_fmt_diff(v['diff'])}, p (Holm) = {v['p_holm']:.3g}")
            best_worst = next(v for v in verdicts if v["a"] == verdicts[0]["a"] and v["b"] == _last(values))
            if not best_worst["separated"]:
                settle = ("" if not planned_n or len(keys) >= planned_n else
                          f"; the grid's {planned_n} samples are sized to separate them" if metric == LIKELIHOOD else
                          "; the grid is sized on likelihood, accuracy needs more samples")
                undecided.append(f"- {head}: best `{best_worst['a']}` vs worst `{best_worst['b']}`: "
                                 f"{_fmt_diff(best_worst['diff'])}, p (Holm) = {best_worst['p_holm']:.3g}; "
                                 f"{len(verdicts) - len(sep)} of {len(verdicts)} pairs not separated{settle}")
            else:
                undecided.append(f"- {head}: {len(verdicts) - len(sep)} of {len(verdicts)} pairs not separated")
    if not any_rows:
        out.append("No setting has two rules on common samples yet.")
    out += ["", "## What is not decided", ""] + (undecided or ["Nothing measured yet."]) + [""]
    return out


def _agreement_section(agreement: tuple, n_boot: int) -> list[str]:
    out = ["## Do the two models rank the rules alike?", ""]
    models, result = agreement
    if result is None:
        out += [f"Not measured yet: Kendall's tau needs both models' query-agnostic rows at {BUDGETS[0]} "
                f"(models with rows: {', '.join(models) or 'none'}).", ""]
        return out
    tau, common, ns = result
    out += [f"Kendall's tau-b between {models[0]} ({ns[0]} samples) and {models[1]} ({ns[1]} samples), ranking "
            f"{len(common)} rules by mean answer likelihood at {BUDGETS[0]}, query-agnostic: **{tau[0]:+.2f}** "
            f"[{tau[1]:+.2f}, {tau[2]:+.2f}] (95% percentile bootstrap, samples resampled within each model, "
            f"{n_boot} draws). " + ("The interval excludes 0: the rankings agree more than chance." if tau[1] > 0
                                    else "The interval includes 0: agreement is not shown."), ""]
    return out


def _protection_section(splits: dict) -> list[str]:
    out = ["## Does protection recover most of the gain? (arXiv 2605.18053)", "",
           "For each decomposed rule at the decomposition's budget: the rule, its score alone (`noprotect:`), its "
           "protected set alone with a random score (`protectonly:`) and `random`; the share of the rule's gain "
           "over `random` that `protectonly:` recovers, `(protectonly - random) / (rule - random)`, with a paired "
           f"bootstrap interval. The claim holds here when that interval lies above {MOST:.0%}, fails when below."
           " Not decomposed: " + "; ".join(f"`{r}` {why}" for r, why in UNDECOMPOSABLE.items()) + ".",
           "", "| rule | metric | samples | rule | noprotect | protectonly | random | gain over random | share "
           "recovered by protection | claim |", "|---|---|---|---|---|---|---|---|---|---|"]
    n = 0
    for rule in DECOMPOSED:
        for metric, label in METRICS.items():
            res = splits[(rule, metric)]
            if res is None:
                continue
            n += 1
            m, share, gain = res["means"], res["share"], res["gain"]
            claim = _claim(res)
            out.append(f"| `{rule}` | {label} | {res['n']} | {m[rule]:.3f} | {m[f'noprotect:{rule}']:.3f} | "
                       f"{m[f'protectonly:{rule}']:.3f} | {m[FLOOR]:.3f} | {_fmt_diff(gain)}, p = {gain.p:.3g} | "
                       + (f"{share.value:.2f} [{share.lo:.2f}, {share.hi:.2f}]" if share.lo is not None else
                        f"{share.value:.2f}" if share.value is not None else "-") + f" | {claim} |")
    if not n:
        out = out[:2] + ["Not measured yet: the decomposition part has no rows on samples that also have the rule "
                         "and `random` yet: `python benchmarks/findings.py --parts main,decomposition` runs them."]
    return out + [""]


def _cost_section(rows: list[dict], runs: list[dict], done: int) -> list[str]:
    added, wall = rate(runs)
    out = ["## Cost", ""]
    if not runs:
        return out + ["No logged rounds yet.", ""]
    dtypes = sorted({r.get("dtype", "?") for r in rows})
    threads = sorted({str(r.get("threads")) for r in rows})
    stopped = sum(1 for r in runs if r.get("exit", 0) != 0)
    idle = sum(1 for r in runs if r.get("exit", 0) == 0 and r["rows_after"] == r["rows_before"])
    rounds = f"{len(runs)} round{'s' if len(runs) != 1 else ''}"
    out += [f"{rounds} of `fxbudget compare` ({stopped} stopped before their end, {idle} with nothing left to run; "
            f"{rate_line(added, wall)}; {done} rows in the folders), "
            f"{', '.join(dtypes)}, {', '.join(threads)} torch thread(s), the eager kernel; the machine was shared "
            f"(load averages before/after each round in `benchmarks/results/findings/runs.jsonl`), so the rate is a "
            "floor, not a benchmark. Each round also pays fixed seconds (imports and checks, the model load, the "
            "kernel fingerprints): a round of a few rows is mostly that, a round of the full grid (19 rows per "
            "sample of `main`) much less.", ""]
    return out


def rate_line(added: int, wall: float) -> str:
    hours = wall / 3600
    per_hour = f"{added / hours:.0f} rows per hour" if wall > 0 else "no rate"
    return f"{added} rows in {wall / 60:.1f} min of wall time: {per_hour}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", action="store_true", help="print the grid, the sample size and the rows; run nothing")
    ap.add_argument("--page-only", action="store_true", help="only rewrite docs/findings.md from the rows")
    ap.add_argument("--parts", default=",".join(p.name for p in PARTS), help="comma-separated parts, in order")
    ap.add_argument("--tasks", help="a subset of the tasks (a slice of the grid: same rows)")
    ap.add_argument("--rules", help="a subset of each part's rules (a slice)")
    ap.add_argument("--budgets", help="a subset of each part's budgets (a slice)")
    ap.add_argument("--samples-per-task", type=int, help="default: from the power projection")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", help="default: bfloat16 where the CPU has it natively (see cpu_dtype), else float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ray", nargs="?", const="auto", help="run each round's samples on Ray (fxbudget compare --ray)")
    ap.add_argument("--workers", type=int, help="with --ray: workers")
    args = ap.parse_args()
    names = args.parts.split(",")
    unknown = [n for n in names if n not in {p.name for p in PARTS}]
    if unknown:
        raise SystemExit(f"--parts: unknown part {unknown[0]!r}; parts: {', '.join(p.name for p in PARTS)}")
    parts = [p for n in names for p in PARTS if p.name == n]
    full_per_task, how = samples_per_task()
    per_task = full_per_task
    if args.page_only:
        PAGE.write_text(page(PARTS, per_task, how))
        print(f"{PAGE.relative_to(ROOT)} written", file=sys.stderr)
        return 0
    if args.samples_per_task:
        per_task = args.samples_per_task
    args.tasks = tuple(args.tasks.split(",")) if args.tasks else TASKS
    if args.dtype is None:
        args.dtype, why = cpu_dtype(args.device)
        print(f"[findings] dtype {args.dtype}: {why}", file=sys.stderr)
    sliced = []
    for p in parts:
        rules = tuple(r for r in p.rules if not args.rules or r in args.rules.split(","))
        budgets = tuple(b for b in p.budgets if not args.budgets or b in args.budgets.split(","))
        if rules and budgets:
            sliced.append(replace(p, rules=rules, budgets=budgets))
    if args.plan:
        runs = [json.loads(x) for x in (OUT / "runs.jsonl").read_text().splitlines() if x] \
            if (OUT / "runs.jsonl").is_file() else []
        added, wall = rate(runs)
        print(how)
        timed = [r for p in PARTS for r in _rows(part_dir(p))]
        for p in sliced:
            n = planned_rows(p, per_task, args.tasks)
            left = n - len(_rows(part_dir(p)))
            hours = projected_hours(p, per_task * len(args.tasks), timed)
            eta = f", ~{hours:.1f} h from the committed rows' seconds" if hours is not None else ""
            print(f"{p.name}: {_model_name(p)}, {p.protocol}, {len(p.rules)} rules x {','.join(p.budgets)}: "
                  f"{n} rows ({left} left{eta}); {p.why}")
        print(f"measured: {rate_line(added, wall)}" if runs else "measured: nothing yet")
        return 0
    skipped = run_parts(sliced, per_task, args)
    PAGE.write_text(page(PARTS, full_per_task, how))
    print(f"[findings] {PAGE.relative_to(ROOT)} written", file=sys.stderr)
    for line in skipped:
        print(f"[findings] {line}", file=sys.stderr)
    return 2 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
