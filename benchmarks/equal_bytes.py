"""The equal-bytes grid (issue 58, item 4): each byte budget spent as {16-bit, fp8, int8, int4 slots} x {rule}, on
the one kernel, with paired tests; the docs page `docs/equal_bytes.md` regenerated from its committed rows.

    python benchmarks/equal_bytes.py --plan          # the grid, its rows and cost; runs nothing
    python benchmarks/equal_bytes.py                 # run (or resume) every storage's folder, then write the page
    python benchmarks/equal_bytes.py --page-only     # only rewrite docs/equal_bytes.md from the committed rows

**The question** ("More Tokens, Lower Precision", Zhang et al., arXiv 2412.12706): with X MiB for the KV cache, keep
fewer entries in 16 bits or more of them quantized, and chosen by which rule? A byte budget (`--budgets 1MiB`) buys
`tokens_for_bytes` entries per layer and KV head in the run's slot storage (`--slot-dtype`, bookkeeping included),
so every cell of a budget holds the same bytes; only the storage and the rule differ, on one kernel.

**The grid.** The findings page's six RULER tasks (`findings.TASKS`), at `LENGTH` tokens (half the findings length:
the grid is 16 cells a budget), the embedded Qwen2.5-Coder-0.5B-Instruct, query-agnostic, `RULES` at `BUDGETS`, one
`fxbudget compare` folder per storage under `benchmarks/results/equal_bytes/`, run in rounds of one sample per task
(each round resumes its folder), two folders at a time (one torch thread each). The model runs in float32 on a CPU
without native bfloat16 (`findings.cpu_dtype`); its 16-bit point is then `bfloat16` slots (a cast, as a bf16 model
stores its cache), and the unmodified model (`full`, a float32 cache of every token) is the reference, in the
`bfloat16` folder. On a bf16 model `bfloat16` slots are the model's own dtype.

**The page.** Per budget: every cell (storage x rule) with the entries it bought and the bytes it held, its answer
log-likelihood per token and accuracy, ranked; every pair of cells by the paired sign-flip test, Holm-adjusted over
all pairs of the budget; whether the best is separated from the worst; and the paper's claim per rule (int4 slots
against 16-bit slots at equal bytes, Holm over the rules).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import ROOT, load_str  # noqa: E402
from findings import (ACCURACY, LIKELIHOOD, METRICS, SEED, TASKS, _fmt_diff, _last, _rel, _rows,  # noqa: E402
                      aligned, cpu_dtype, decide, rate)

LENGTH = 1024
BUDGETS = ("1MiB", "2MiB")
STORAGES = ("bfloat16", "float8_e4m3fn", "int8", "int4")
SIXTEEN = "bfloat16"  # the 16-bit point the paper's claim is checked against
REFERENCE_IN = SIXTEEN  # the folder that also runs `full`, the unmodified model
RULES = ("streamingllm", "snapkv", "knorm", "expected_attention")
PER_TASK = 3  # 18 paired samples: Holm over a budget's 120 cell pairs can reach p < 0.05 (2 / 2^18 x 120 < 1e-3)
PROTOCOL = "query-agnostic"
OUT = ROOT / "benchmarks" / "results" / "equal_bytes"
PAGE = ROOT / "docs" / "equal_bytes.md"
CLAIM = "int4"  # "more tokens, lower precision": int4 slots against 16-bit ones, per rule


def folder(storage: str) -> Path:
    return OUT / storage


def rules_of(storage: str) -> tuple[str, ...]:
    return (("full",) if storage == REFERENCE_IN else ()) + RULES


def compare_command(storage: str, samples: int, *, tasks=TASKS, dtype: str = "float32", threads: int = 1,
                    out: Path | None = None, rules=None, budgets=BUDGETS) -> list[str]:
    """The `fxbudget compare` arguments of one round of `storage`'s folder (after `python -m fxbudget.cli`): the
    grid's, or another folder's `rules` at `budgets` on the grid's samples (benchmarks/quantized_cache.py)."""
    return ["compare", "--tasks", ",".join(tasks), "--lengths", str(LENGTH), "--samples", str(samples),
            "--seed", str(SEED), "--rules", ",".join(rules or rules_of(storage)), "--budgets", ",".join(budgets),
            "--slot-dtype", storage, "--protocol", PROTOCOL, "--device", "cpu", "--dtype", dtype,
            "--threads", str(threads), "--quiet", "--out", _rel(out or folder(storage))]


def planned_rows(per_task: int = PER_TASK, tasks=TASKS) -> int:
    cells = sum(1 if r == "full" else len(BUDGETS) for s in STORAGES for r in rules_of(s))
    return len(tasks) * per_task * cells


def run(per_task: int, args) -> None:
    """Every storage's folder in rounds of one sample per task, `args.parallel` folders at a time (a folder is never
    run by two rounds at once); one line per round in `runs.jsonl`."""
    OUT.mkdir(parents=True, exist_ok=True)
    locks = {s: threading.Lock() for s in STORAGES}
    log = threading.Lock()
    failed: list[str] = []

    def one(n: int, storage: str) -> None:
        if failed:
            return
        with locks[storage]:
            cmd = compare_command(storage, n, tasks=args.tasks, dtype=args.dtype, threads=args.threads)
            before, load_before, t0 = len(_rows(folder(storage))), load_str(), time.perf_counter()
            started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            print(f"[equal_bytes] {storage}, round {n}/{per_task}: fxbudget {shlex.join(cmd)}", file=sys.stderr)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
            rc = subprocess.run([sys.executable, "-m", "fxbudget.cli", *cmd], cwd=ROOT, env=env).returncode
            line = {"storage": storage, "round": n, "command": "fxbudget " + shlex.join(cmd), "started": started,
                    "wall_s": round(time.perf_counter() - t0, 1), "rows_before": before,
                    "rows_after": len(_rows(folder(storage))), "exit": rc, "load_before": load_before,
                    "load_after": load_str()}
            with log, (OUT / "runs.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
            if rc != 0:
                failed.append(f"{storage} round {n}: fxbudget compare exited {rc}")

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(lambda item: one(*item), [(n, s) for n in range(1, per_task + 1) for s in STORAGES]))
    if failed:
        raise SystemExit(f"[equal_bytes] {failed[0]}; rerun the same command to resume (the rows written are kept)")


# ----------------------------------------------------------------------------------------------------------------
# The page: everything below reads rows only.


def cell(r: dict) -> str:
    return f"{r.get('slot_dtype') or 'model'} / {r['rule']}"


def by_budget(rows: list[dict], metric: str) -> dict:
    """{budget label: {cell: {(task, length, sample): value}}} of the budgeted rows."""
    out: dict = {}
    for r in rows:
        if r["rule"] == "full" or r.get(metric) is None or r.get("budget_bytes") is None:
            continue
        out.setdefault(r["budget_bytes"], {}).setdefault(cell(r), {})[(r["task"], r["length"], r["sample"])] = \
            float(r[metric])
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _cell_table(rows: list[dict], budget: int, values: dict, acc: dict) -> list[str]:
    """The cells of one budget ranked by mean answer likelihood, with what each bought and held."""
    import numpy as np

    mine = [r for r in rows if r.get("budget_bytes") == budget]
    bought = {c: sorted({r["budget"] for r in mine if cell(r) == c}) for c in values}
    held = {c: np.median([r["kv_held_bytes"] for r in mine if cell(r) == c and r.get("kv_held_bytes")])
            for c in values}
    out = ["| rank | storage / rule | entries per layer and KV head | held (median) | answer log-likelihood per "
           "token | accuracy |", "|---|---|---|---|---|---|"]
    ranked = sorted(values, key=lambda c: (-float(values[c].mean()), c))
    for i, c in enumerate(ranked, 1):
        a = acc.get(c)
        out.append(f"| {i} | `{c}` | {', '.join(map(str, bought[c]))} | {_mib(held[c])} | "
                   f"{values[c].mean():.3f} | " + (f"{a:.2f}" if a is not None else "-") + " |")
    return out


def claim(values: dict) -> list[dict]:
    """Per rule with both cells: `CLAIM` slots against `SIXTEEN` slots (paired), Holm over the rules."""
    from fxbudget.harness.stats import holm, paired_diff

    tests = [(rule, paired_diff(values[f"{CLAIM} / {rule}"], values[f"{SIXTEEN} / {rule}"])) for rule in RULES
             if f"{CLAIM} / {rule}" in values and f"{SIXTEEN} / {rule}" in values]
    adjusted = holm([d.p for _, d in tests]) if tests else []
    return [{"rule": rule, "diff": d, "p_holm": p} for (rule, d), p in zip(tests, adjusted)]


def _budget_section(rows: list[dict], budget: int, by_cell: dict, acc_by_cell: dict) -> tuple[list[str], str]:
    import numpy as np

    keys, values = aligned(by_cell)
    if len(values) < 2 or not keys:
        return [f"## {_mib(budget)}", "", "Not two cells on common samples yet.", ""], ""
    _, acc = aligned(acc_by_cell, list(values))
    acc_mean = {c: float(np.mean(v)) for c, v in acc.items()}
    verdicts = decide(values)
    sep = [v for v in verdicts if v["separated"]]
    best, worst = verdicts[0]["a"], _last(values)  # `decide` orders the cells by mean
    bw = next(v for v in verdicts if v["a"] == best and v["b"] == worst)
    tied = [v["b"] for v in verdicts if v["a"] == best and not v["separated"]]
    below = [v["b"] for v in verdicts if v["a"] == best and v["separated"]]
    out = [f"## {_mib(budget)} of KV cache", "",
           f"{len(values)} cells on {len(keys)} paired samples (task x sample), ranked by answer log-likelihood "
           "per token:", ""] + _cell_table(rows, budget, values, acc_mean) + [""]
    out.append(f"Best `{best}` against worst `{worst}`: {_fmt_diff(bw['diff'])}, p (Holm over {len(verdicts)} "
               f"pairs) = {bw['p_holm']:.3g}: " + ("**separated**." if bw["separated"] else "not separated."))
    out.append(f"Not separated from the best: {', '.join(f'`{c}`' for c in tied) or 'none'}; separated below it: "
               f"{', '.join(f'`{c}`' for c in below) or 'none'}; {len(sep)} of {len(verdicts)} pairs separated in all.")
    tests = claim(values)
    if tests:
        out += ["", f"The paper's claim, `{CLAIM}` slots against `{SIXTEEN}` slots at these bytes (paired, Holm "
                f"over {len(tests)} rules):", ""]
        for t in tests:
            d = t["diff"]
            verdict = ("more tokens at lower precision win" if t["p_holm"] < 0.05 and d.mean > 0 else
                       "fewer tokens at 16 bits win" if t["p_holm"] < 0.05 else "not separated")
            out.append(f"- `{t['rule']}`: {_fmt_diff(d)}, p (Holm) = {t['p_holm']:.3g}: {verdict}")
    lead = (f"- **{_mib(budget)}**: best `{best}`, worst `{worst}`, "
            + (f"separated (p = {bw['p_holm']:.3g}, Holm over {len(verdicts)} pairs)" if bw["separated"] else
               f"not separated (p = {bw['p_holm']:.3g})")
            + (f"; `{CLAIM}` beats `{SIXTEEN}` for {sum(t['p_holm'] < 0.05 and t['diff'].mean > 0 for t in tests)}"
               f" of {len(tests)} rules" if tests else "") + ".")
    return out + [""], lead


def _reference_lines(rows: list[dict]) -> list[str]:
    import numpy as np

    full = [r for r in rows if r["rule"] == "full"]
    if not full:
        return []
    ll = [r[LIKELIHOOD] for r in full if r.get(LIKELIHOOD) is not None]
    acc = [r[ACCURACY] for r in full if r.get(ACCURACY) is not None]
    held = np.median([r["kv_held_bytes"] for r in full if r.get("kv_held_bytes")])
    return [f"The unmodified model (`full`: every token, a float32 cache, {_mib(held)} held at the median) on "
            f"{len(full)} samples: answer log-likelihood per token {np.mean(ll):.3f}, accuracy {np.mean(acc):.2f}.",
            ""]


def page(rows: list[dict] | None = None, runs: list[dict] | None = None, per_task: int = PER_TASK) -> str:
    """The equal-bytes page from the rows of every storage's folder (or `rows`) and `runs.jsonl` (or `runs`)."""
    if rows is None:
        rows = [r for s in STORAGES for r in _rows(folder(s))]
    if runs is None:
        path = OUT / "runs.jsonl"
        runs = [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []
    planned = planned_rows(per_task)
    lines = ["# Equal bytes: fewer tokens in 16 bits, or more of them quantized?", "",
             "<!-- generated by `python benchmarks/equal_bytes.py --page-only` from benchmarks/results/equal_bytes/: "
             "do not edit by hand -->", ""]
    if len(rows) < planned:
        lines += ["!!! warning \"Partial\"", f"    {len(rows)} of {planned} planned rows are in.", ""]
    models = sorted({r["model"] for r in rows}) or ["none"]
    dtypes = sorted({r.get("dtype", "?") for r in rows}) or ["?"]
    lines += ["The question of \"More Tokens, Lower Precision\" (Zhang et al., arXiv 2412.12706): with X MiB for the "
              "KV cache, keep fewer entries in 16 bits or more of them quantized, chosen by which rule?", ""]
    lines += [f"Each budget is a size of the whole model's KV cache; every cell spends it in one slot storage "
              f"(`fxbudget compare --slot-dtype`) and one rule, on the one kernel (the storage is a kernel setting, "
              f"recorded in each row and its fingerprint). Model: {', '.join(models)} in {', '.join(dtypes)}; "
              f"RULER's {len(TASKS)} tasks of the findings page at {LENGTH} tokens, {PROTOCOL}; "
              f"`{SIXTEEN}` is the 16-bit storage. Rows: `benchmarks/results/equal_bytes/<storage>/`; "
              "the grid and how it runs: `benchmarks/equal_bytes.py`.", "",
              "What a budget covers: the slots eviction manages (`tokens_for_bytes`: entries per layer and KV head, "
              "bookkeeping included). The protocol's head-room comes on top, in the same storage: the question, "
              "appended with eviction frozen, and the decoded tokens, so a row's held bytes (measured after "
              "decoding) exceed its budget by the tokens it appended, by more in a wider storage (a bf16 entry is "
              "2.8x an int4 one): a 16-bit cell holds more than the bytes it is ranked at, never less.", "",
              "What the storages are: one float32 scale per entry and KV head over its `d` numbers, symmetric absmax "
              "(`fxbudget.kernel.slot_storage`), for keys and values alike; no per-channel grouping of keys and no "
              "full-precision window of recent tokens (KIVI's and `QuantizedCache`'s choices). At a covering budget "
              "int4 slots already cost the model most of its greedy tokens "
              "([slot_storage_error.md](../benchmarks/results/slot_storage_error.md)); the paper quantized with its "
              "own grouping, so a refutation here is of this int4, not of every 4-bit cache "
              "([QuantizedCache at the same bytes](../benchmarks/results/quantized_cache.md)).", ""]
    lines += _reference_lines(rows)
    sections, leads = [], []
    acc = by_budget(rows, ACCURACY)
    for budget, by_cell in sorted(by_budget(rows, LIKELIHOOD).items()):
        sec, lead = _budget_section(rows, budget, by_cell, acc.get(budget, {}))
        sections += sec
        leads += [lead] if lead else []
    lines += ["## The answer", ""] + (leads or ["Nothing decided yet: no budget has two cells on common "
                                                "samples."]) + [""]
    lines += ["Tests: the paired sign-flip test on answer log-likelihood per token (the primary metric; "
              f"{METRICS[ACCURACY]} is shown beside it), Holm-adjusted; separated at p < 0.05. The effect is the "
              "mean paired difference with the interval of the same test.", ""]
    lines += sections
    added, wall = rate(runs)
    if runs:
        lines += ["## Cost", "", f"{len(runs)} rounds of `fxbudget compare`, two at a time on a 2-core CPU (one torch "
                  f"thread each, eager kernel): {added} rows in {wall / 60:.1f} min summed over the rounds, "
                  f"{added / (wall / 3600):.0f} rows per hour per process; the machine was shared part of the time "
                  "(load averages in `benchmarks/results/equal_bytes/runs.jsonl`).", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", action="store_true", help="print the grid and its rows; run nothing")
    ap.add_argument("--page-only", action="store_true", help="only rewrite docs/equal_bytes.md from the rows")
    ap.add_argument("--samples-per-task", type=int, default=PER_TASK)
    ap.add_argument("--tasks", help="a subset of the tasks (a slice of the grid: same rows)")
    ap.add_argument("--dtype", help="default: bfloat16 where the CPU has it natively, else float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=2, help="folders run at once")
    args = ap.parse_args()
    if args.page_only:
        PAGE.write_text(page())
        print(f"{PAGE.relative_to(ROOT)} written", file=sys.stderr)
        return 0
    args.tasks = tuple(args.tasks.split(",")) if args.tasks else TASKS
    if args.dtype is None:
        args.dtype, why = cpu_dtype("cpu")
        print(f"[equal_bytes] dtype {args.dtype}: {why}", file=sys.stderr)
    if args.plan:
        print(f"{planned_rows(args.samples_per_task, args.tasks)} rows: {len(STORAGES)} storages x "
              f"{len(RULES)} rules x {len(BUDGETS)} budgets (+ full) x {len(args.tasks)} tasks x "
              f"{args.samples_per_task} samples")
        for s in STORAGES:
            print(f"fxbudget {shlex.join(compare_command(s, args.samples_per_task, tasks=args.tasks, dtype=args.dtype))}")
        return 0
    run(args.samples_per_task, args)
    PAGE.write_text(page())
    print(f"[equal_bytes] {PAGE.relative_to(ROOT)} written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
