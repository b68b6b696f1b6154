"""The protection decomposition (issue 42): `noprotect:<rule>` is the rule's score with nothing force-kept,
`protectonly:<rule>` the rule's protected set with the rest at random; bad input is refused in one line. The kernel
fingerprint of both wrappers is every rule's: tests/test_graph.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import fxbudget
from conftest import fresh, tiny_model
from fxbudget.rules import NoProtect, ProtectOnly, Rule, get, protects_tokens, recent
from fxbudget.rules.random import Random

STEPS = 8


def _kept(model, ids, rule, budget, **kw):
    """Every layer's kept positions (per row and KV head) after the prefill and after each of `STEPS` greedy steps,
    and the logits of every call."""
    m = fxbudget.compile(fresh(model), rule=rule, budget=budget, backend=None, **kw)
    cache = m.forward.new_cache(ids.shape[0])
    kept, logits, tok = [], [], ids
    with torch.no_grad():
        for _ in range(STEPS + 1):
            out = m(input_ids=tok, past_key_values=cache)
            logits.append(out.logits[:, -1])
            kept.append([[[sorted(p for p in head if p >= 0) for head in row]
                          for row in cache.head_positions(i).tolist()] for i in range(len(cache.layers))])
            tok = out.logits[:, -1:].argmax(-1)
    return kept, torch.stack(logits)


@dataclass
class _AccAttnOnly(Rule):
    """h2o's score written out by hand, with no protected tokens."""

    name = "acc_attn_only"

    def score(self, s):
        return s.acc_attn


@dataclass
class _RandomAndRecent(Rule):
    """`random`'s draw with h2o's protected recent half, written out by hand."""

    name = "random_and_recent"

    def score(self, s):
        return Random().score(s)

    def protect(self, s):
        return recent(s, int(s.budget * 0.5))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(3)
    return tiny_model("llama"), torch.randint(0, 96, (2, 24))


def test_noprotect_is_the_score_without_protection(setup):
    model, ids = setup
    got, got_logits = _kept(model, ids, "noprotect:h2o", 10)
    want, want_logits = _kept(model, ids, _AccAttnOnly(), 10)
    assert got == want
    assert torch.equal(got_logits, want_logits)
    # ... and the protection did change what h2o keeps (else this test could not fail).
    assert _kept(model, ids, "h2o", 10)[0] != got


def test_protectonly_is_the_protected_set_and_random_rest(setup):
    model, ids = setup
    got, _ = _kept(model, ids, "protectonly:h2o", 10)
    assert got == _kept(model, ids, _RandomAndRecent(), 10)[0]
    assert got != _kept(model, ids, "random", 10)[0]  # the protected half made a difference
    assert got != _kept(model, ids, "h2o", 10)[0]  # and so did the score


def test_protectonly_with_a_covering_protected_set_is_the_rule(setup):
    # h2o protecting its whole budget (recent_ratio=1) keeps the protected set whatever the score: so does
    # protectonly:h2o, token for token.
    model, ids = setup
    got, got_logits = _kept(model, ids, "protectonly:h2o", 10, recent_ratio=1.0)
    want, want_logits = _kept(model, ids, "h2o", 10, recent_ratio=1.0)
    assert got == want
    assert torch.equal(got_logits, want_logits)


def test_protectonly_seed_changes_the_draw(setup):
    model, ids = setup
    a = _kept(model, ids, "protectonly:streamingllm", 10)[0]
    assert a == _kept(model, ids, "protectonly:streamingllm", 10)[0]  # deterministic
    assert a != _kept(model, ids, "protectonly:streamingllm", 10, random_seed=5)[0]


def test_wrappers_keep_the_rules_window_schedule_and_parameters():
    r = get("noprotect:snapkv", window=8)
    assert isinstance(r, NoProtect) and r.window == 8 and r.name == "noprotect:snapkv"
    assert r.protected_per_head(64) == 0 and r.params() == get("snapkv", window=8).params()
    p = get("protectonly:pyramidkv", random_seed=3, window=8)
    assert isinstance(p, ProtectOnly) and p.window == 8 and p.random_seed == 3
    assert p.layer_budgets(64, 4, prompt=1000) == get("pyramidkv", window=8).layer_budgets(64, 4, prompt=1000)
    assert p.protected_per_head(64) == 8
    assert get("adakv:noprotect:snapkv").head_adaptive and get("noprotect:adakv:snapkv").head_adaptive
    assert fxbudget.rules.canonical("NoProtect:SnapKV") == "noprotect:snapkv"


def test_protects_tokens():
    assert all(protects_tokens(get(r)) for r in ("snapkv", "h2o", "streamingllm", "expected_attention",
                                                   "adakv:snapkv", "protectonly:snapkv"))
    assert not any(protects_tokens(get(r)) for r in ("tova", "knorm", "random", "full", "noprotect:snapkv",
                                                       "adakv:noprotect:h2o"))
    assert not protects_tokens(get("h2o", recent_ratio=0.0))
    assert not protects_tokens(get("weighted", n_sink=0, n_recent=0))


@pytest.mark.parametrize("name, params, match", [
    ("noprotect:tova", {}, r"^rule 'noprotect:tova': 'tova' protects no tokens, so noprotect: would change nothing"),
    ("noprotect:h2o", {"recent_ratio": 0.0}, r"'h2o' protects no tokens"),
    ("noprotect:noprotect:snapkv", {}, r"'noprotect:snapkv' protects no tokens"),
    ("protectonly:full", {}, r"^rule 'protectonly:full': 'full' never evicts"),
    ("protectonly:knorm", {}, r"would be `random` under another name"),
    ("protectonly:snapkv", {"random_seed": -1}, r"random_seed must be an int >= 0"),
])
def test_bad_input_refused_in_one_line(name, params, match):
    with pytest.raises(ValueError, match=match) as e:
        get(name, **params)
    assert "\n" not in str(e.value)


# --- fxbudget compare --decompose ------------------------------------------------------------------------------------

def test_decompose_adds_both_wrappers_random_and_the_rules_params():
    from fxbudget.cli.decompose import expand

    rules, params = expand(["full", "snapkv", "h2o"], ["SnapKV"], ["snapkv.window=64", "h2o.recent_ratio=0.25"])
    assert rules == ["full", "snapkv", "noprotect:snapkv", "protectonly:snapkv", "h2o", "random"]
    assert params == ["snapkv.window=64", "h2o.recent_ratio=0.25", "noprotect:snapkv.window=64",
                      "protectonly:snapkv.window=64"]
    # random already run, a wrapper already listed: nothing doubled
    assert expand(["random", "h2o", "noprotect:h2o"], ["h2o"], [])[0] == \
        ["random", "h2o", "protectonly:h2o", "noprotect:h2o"]
    assert expand(["snapkv"], None, ["x"]) == (["snapkv"], ["x"])


def test_decompose_dry_run_plans_the_wrapped_rows(tiny_dir, tmp_path, capsys, no_model_load):
    from fxbudget.cli import main

    argv = ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--samples", "1",
            "--rules", "full,h2o", "--decompose", "h2o", "--budgets", "64", "--out", str(tmp_path / "o"),
            "--quiet", "--dry-run"]
    assert main(argv) == 0
    # full + h2o, noprotect:h2o, protectonly:h2o, random at one budget = 5 rows
    assert "--dry-run: 5 rows on 1 sample planned" in capsys.readouterr().err


@pytest.mark.parametrize("extra, match", [
    (["--rules", "full,snapkv", "--decompose", "h2o"],
     r"^fxbudget compare: --decompose h2o: h2o is not among --rules \(full, snapkv\); .* add h2o to --rules$"),
    (["--rules", "full,tova", "--decompose", "tova"], r"^fxbudget compare: --decompose tova: rule 'noprotect:tova': 'tova' protects no"),
    (["--rules", "full,snapkv", "--decompose", "full"], r"^fxbudget compare: --decompose full: rule 'noprotect:full': 'full' never"),
    (["--rules", "full,snapkv", "--decompose", "snapkvv"], r"^fxbudget compare: --decompose snapkvv: unknown rule 'snapkvv'"),
])
def test_decompose_bad_input(tiny_dir, tmp_path, capsys, no_model_load, extra, match):
    from conftest import fails_in_one_line

    fails_in_one_line(capsys, ["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300",
                               "--budgets", "64", "--out", str(tmp_path / "o"), "--dry-run", *extra], match)


def test_decomposed_run_reports_where_the_gain_comes_from(tiny_dir, tmp_path, capsys, shared_fingerprints):
    from fxbudget.cli import main
    from fxbudget.harness.report import load_rows

    out = tmp_path / "o"
    assert main(["compare", "--model", tiny_dir, "--tasks", "passkey", "--lengths", "300", "--samples", "2",
                 "--max-new-tokens", "2", "--rules", "full,h2o", "--decompose", "h2o", "--budgets", "32",
                 "--quiet", "--out", str(out)]) == 0
    rows = load_rows([out])
    assert sorted({r["rule"] for r in rows}) == ["full", "h2o", "noprotect:h2o", "protectonly:h2o", "random"]
    assert len({r["kernel_fingerprint"] for r in rows if r["rule"] != "full"}) == 1  # one kernel for all four
    report = (out / "report.md").read_text()
    section = report.split("## where the gain comes from: score or protection", 1)[1].split("\n## ", 1)[0]
    assert "| h2o | 32 | accuracy | 2 |" in section and "| h2o | 32 | likelihood | 2 |" in section
    assert "(needle_noprotect_h2o.png)" in report or "(heatmap_noprotect_h2o.png)" in report  # no colon in a link


def test_protectonly_refuses_a_replay_only_rule():
    # kvzip's replay tokens stay out of the cache only through its score (-inf): a random score would keep them
    # (the combination matrix found it: the protocol's own invariant check failed).
    with pytest.raises(ValueError, match=r"'protectonly:kvzip'.*replay tokens out by its score"):
        get("protectonly:kvzip")
    assert get("noprotect:kvzip").name == "noprotect:kvzip"  # the score stays: its protocol holds
