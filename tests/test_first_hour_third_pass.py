"""Issue 50, items 2 and 4 (item 1, Ctrl-C, is tests/test_interrupt.py): one folder holds one grid, and the small
traps: `--lengths 0` names its flag, the estimate says when the machine is busy, the report's paired intervals follow
one rule, its cost heading agrees with its text, its answers summary does not name a rule by accident, the opening
paragraph says why two samples separate nothing; the docs never send two commands into one folder."""

import json
import re
from pathlib import Path

import pytest

from conftest import fails_in_one_line
from fxbudget.cli import main, sizes
from fxbudget.harness import report as R
from test_report import row

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--tasks", "passkey", "--lengths", "300", "--samples", "1", "--max-new-tokens", "2", "--quiet",
         "--rules", "full,snapkv", "--budgets", "32"]


# --- item 2: one folder, one grid -------------------------------------------------------------------------------

def _folder(tmp_path, model="tiny", **fields) -> Path:
    """A folder holding one row of this command's grid, with `fields` changed."""
    out = tmp_path / "run"
    out.mkdir(parents=True)
    r = {"key": "k", "model": model, "dtype": "float32", "device": "cpu", "protocol": "query-agnostic",
         "rule": "full", **fields}
    (out / "results.jsonl").write_text(json.dumps(r) + "\n")
    return out


@pytest.mark.parametrize("fields, match", [
    ({"model": "gemma-3-270m"}, r"--out \S+ holds rows of another model \(gemma-3-270m; this command: \S+\): one "
                                r"folder holds one grid; give this command another --out \(`fxbudget report \S+ OTHER` "
                                r"reads several folders together\)$"),
    ({"dtype": "bfloat16"}, r"holds rows of another dtype \(bfloat16; this command: float32\)"),
    ({"device": "cuda:0"}, r"holds rows of another device \(cuda; this command: cpu\)"),
    ({"protocol": "query-aware"}, r"holds rows of protocol query-aware \(this command: query-agnostic\): one folder "
                                  r"holds one grid; give this command another --out .*, or run them together with "
                                  r"--protocol query-agnostic,query-aware$"),
])
def test_a_folder_of_another_setting_is_refused_before_the_model(tiny_dir, tmp_path, capsys, no_model_load,
                                                                 fields, match):
    from fxbudget.models.source import resolve_model

    out = _folder(tmp_path, **{"model": resolve_model(tiny_dir).name, **fields})
    before = (out / "results.jsonl").read_text()
    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, *SMALL, "--out", str(out)], match)
    assert (out / "results.jsonl").read_text() == before and sorted(p.name for p in out.iterdir()) == ["results.jsonl"]


def test_a_folder_of_the_same_setting_is_not_refused(tmp_path):
    from fxbudget.cli import folder

    out = _folder(tmp_path, device="cuda:1")  # shards of one grid on two GPUs of one kind
    folder.check(out, folder.Identity("tiny", "float32", "cuda:0", ("query-agnostic", "query-aware")))
    folder.check(tmp_path / "missing", folder.Identity("tiny", "float32", "cpu", ("query-aware",)))


def test_a_folder_of_another_signal_set_is_refused_before_the_model(tiny_dir, tmp_path, capsys, no_model_load):
    """The signal set is a kernel setting: budgeted rows of h2o's set (acc_attn) and a command of snapkv's
    (window_attn) would be two kernels in one report. Rows without a recorded set measured every signal."""
    from fxbudget.models.source import resolve_model

    name = resolve_model(tiny_dir).name
    for fields, theirs in (({"signals": "acc_attn"}, "acc_attn"), ({}, "all")):
        out = _folder(tmp_path / theirs, model=name, rule="h2o", budget=32, kernel_fingerprint="f", **fields)
        fails_in_one_line(capsys, ["compare", "--model", tiny_dir, *SMALL, "--out", str(out)],
                          rf"holds budgeted rows measured with another signal set \({theirs}; this command: "
                          r"window_attn; .*or pass --signals all to both$")


def test_a_folder_of_the_same_signal_set_or_of_full_rows_is_not_refused(tmp_path):
    from fxbudget.cli import folder

    same = _folder(tmp_path / "same", rule="snapkv", budget=32, kernel_fingerprint="f", signals="window_attn")
    folder.check(same, folder.Identity("tiny", "float32", "cpu", ("query-agnostic",), "window_attn"))
    full = _folder(tmp_path / "full", signals=None, kernel_fingerprint=None)  # the unmodified model's row
    folder.check(full, folder.Identity("tiny", "float32", "cpu", ("query-agnostic",), "acc_attn"))
    with pytest.raises(ValueError, match="another signal set"):
        folder.check(same, folder.Identity("tiny", "float32", "cpu", ("query-agnostic",), "all"))


def test_documented_commands_never_share_a_folder_and_the_readme_names_the_second_model():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    seen: dict[str, tuple[str, str]] = {}
    for page in pages:
        text = page.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for command in re.split(r"\n(?!\s)", block.replace("\\\n", " ")):
                m = re.search(r"fxbudget compare .*?--out (\S+)", command)
                if not m or "..." in command:
                    continue
                key = re.sub(r"\s+", " ", command.split("#")[0]).strip()
                if m.group(1) in seen and seen[m.group(1)][1] != key:
                    other = seen[m.group(1)][0]
                    raise AssertionError(f"--out {m.group(1)}: {page.name} and {other} run different commands in it")
                seen.setdefault(m.group(1), (page.name, key))
    assert "runs/quick" in seen and seen["runs/quick"][1].count("--model") == 0
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "gemma3-270m" in x)
    assert "docs/embedded-models.md" in line, line


def test_a_report_of_two_models_names_them_as_the_cause_of_two_kernels():
    rows = [row("snapkv", 0), row("snapkv", 0, model="other", kernel_fingerprint="cd" * 32)]
    rows[1]["key"] += "|other"
    text = R.markdown(rows, [])
    assert "**2 different kernel fingerprints** — the rows are of 2 models (merged folders?)" in text
    assert "rules did not run the same kernel" not in text


# --- item 4: the small traps ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "300,0", "-5"])
def test_lengths_below_one_name_the_flag_and_the_help(capsys, value):
    with pytest.raises(SystemExit) as e:
        main(["compare", "--lengths", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fxbudget compare: argument --lengths: lengths must be positive ints (tokens), got {value!r} "
                   "(see `fxbudget compare --help`)"), err


def test_a_busy_machine_is_said_beside_the_estimate():
    assert sizes.load_warning("cpu", 1, calibrated=False, load=0.6, cores=2) is None
    busy = sizes.load_warning("cpu", 1, calibrated=False, load=2.5, cores=2)
    assert busy == ("warning: the load average is 2.50 on 2 cores (this run takes 1 torch thread): other work shares "
                    "the CPU, so expect longer than estimated; the estimate assumes an otherwise idle machine")
    assert sizes.load_warning("cpu", 2, calibrated=True, load=0.6, cores=2).endswith(
        "the estimate counts only the load its earlier runs saw")  # two threads on two cores: any other work shows
    assert sizes.load_warning("cuda:0", 1, calibrated=False, load=9.0, cores=2) is None


def test_the_uncalibrated_estimate_says_it_assumes_an_idle_machine():
    from fxbudget.harness.grid import Grid, Unit
    from fxbudget.harness.tasks import Sample

    grid = Grid(tasks=["passkey"], lengths=[300], rules=["full"], budgets=[32], samples=1)
    sample = Sample("passkey", "c", "q", ["1"], max_new_tokens=5)
    line = sizes.estimate_line(grid, [(Unit("passkey", 300, 0), [("query-agnostic", "full", None)])],
                               {("passkey", 300): [sample]}, [(("passkey", 300), sample, 100, 10, 3)], None, "cpu",
                               None)
    assert " on the reference machine, not this one (an idle 2-core Intel Xeon with AVX-512, one torch thread: " in line


def test_paired_intervals_follow_one_rule_for_accuracy_and_likelihood():
    from fxbudget.harness.stats import paired_diff, samples_to_separate

    n = samples_to_separate()
    for k in (2, n - 1):  # 0/1 scores (accuracy) and continuous values (likelihood): no interval below n
        assert not paired_diff([1.0] * k, [0.0] * k).bounded
        assert not paired_diff([0.5 + i for i in range(k)], [0.0] * k).bounded
    assert paired_diff([1.0] * n, [0.0] * n).bounded and paired_diff([0.5 + i for i in range(n)], [0.0] * n).bounded
    two = [row("full", i) for i in range(2)] + [row("snapkv", i) for i in range(2)] + \
        [row("tova", i, score=0.0, logprob=-2.0) for i in range(2)]
    table = R.paired_tables(two)
    assert "[-" not in table and "-1.00 (n=2: too few samples for an interval)" in table, table


def test_cost_heading_agrees_with_its_text_and_the_answers_summary_names_no_rule():
    text = R.markdown([row("full", 0), row("snapkv", 0)], [])
    cost = text.split("### cost (mean per sample)\n\n", 1)[1].split("\n\n", 1)[0]
    assert "measured once per sample" in cost and "one sample each" not in cost, cost
    summary = re.search(r"<summary>(expected vs each rule's output[^<]*)</summary>", text).group(1)
    assert "full:" not in summary and "results.jsonl" in summary, summary


def test_two_samples_say_why_even_0_against_1_is_not_separated():
    from fxbudget.harness.lead import lead_paragraph

    rows = [row("snapkv", i) for i in range(2)] + [row("streamingllm", i, score=0.0) for i in range(2)] + \
        [row("tova", i) for i in range(2)]
    text = lead_paragraph(rows)
    assert ("but not separated from any other rule: 2 paired samples cannot separate even 0.00 from 1.00 (the "
            "paired test's smallest possible p is 2/2^2 = 0.5; a pair needs at least 7 paired samples, every one won "
            "by the same rule)") in text, text
    eight = [row("snapkv", i) for i in range(8)] + [row("tova", i, score=float(i % 2)) for i in range(8)]
    assert "cannot separate even" not in lead_paragraph(eight)  # 8 samples could: the sentence is not said


def test_the_readme_says_how_many_threads_its_cpu_time_is_on():
    from fxbudget.harness.results import read_rows

    readme = (ROOT / "README.md").read_text()
    sentence = re.search(r"used <!-- quick cpu -->.*?\.", readme, re.S).group(0)
    threads = {r["threads"] for r in read_rows(ROOT / "docs" / "quickstart" / "results.jsonl")}
    wall = json.loads((ROOT / "docs" / "quickstart" / "wall.json").read_text())
    assert threads == {wall["torch_threads"]} == {1} and wall["command"].startswith("OMP_NUM_THREADS=1 ")
    assert "OMP_NUM_THREADS=1" in sentence and "one torch thread" in sentence, sentence


def test_the_demo_on_another_model_has_its_own_folder():
    from fxbudget.demo import demo_args

    def out(args):
        return args[len(args) - 1 - args[::-1].index("--out") + 1]

    assert out(demo_args([])) == "runs/demo"
    assert out(demo_args(["--model", "gemma3-270m"])) == "runs/demo_gemma3-270m"  # make demo-gemma
    assert out(demo_args(["--model=gemma3-270m", "--out", "runs/g"])) == "runs/g"
