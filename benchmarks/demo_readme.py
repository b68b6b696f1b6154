"""Run a documented grid from scratch, keep its report in the repository, and fill the README's and the docs' sections
from it.

    OMP_NUM_THREADS=1 python benchmarks/demo_readme.py                 # make demo's grid -> docs/demo/
    OMP_NUM_THREADS=1 python benchmarks/demo_readme.py --grid 8k       # the 8K grid (issue 9) -> docs/compare_8k/
    OMP_NUM_THREADS=1 python benchmarks/demo_readme.py --grid quick    # README's quick start -> docs/quickstart/
    python benchmarks/demo_readme.py --grid gemma                      # make demo's grid on Gemma 3 270M
    OMP_NUM_THREADS=1 python benchmarks/demo_readme.py --grid quick-gemma  # the quick start on Gemma 3 270M
    python benchmarks/demo_readme.py --publish-only runs/demo          # publish an existing run (untimed), fill
    python benchmarks/demo_readme.py --fill-only [--grid G]            # only rewrite the regions from the files

README.md and docs/*.md hold marked regions (`<!-- PREFIX NAME -->` ... `<!-- /PREFIX NAME -->`, PREFIX the grid
name); everything between the markers is rewritten from the committed files of that grid (report.md, summary.csv,
paired.csv, results.jsonl, run.json, the plots, and wall.json: the command, date, machine, load and wall seconds of
the timed run; for the quick start also output.txt, what the command printed). Nothing in those regions is typed by
hand. The quick start runs as a new user's first command would: in a fresh `git clone` of this checkout's HEAD, with
an empty FXBUDGET_CACHE (so the embedded model is assembled and converted inside the timed run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib.env import ROOT, env_info, load_str  # noqa: E402

# grid name -> (the `fxbudget compare` arguments after the demo's own defaults, where its files are kept)
GRIDS = {
    "demo": ([], ROOT / "docs" / "demo"),
    # Issue 9: one-call prefill at 8K through compare, both protocols; one sample per task (each 8K prefill takes
    # minutes on this CPU, and each protocol and the unmodified model prefill apart).
    "8k": (["--lengths", "8000", "--rules", "full,streamingllm,snapkv,tova,knorm", "--budgets", "1024",
            "--samples", "1"], ROOT / "docs" / "compare_8k"),
    # README's quick start: `fxbudget compare QUICK_ARGS`, sized to take about 3 minutes on an idle 2-core CPU,
    # first model load included (two samples: the query-aware protocol separates the rules already).
    "quick": ([], ROOT / "docs" / "quickstart"),
    # Issue 41: the same two on the second embedded model (docs/embedded-models.md shows them).
    "gemma": (["--model", "gemma3-270m"], ROOT / "docs" / "demo_gemma"),
    "quick-gemma": (["--model", "gemma3-270m"], ROOT / "docs" / "quickstart_gemma"),
}
QUICK_ARGS = ["compare", "--tasks", "passkey", "--lengths", "1000", "--rules", "full,streamingllm,snapkv,tova",
              "--budgets", "128", "--samples", "2", "--protocol", "query-aware", "--out", "runs/quick"]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS, PREFIX = GRIDS["demo"][1], "demo"
KEEP = ("report.md", "summary.csv", "paired.csv", "results.jsonl", "run.json", "accuracy_vs_budget.png",
        "likelihood_vs_budget.png")


@contextlib.contextmanager
def fresh_clone():
    """A fresh `git clone` of HEAD and an empty FXBUDGET_CACHE, as a new user's first run has them: yields
    `(clone, environment, short HEAD)`, the environment naming the clone on PYTHONPATH and the empty cache."""
    with tempfile.TemporaryDirectory(prefix="fxbudget-fresh-") as tmp:
        clone, cache = Path(tmp) / "clone", Path(tmp) / "cache"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, check=True, capture_output=True,
                              text=True).stdout.strip()
        yield clone, {**os.environ, "PYTHONPATH": str(clone), "FXBUDGET_CACHE": str(cache)}, head


def run_demo(out: Path, extra: list[str], env: dict[str, str] | None = None) -> dict:
    """`python -m fxbudget.demo [EXTRA]` in a fresh clone of HEAD with an empty model and fingerprint cache, timed as
    a new user's `make demo` would be (model assembly and every kernel fingerprint included); its run folder is
    copied to `out`; `env` adds to the process's environment."""
    with fresh_clone() as (clone, fresh_env, head):
        load_before, t = load_str(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "fxbudget.demo", *extra, "--out", "runs/demo"], cwd=clone, check=True,
                       env={**fresh_env, **(env or {})})
        wall_s = round(time.perf_counter() - t, 1)
        shutil.copytree(clone / "runs" / "demo", out)
    threads = os.environ.get("OMP_NUM_THREADS")
    return {**env_info("cpu"), "command": " ".join([*([f"OMP_NUM_THREADS={threads}"] if threads else []),
                                                    "python -m fxbudget.demo", *extra]),
            "clone": head, "fxbudget_cache": "empty", "wall_s": wall_s, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "load_before": load_before, "load_after": load_str()}


def is_quick(grid: str) -> bool:
    """A quick-start grid (`fxbudget compare QUICK_ARGS` and the grid's arguments), not a `make demo` one."""
    return grid.startswith("quick")


def quick_args(grid: str) -> list[str]:
    """The grid's command; every grid but the README's has its own `--out` (one folder holds one grid: `compare`
    refuses a folder holding another model's rows)."""
    out = "runs/quick" if grid == "quick" else "runs/" + grid.replace("-", "_")
    return [out if a == "runs/quick" else a for a in QUICK_ARGS] + GRIDS[grid][0]


def run_quick(out: Path, args: list[str]) -> dict:
    """README's quick start in a fresh clone of HEAD with an empty model cache, timed; the run's folder is copied
    to `out` and what the command printed (its `[fxbudget]` lines and its output, not the progress bars; the
    temporary cache folder shown as `$FXBUDGET_CACHE`) is kept as `out/output.txt`. Records the wall seconds and the
    CPU seconds the command used (user + system): with one thread, about its wall time on an idle machine."""
    with fresh_clone() as (clone, env, head):
        load_before, t = load_str(), time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-m", "fxbudget.cli", *args], cwd=clone, env=env,
                              capture_output=True, text=True)
        wall_s = round(time.perf_counter() - t, 1)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)
        if done.returncode:
            raise SystemExit(f"the quick start failed ({done.returncode}):\n{done.stderr[-3000:]}")
        shutil.copytree(clone / args[args.index("--out") + 1], out)
    notes = [line.replace(env["FXBUDGET_CACHE"], "$FXBUDGET_CACHE") for chunk in done.stderr.splitlines()
             for line in chunk.split("\r") if line.startswith("[fxbudget]")]
    (out / "output.txt").write_text("\n".join(notes) + "\n" + done.stdout)
    return {**env_info("cpu"), "command": "OMP_NUM_THREADS=1 fxbudget " + " ".join(args),
            "clone": head, "fxbudget_cache": "empty", "wall_s": wall_s, "cpu_s": cpu_s,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "load_before": load_before, "load_after": load_str()}


def publish(run_dir: Path, wall: dict | None) -> None:
    """Copy the run's report, rows and plots (and the timing) into DOCS."""
    DOCS.mkdir(parents=True, exist_ok=True)
    _drop_figures()
    for name in KEEP + ("output.txt",) + tuple(p.name for p in _figures(run_dir)):
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, DOCS / name)
    if wall is not None:
        (DOCS / "wall.json").write_text(json.dumps(wall, indent=1, default=str) + "\n")


def _figures(folder: Path) -> list[Path]:
    """The per-rule needle figures of a report folder (heatmaps, or bars where only depth or length varies)."""
    return sorted([*folder.glob("heatmap_*.png"), *folder.glob("needle_*.png")])


def _drop_figures() -> None:
    """Remove DOCS's per-rule figures, so a report that draws other ones (or none) leaves no stale file behind."""
    for path in _figures(DOCS) if DOCS.is_dir() else []:
        path.unlink()


def _section(report: str, title: str) -> str:
    """The markdown table under `### title` in the report's "settings side by side" part."""
    side = report.split("## settings side by side", 1)[1].split("\n## ", 1)[0]
    m = re.search(rf"### {re.escape(title)}[^\n]*\n\n(\|.*?)(?:\n\n|$)", side, re.S)
    if not m:
        raise SystemExit(f"docs/demo/report.md has no '{title}' table in its settings-side-by-side part")
    return m.group(1).strip()


def _cost(report: str) -> str:
    """Each protocol's cost table, headed by the protocol (the line that says what its times are left out)."""
    out = []
    for m in re.finditer(r"## protocol: ([^,\n]+),[^\n]*\n(.*?)(?=\n## |\Z)", report, re.S):
        cost = re.search(r"### cost \(mean per sample\)\n\n(?:[^|\n][^\n]*\n\n)?(\|.*?)(?:\n\n|$)", m.group(2), re.S)
        if cost:
            out += [f"{m.group(1)}:", "", cost.group(1).strip(), ""]
    return "\n".join(out).strip()


def _minutes(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}m{seconds:02d}s"


def quick_regions() -> dict[str, str]:
    """The quick start's regions: its command, wall time and load, and what it printed."""
    wall = json.loads((DOCS / "wall.json").read_text())
    rel = DOCS.relative_to(ROOT).as_posix()
    if wall["command"].split(" fxbudget ", 1)[-1] != " ".join(quick_args(PREFIX)):
        raise SystemExit(f"{rel}/wall.json measured `{wall['command']}`, not this grid's command: rerun the grid")
    # The command as measured, its thread setting included: the time beside it is that command's.
    command = wall["command"].replace(" --rules", " \\\n    --rules")
    return {
        "command": f"```\n{command}\n```",
        "time": _minutes(wall["wall_s"]),
        "cpu": _minutes(wall["cpu_s"]),
        "threads": _threads(wall),
        "machine": f"measured {wall['date']} in a fresh clone (commit {wall['clone']}) with an empty "
                   f"`FXBUDGET_CACHE`, load average {wall['load_before']} before and {wall['load_after']} after on "
                   f"{_machine(wall)} ({rel}/wall.json)",
        "output": "```\n" + (DOCS / "output.txt").read_text().strip() + "\n```",
    }


def _machine(wall: dict) -> str:
    """The machine a timing was measured on, as wall.json records it: a time means little without it."""
    return f"a {wall['cores']}-core {wall['cpu']}"


def _threads(wall: dict) -> str:
    """The torch threads the quick start's CPU time is on, as its rows record them, and the setting that chose them."""
    threads = {json.loads(line)["threads"] for line in (DOCS / "results.jsonl").open() if line.strip()}
    if len(threads) != 1:
        raise SystemExit(f"{DOCS}/results.jsonl: rows on {sorted(threads)} threads")
    n = threads.pop()
    words = "one torch thread" if n == 1 else f"{n} torch threads"
    setting = wall["command"].split(" fxbudget", 1)[0] if wall["command"].startswith("OMP_NUM_THREADS=") else None
    return f"{words} (run with `{setting}`, as its rows record)" if setting else f"{words} (as its rows record)"


def regions() -> dict[str, str]:
    """Region name -> its text, from the files in DOCS."""
    if is_quick(PREFIX):
        return quick_regions()
    report = (DOCS / "report.md").read_text()
    wall = json.loads((DOCS / "wall.json").read_text())
    rows = sum(1 for line in (DOCS / "results.jsonl").open() if line.strip())
    rel = DOCS.relative_to(ROOT).as_posix()
    return {
        "time": _minutes(wall["wall_s"]),
        "machine": f"{_machine(wall)}, {wall['torch_threads']} torch thread{'s' if wall['torch_threads'] != 1 else ''}"
                   f", load average {wall['load_before']} before (`{wall['command']}`, {rel}/wall.json)",
        "rows": str(rows),
        "table": _section(report, "accuracy"),
        "likelihood table": _section(report, "answer log-likelihood"),
        "plots": f"![accuracy vs budget]({_link(rel)}/accuracy_vs_budget.png)\n"
                 f"![likelihood vs budget]({_link(rel)}/likelihood_vs_budget.png)",
        "paired comparisons": "The paired comparisons per budget, per protocol and task, the cost and the machine: "
                              f"[{rel}/report.md]({_link(rel)}/report.md) (regenerated by "
                              "`python benchmarks/demo_readme.py"
                              f"{'' if PREFIX == 'demo' else ' --grid ' + PREFIX}`; measured {wall['date']}"
                              + (f" in a fresh clone (commit {wall['clone']}) with an empty `FXBUDGET_CACHE`"
                                 if "clone" in wall else "") + ", load "
                              f"{wall['load_before']} before the run, {wall['load_after']} after).",
        "cost": _cost(report),
    }


def _link(rel: str) -> str:
    """`rel` (a path from the repository root) as a link from the file being filled: the docs pages live in docs/."""
    return rel.removeprefix("docs/") if _FILLING.parent.name == "docs" else rel


_FILLING = ROOT / "README.md"


def fill_readme(paths: list[Path] | None = None) -> None:
    """Rewrite this grid's regions in README.md and docs/*.md; every region of the demo and the quick start must
    be found in one of them (another grid's may be left out)."""
    global _FILLING
    found: set[str] = set()
    for path in paths or FILES:
        _FILLING = path
        text = original = path.read_text()
        for name, body in regions().items():
            inline = name in ("time", "rows", "cpu", "machine", "threads")
            tag = f"{PREFIX} {name}"
            new = f"<!-- {tag} -->{body}<!-- /{tag} -->" if inline else f"<!-- {tag} -->\n{body}\n<!-- /{tag} -->"
            # The region with its old content, or a bare marker (optionally with a note after a colon) the first time.
            pattern = rf"<!-- {re.escape(tag)}(?::[^>]*)? -->(?:.*?<!-- /{re.escape(tag)} -->)?"
            text, n = re.subn(pattern, lambda _: new, text, flags=re.S)
            if inline:  # an inline region that starts a line would start an HTML block: its sentence splits in two
                text = re.sub(rf"[ \t]*\n(?=<!-- {re.escape(tag)} -->)", " ", text)
            found |= {name} if n else set()
        if text != original:
            path.write_text(text)
    missing = sorted(set(regions()) - found)
    if missing and PREFIX != "8k":
        raise SystemExit(f"no '<!-- {PREFIX} {missing[0]} -->' marker in README.md or docs/*.md")


def use_grid(name: str) -> None:
    """Make `name` the grid that `regions` and `fill_readme` work on."""
    global DOCS, PREFIX
    DOCS, PREFIX = GRIDS[name][1], name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="demo")
    p.add_argument("--publish-only", metavar="RUN_DIR", help="publish this finished run (no timing) and fill README")
    p.add_argument("--fill-only", action="store_true", help="only rewrite the regions from the grid's files")
    p.add_argument("--rereport", action="store_true", help="rewrite the grid's report, CSV files and plots from its "
                   "committed results.jsonl with today's report code (untimed: wall.json is kept), then fill")
    a = p.parse_args()
    extra = GRIDS[a.grid][0]
    use_grid(a.grid)
    if a.publish_only:
        publish(Path(a.publish_only), None)
    elif a.rereport:
        from fxbudget.harness.report import report

        _drop_figures()
        report([DOCS])
    elif not a.fill_only:
        with tempfile.TemporaryDirectory(prefix="fxbudget-demo-") as d:
            wall = run_quick(Path(d) / a.grid, quick_args(a.grid)) if is_quick(a.grid) else \
                run_demo(Path(d) / a.grid, extra)
            publish(Path(d) / a.grid, wall)
    fill_readme()
    print(f"{DOCS.relative_to(ROOT)}/, README.md and docs/*.md updated from {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
