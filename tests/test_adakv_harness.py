"""The harness and CLI with head-adaptive rules (issue 22, ADAKV.md): `adakv:<rule>` names in `compare --rules`,
`--param` reaching the wrapper and the wrapped rule, every rule of a run with a head-adaptive rule on the pooled
layout (one kernel fingerprint per run), and `allocation` / `layout` in every row, the summary and the report's
header. Tiny random models, eager kernel and aot_eager."""

import pytest

from fxbudget.cli import main
from fxbudget.harness import report as R
from fxbudget.harness.grid import Grid, Unit, row_key
from fxbudget.harness.report import load_rows

# The runs here are on one tiny model: each (rule, layout) fingerprint is traced once, not once per run and backend.
pytestmark = pytest.mark.usefixtures("shared_fingerprints")


def _row(rule, sample=0, **kw):
    """A result row with the fields the report reads (as the runner writes them)."""
    ref = rule == "full"
    r = {"model": "m", "dtype": "float32", "device": "cpu", "torch": "t", "transformers": "tf", "fxbudget": "f",
         "threads": 1, "kernel_fingerprint": None if ref else "ab" * 32, "protocol": "query-aware",
         "chunk_size": None, "backend": "none", "task": "passkey", "length": 1000, "n_tokens": 997,
         "context_tokens": 1021, "rule": rule, "budget": None if ref else 8, "budget_fraction": None, "score": 1.0,
         "prediction": "1", "answers": ["1"], "depth": 0.5, "answer_logprob_mean": -0.5, "prefill_s": 1.0,
         "decode_s": 1.0, "likelihood_s": 0.1, "output_tokens": 1, "kv_allocated_bytes": 2048,
         "kv_held_bytes": 1024, "compile_s": 0.0, "shared_prefill": False, "branch_s": None,
         "window": None if ref else 32, "sample": sample, "seed": 0, **kw}
    r["key"] = f"{rule}|{sample}|{r.get('layout')}"
    return r


def _header(rows) -> str:
    return next(line for line in R.markdown(rows, []).splitlines() if line.startswith("- allocation"))


def test_report_header_names_allocation_and_layout():
    pooled = [_row("full", allocation=None, layout=None), _row("snapkv", allocation="uniform", layout="head-pool"),
              _row("adakv:snapkv", allocation="adakv", layout="head-pool")]
    assert _header(pooled) == ("- allocation over KV heads: adakv (adakv:snapkv); uniform (snapkv); cache layout: "
                               "head-pool")
    # Rows written before AdaKV carry neither field: they ran uniform on slots.
    assert _header([_row("snapkv"), _row("knorm")]) == ("- allocation over KV heads: uniform (knorm, snapkv); cache "
                                                         "layout: slots")
    mixed = pooled + [_row("snapkv", 1, allocation="uniform", layout="slots")]
    assert "**2 different layouts (head-pool, slots)**" in _header(mixed)
    summary = {(s["rule"]): s for s in R.summarize(pooled)}
    assert (summary["adakv:snapkv"]["allocation"], summary["adakv:snapkv"]["layout"]) == ("adakv", "head-pool")
    assert (summary["snapkv"]["allocation"], summary["snapkv"]["layout"]) == ("uniform", "head-pool")
    assert (summary["full"]["allocation"], summary["full"]["layout"]) == (None, None)


def test_a_head_adaptive_rule_pools_every_rule_of_its_run():
    unit = Unit("passkey", 300, 0)
    ada = Grid(rules=["full", "snapkv", "adakv:snapkv"], budgets=[48])
    ada.validate()
    assert ada.head_pool() and ada.layout() == "head-pool"
    uni = Grid(rules=["full", "snapkv"], budgets=[48])
    uni.validate()
    assert not uni.head_pool() and uni.layout() == "slots"
    # The same uniform rule is another row in a pooled run (another kernel), the reference row is the same one.
    k_ada, k_uni = (row_key("m", g, unit, "query-aware", "snapkv", 48) for g in (ada, uni))
    assert k_ada == k_uni + "|head-pool"
    assert row_key("m", ada, unit, "query-aware", "full", None) == row_key("m", uni, unit, "query-aware", "full", None)


def test_params_reach_the_wrapper_and_the_wrapped_rule():
    from fxbudget.rules import get

    g = Grid(rules=["adakv:snapkv", "snapkv"], budgets=[48],
             rule_params={"adakv:snapkv": {"alpha": 0.1, "window": 16, "kernel": 5}, "snapkv": {"window": 16}})
    g.validate()
    rule = get("adakv:snapkv", **g.rule_params["adakv:snapkv"])
    assert rule.params()["alpha"] == 0.1 and rule.rule.window == 16 and rule.rule.kernel == 5
    with pytest.raises(ValueError, match=r"adakv:snapkv has no hyperparameter 'nope'; its hyperparameters: alpha, "
                                         r"window, kernel, pooling"):
        Grid(rules=["adakv:snapkv"], rule_params={"adakv:snapkv": {"nope": 1}}).validate()
    with pytest.raises(ValueError, match=r"unknown rule 'adakv:bogus'"):
        Grid(rules=["adakv:snapkv"], rule_params={"adakv:bogus": {"alpha": 1}}).validate()
    with pytest.raises(ValueError, match=r"observation window"):  # one window per run, the wrapped rule's counts
        Grid(rules=["adakv:snapkv", "snapkv"], rule_params={"adakv:snapkv": {"window": 16}}).validate()


@pytest.mark.parametrize("argv, message", [
    (["--rules", "full,adakv:full"], "adakv:full"),
    (["--rules", "adakv:snapkv", "--param", "adakv:snapkv.alpha=1.5"], "alpha"),
    (["--rules", "adakv:snapkv", "--param", "adakv:snapkv.window=64", "--budgets", "32"], "budget 32"),
])
def test_bad_adaptive_input_fails_before_any_model_work(tmp_path, capsys, argv, message):
    # The model path does not exist: reaching a model load would fail differently.
    assert main(["compare", "--model", str(tmp_path / "no-model"), "--tasks", "passkey", "--lengths", "300",
                 "--budgets", "48", *argv, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def _compare(tiny_dir, out, rules, *extra):
    assert main(["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--rules", rules,
                 "--budgets", "48", "--samples", "2", "--max-new-tokens", "4", "--quiet",
                 "--protocol", "query-agnostic,streaming", "--out", str(out), *extra]) == 0
    return load_rows([out])


@pytest.mark.parametrize("backend", ["none", "aot_eager"])
def test_compare_runs_adaptive_and_uniform_rules_on_one_pooled_kernel(tiny_dir, tmp_path, backend, capsys):
    rows = _compare(tiny_dir, tmp_path / "pooled", "full,snapkv,adakv:snapkv", "--param",
                    "adakv:snapkv.alpha=0.1", "--backend", backend)
    assert "cache layout head-pool (a head-adaptive rule: every rule pooled)" in capsys.readouterr().err
    budgeted = [r for r in rows if r["rule"] != "full"]
    assert {(r["rule"], r["allocation"], r["layout"]) for r in budgeted} == {
        ("snapkv", "uniform", "head-pool"), ("adakv:snapkv", "adakv", "head-pool")}
    assert all(r["allocation"] is None and r["layout"] is None for r in rows if r["rule"] == "full")
    assert {r["rule_params"]["alpha"] for r in budgeted if r["rule"] == "adakv:snapkv"} == {0.1}
    prints = {r["kernel_fingerprint"] for r in budgeted}
    assert len(prints) == 1  # one kernel for the uniform and the adaptive rule
    text = (tmp_path / "pooled" / "report.md").read_text()
    assert "one shared kernel for every rule" in text
    assert "- allocation over KV heads: adakv (adakv:snapkv); uniform (snapkv); cache layout: head-pool" in text

    # The uniform rule alone runs on slots, another kernel; pooled with f = B it keeps the same sets, so its answers
    # and answer likelihoods are the unpooled run's.
    alone = _compare(tiny_dir, tmp_path / "slots", "snapkv", "--backend", backend)
    assert "cache layout slots)" in capsys.readouterr().err
    assert {(r["allocation"], r["layout"]) for r in alone} == {("uniform", "slots")}
    assert {r["kernel_fingerprint"] for r in alone}.isdisjoint(prints)
    pooled = {(r["protocol"], r["sample"]): r for r in budgeted if r["rule"] == "snapkv"}
    assert len(pooled) == len(alone) == 4
    for r in alone:
        p = pooled[(r["protocol"], r["sample"])]
        assert p["prediction"] == r["prediction"]
        assert p["answer_logprob"] == pytest.approx(r["answer_logprob"], abs=1e-5)
