"""The findings run (benchmarks/findings.py) and the rank agreement it adds (`fxbudget.harness.rank_agreement`): Kendall's
tau-b against hand-counted pairs, its bootstrap interval, and the page's verdicts on rows built so that
the right answer is known (no model)."""

import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from fxbudget.harness.rank_agreement import kendall_tau, kendall_tau_interval

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
findings = importlib.import_module("findings")


# --- Kendall's tau-b: hand-counted ---------------------------------------------------------------------------------

def test_kendall_tau_one_swap():
    # Pairs of 4 items: 6; only (2, 3) is discordant: (5 - 1) / 6.
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)


def test_kendall_tau_b_with_ties():
    # x ties pair (1, 2), y ties pair (2, 3); the other 4 pairs concordant: 4 / sqrt((6 - 1) * (6 - 1)) = 0.8.
    assert kendall_tau([1, 2, 2, 3], [1, 2, 3, 3]) == pytest.approx(0.8)


def test_kendall_tau_reversed_and_all_tied():
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="same length >= 2"):
        kendall_tau([1, 2], [1, 2, 3])


def test_kendall_tau_interval_far_apart_rules_is_a_point():
    # Three rules 10 apart with noise 0.1: every resample ranks them the same way, in both experiments.
    rng = np.random.default_rng(1)
    a = {r: m + 0.1 * rng.standard_normal(12) for r, m in (("x", 0.0), ("y", 10.0), ("z", 20.0))}
    same = {r: v[::-1] for r, v in a.items()}
    reverse = {"x": a["z"], "y": a["y"], "z": a["x"]}
    assert kendall_tau_interval(a, same) == (1.0, 1.0, 1.0)
    assert kendall_tau_interval(a, reverse) == (-1.0, -1.0, -1.0)


def test_kendall_tau_interval_of_indistinguishable_rules_spans_zero():
    # Every rule draws from one distribution: the resampled rankings go every way.
    rng = np.random.default_rng(2)
    a = {r: rng.standard_normal(8) for r in "wxyz"}
    b = {r: rng.standard_normal(8) for r in "wxyz"}
    tau, lo, hi = kendall_tau_interval(a, b)
    assert lo < 0 < hi and lo <= tau <= hi
    with pytest.raises(ValueError, match="same two or more rules"):
        kendall_tau_interval(a, {"w": b["w"], "x": b["x"]})


# --- the page's verdicts on rows with a known answer ---------------------------------------------------------------

def _row(model, rule, sample, lik, score=0.0, protocol="query-agnostic", frac=0.125, task="ruler:vt"):
    return {"model": model, "rule": rule, "protocol": protocol, "budget_fraction": frac, "task": task,
            "length": 2048, "sample": sample, "answer_logprob_mean": lik, "score": score, "dtype": "float32",
            "threads": 1, "key": f"{model}|{rule}|{sample}|{protocol}|{frac}"}


def test_decide_separates_only_the_pair_the_samples_separate():
    # a beats b by 1 on all 8 samples (sign-flip p = 2/2^8), c = b plus alternating noise (mean 0 difference).
    b = np.linspace(-3, -1, 8)
    values = {"a": b + 1.0, "b": b, "c": b + np.tile([0.1, -0.1], 4)}
    verdicts = {(v["a"], v["b"]): v for v in findings.decide(values)}
    assert verdicts[("a", "b")]["separated"] and verdicts[("a", "c")]["separated"]
    assert not verdicts.get(("b", "c"), verdicts.get(("c", "b")))["separated"]
    # Holm over 3 pairs: the two smallest p (2/256 each) times 3 and 2, kept monotone -> both 3 x 2/256.
    assert verdicts[("a", "b")]["p_holm"] == pytest.approx(3 * 2 / 256)
    assert verdicts[("a", "b")]["diff"].mean == pytest.approx(1.0)


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setattr(findings, "OUT", tmp_path / "findings")
    for p in findings.PARTS:
        (tmp_path / "findings" / p.name).mkdir(parents=True)
    return tmp_path / "findings"


def _write(folder: Path, rows):
    with (folder / "results.jsonl").open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_page_on_a_partial_run_says_partial_and_what_it_decides(out):
    m = "Qwen2.5-Coder-0.5B-Instruct"
    _write(out / "main", [_row(m, "snapkv", i, -1.0 - 0.01 * i) for i in range(8)]
           + [_row(m, "streamingllm", i, -2.0 - 0.01 * i) for i in range(8)])
    (out / "runs.jsonl").write_text(json.dumps({"part": "main", "round": 1, "wall_s": 1800.0, "rows_before": 0,
                                                "rows_after": 16, "exit": 0}) + "\n")
    text = findings.page(findings.PARTS, per_task=4, how="24 paired samples")
    assert "Partial: a first part" in text and "16 of 1056 planned rows" in text
    assert "1 of 1 pairs separated" in text and "`snapkv` > `streamingllm`: +1.000" in text
    assert "p (Holm) = 0.00781" in text  # 2/2^8, one pair
    assert "Not measured yet: Kendall's tau" in text and "Not measured yet: the decomposition" in text
    assert "(2 rules, 8 paired samples): `snapkv` has the highest answer likelihood, separated from every other " \
           "rule; 1 of 1 pairs separated in all." in text
    assert "1 round of `fxbudget compare` (0 stopped before their end, 0 with nothing left to run; 16 rows in 30.0 " \
           "min of wall time: 32 rows per hour" in text


def test_page_measures_rank_agreement_and_the_protection_claim(out):
    qwen, gemma = "Qwen2.5-Coder-0.5B-Instruct", "gemma-3-270m-it"
    means = {"random": -3.0, "streamingllm": -2.5, "snapkv": -1.0, "h2o": -1.5}
    rows = []
    for model, sign in ((qwen, 1), (gemma, 1)):
        for r, mean in means.items():
            rows += [_row(model, r, i, mean + 0.01 * ((i * 7 + hash(r) % 5) % 3)) for i in range(8)]
    # snapkv's protected set alone recovers exactly 80% of its gain over random on every sample; h2o's 20%.
    for i in range(8):
        for rule, share in (("snapkv", 0.8), ("h2o", 0.2)):
            gain = next(r["answer_logprob_mean"] for r in rows if r["model"] == qwen and r["rule"] == rule
                        and r["sample"] == i) - next(r["answer_logprob_mean"] for r in rows if r["model"] == qwen
                                                      and r["rule"] == "random" and r["sample"] == i)
            base = next(r["answer_logprob_mean"] for r in rows if r["model"] == qwen and r["rule"] == "random"
                        and r["sample"] == i)
            rows += [_row(qwen, f"protectonly:{rule}", i, base + share * gain),
                     _row(qwen, f"noprotect:{rule}", i, base)]
    _write(out / "main", rows)
    text = findings.page(findings.PARTS, per_task=4, how="x", n_boot=200)
    assert f"Kendall's tau-b between {qwen} (8 samples) and {gemma} (8 samples)" in text
    assert "**+1.00** [+1.00, +1.00]" in text and "the rankings agree more than chance" in text
    # the wrappers are not ranked with the rules: 4 rules, 6 pairs, in the decided list
    assert f"**{qwen}, query-agnostic, 12.5% budget, answer log-likelihood per token, 4 rules on 8 samples**" in text
    # the answer first: the leader per setting, the agreement and the claim in a line each
    lead = text.split("## The answer so far", 1)[1].split("## What is decided", 1)[0]
    assert f"- **{qwen}, query-agnostic, 12.5% budget** (4 rules, 8 paired samples): `snapkv` has the highest " \
           "answer likelihood, separated from every other rule; 6 of 6 pairs separated in all." in lead
    assert "rankings at 12.5%: Kendall's tau +1.00 [+1.00, +1.00] (8 and 8 samples): they agree more" in lead
    assert "on answer likelihood: `snapkv`: holds; `h2o`: fails." in lead
    line = next(x for x in text.splitlines() if x.startswith("| `snapkv` | answer log-likelihood"))
    assert "0.80 [0.80, 0.80] | holds |" in line
    line = next(x for x in text.splitlines() if x.startswith("| `h2o` | answer log-likelihood"))
    assert "0.20 [0.20, 0.20] | fails |" in line
    # accuracy is 0 for every rule: no gain to split
    line = next(x for x in text.splitlines() if x.startswith("| `snapkv` | accuracy"))
    assert "no gain over random to split" in line


# --- the run: commands, dtype, parts that cannot run yet -----------------------------------------------------------

def test_compare_command_is_the_parts_data():
    second = next(p for p in findings.PARTS if p.name == "second-model")
    cmd = findings.compare_command(second, 3, ray="auto", workers=4)
    assert cmd[:3] == ["compare", "--model", findings.SECOND_MODEL]
    assert cmd[cmd.index("--rules") + 1] == ",".join(second.rules)
    assert cmd[cmd.index("--samples") + 1] == "3" and cmd[cmd.index("--lengths") + 1] == "2048"
    assert cmd[-4:] == ["--ray", "auto", "--workers", "4"]
    decomposition = next(p for p in findings.PARTS if p.name == "decomposition")
    assert set(decomposition.rules) == {f"{w}:{r}" for w in ("noprotect", "protectonly")
                                        for r in ("snapkv", "h2o", "expected_attention")}
    assert len(findings.RULES) >= 9 and findings.FLOOR in findings.RULES  # 8 rules and the floor


def test_projected_hours_from_the_rows_seconds():
    # One shared prefill of 10 s per sample, 2 s of each budgeted row's own work; main also runs the unmodified
    # model (10 + 2 s) and 9 rules x 2 budgets: 10 + 12 + 18 x 2 = 58 s per sample.
    rows = [{"model": "Qwen2.5-Coder-0.5B-Instruct", "rule": "snapkv", "shared_prefill": True, "prefill_s": 10.0,
             "branch_s": 0.5, "replay_s": None, "decode_s": 1.0, "likelihood_s": 0.5}] * 3
    main = findings.PARTS[0]
    assert findings.projected_hours(main, 24, rows) == pytest.approx(24 * 58 / 3600)
    assert findings.projected_hours(findings.PARTS[2], 24, rows) is None  # no rows of the second model


def test_cpu_dtype_needs_native_bf16():
    assert findings.cpu_dtype(cpuinfo="flags\t: fpu avx2 fma\n")[0] == "float32"
    assert findings.cpu_dtype(cpuinfo="flags\t: fpu avx2 avx512f avx512_bf16\n") == \
        ("bfloat16", "the CPU has avx512_bf16")
    assert findings.cpu_dtype("cuda")[0] == "bfloat16"


def test_a_part_with_an_unknown_rule_says_so():
    part = findings.Part("x", findings.EMBEDDED, "query-agnostic", ("snapkv", "nosuch:snapkv"), ("12.5%",), "")
    assert findings.missing(part) == "rule nosuch:snapkv is not known to this checkout"
    assert findings.missing(findings.PARTS[0]) is None
    other = findings.Part("y", "nosuch-270m", "query-agnostic", ("snapkv",), ("12.5%",), "")
    assert findings.missing(other) == ("--model nosuch-270m is not an embedded model of this checkout (it comes with "
                                       "the reach issue)")


def test_the_committed_page_is_what_the_committed_rows_give():
    # docs/findings.md is generated: after new rows (or a checkout where a blocked part can run), rerun
    # `python benchmarks/findings.py --page-only`.
    per_task, how = findings.samples_per_task()
    assert (ROOT / "docs" / "findings.md").read_text() == findings.page(findings.PARTS, per_task, how)
