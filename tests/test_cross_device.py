"""benchmarks/cross_device.py: dump + compare are exact on identical runs and do detect a different rule."""

import base64
import gzip
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fxbudget.rules import plain_generation_rules

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))  # the script imports benchlib, beside it
xd = importlib.import_module("cross_device")

# kvzip evicts only in its replay protocol (tests/test_kvzip.py)
RULES = plain_generation_rules()
SMALL = ["--lengths", "300", "--budgets", "48,96", "--steps", "4"]



@pytest.fixture(scope="module")
def eager_dumps(tiny_dir, tmp_path_factory):
    """The same eager configuration dumped twice (two independent runs), every evicting rule."""
    d = tmp_path_factory.mktemp("dumps")
    paths = [d / "a.json.gz", d / "b.json"]
    for p in paths:
        assert xd.main(["dump", "--model", tiny_dir, *SMALL, "--out", str(p)]) == 0
    return [xd.load(p) for p in paths]


def test_same_configuration_twice_is_identical(eager_dumps, tmp_path):
    a, b = eager_dumps
    assert [e["rule"] for e in a["entries"]] == [r for r in RULES for _ in (48, 96)]
    res = xd.compare(a, b)
    assert len(res["rows"]) == 2 * len(RULES) and not res["only_a"] and not res["only_b"]
    for r in res["rows"]:
        assert r["prefill_min"] == 1.0 and r["decode_min"] == 1.0 and r["heads_differing"] == 0, r
        assert r["tokens_agree"] and r["first_diff"] is None and r["unexplained"] == 0, r
    # The prompt (~300 context tokens) overflows both budgets, so the kept sets are real choices.
    e = a["entries"][0]
    kept = xd.unpack(e["prefill"]["kept"][0][0], e["prefill"]["seen"])
    assert e["prefill"]["seen"] > 300 and kept.sum() == e["budget"]
    assert all(len(layer) == 2 for layer in e["cut_margins"]) and len(e["tokens"]) == 4
    # The command line writes the table.
    xd.save(a, tmp_path / "a.json")
    xd.save(b, tmp_path / "b.json.gz")
    md = tmp_path / "x.md"
    assert xd.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json.gz"), "--md", str(md)]) == 0
    assert "| 300 | snapkv | 48 | 1 | 1 | 1 | 1 | 0 / 4 |" in md.read_text() and "near-ties A / B (<= 1e-06)" in \
        md.read_text()


def test_a_different_rule_is_detected(eager_dumps):
    """Relabel knorm's entries as h2o's: the comparison must see different kept sets (it can fail)."""
    a, b = eager_dumps
    swapped = json.loads(json.dumps(b))
    knorm = {e["budget"]: e for e in swapped["entries"] if e["rule"] == "knorm"}
    swapped["entries"] = [dict(knorm[e["budget"]], rule="h2o") for e in swapped["entries"] if e["rule"] == "h2o"]
    rows = xd.compare(a, swapped)["rows"]
    assert len(rows) == 2
    for r in rows:
        assert r["prefill_mean"] < 1.0 and r["heads_differing"] > 0 and r["unexplained"] > 0, r


def test_other_prompts_are_refused(eager_dumps):
    a, b = eager_dumps
    other = json.loads(json.dumps(b))
    other["prompts"]["300"]["sha256"] = "0" * 64
    with pytest.raises(ValueError, match="different prompts"):
        xd.compare(a, other)


def test_compiled_dump_matches_eager(eager_dumps, tiny_dir, tmp_path):
    """The compiled path (aot_eager: the rewritten graph, no Inductor codegen) keeps what the eager kernel keeps,
    which also shows the eager dump's score recorder does not change the rule's choice."""
    out = tmp_path / "c.json"
    assert xd.main(["dump", "--model", tiny_dir, *SMALL, "--budgets", "48", "--rules", "h2o",
                    "--backend", "aot_eager", "--out", str(out)]) == 0
    c = xd.load(out)
    assert c["env"]["backend"] == "aot_eager" and all(e["cut_margins"] is None for e in c["entries"])
    res = xd.compare(eager_dumps[0], c)
    assert [(r["rule"], r["budget"]) for r in res["rows"]] == [("h2o", 48)]
    assert len(res["only_a"]) == 2 * len(RULES) - 1
    for r in res["rows"]:
        assert r["prefill_min"] == 1.0 and r["decode_min"] == 1.0 and r["tokens_agree"], r
        assert r["near_ties_b"] is None and r["near_ties_a"] is not None


def test_cut_margins():
    pos = torch.arange(6).view(1, 1, 6).expand(1, 3, 6).clone()
    score = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.5, 0.0],
                           [8.0, 4.0, 4.0, 4.0, 2.0, -2.0],
                           [8.0, 5.0, -1e-5, -2e-5, 2.0, -2.0]]])
    # Keep 3: the margin is (lowest kept - highest dropped) / the larger magnitude of the two. Head 0: (2 - 1) / 2.
    # Head 1: the cut splits the equal 4s: an exact tie (kept by position). Head 2: 2 vs -1e-5 at the cut.
    assert xd.cut_margins(score, pos, None, 3) == [0.5, 0.0, pytest.approx((2.0 + 1e-5) / 2.0)]
    # The scale is the scores at the cut, not the largest score: 1e-5 vs 2e-5 differ by half of their size.
    assert xd.cut_margins(score, pos, None, 4)[2] == pytest.approx(0.5)
    # Protected candidates score +inf and empty slots -inf: a cut between protected ones (head 0) or against empty
    # slots (head 1) has no margin. Head 2 with 8 and 5 protected: (inf inf 2 | -1e-5 ...).
    protect = torch.zeros(1, 3, 6, dtype=torch.bool)
    protect[0, 0, :4] = True
    protect[0, 2, :2] = True
    empty = pos.clone()
    empty[0, 1, 3:] = -1
    assert xd.cut_margins(score, empty, protect, 3) == [None, None, pytest.approx((2.0 + 1e-5) / 2.0)]
    assert xd.cut_margins(score, pos, None, 6) == [None, None, None]  # everything fits


def test_ties_explain_differences(eager_dumps):
    """A differing head counts as explained when either dump has an exact or near tie at its cut."""
    a, b = eager_dumps
    other = json.loads(json.dumps(b))
    e = next(e for e in other["entries"] if e["rule"] == "h2o" and e["budget"] == 48)
    bits = xd.unpack(e["prefill"]["kept"][0][0], e["prefill"]["seen"])
    kept, dropped = bits.nonzero()[0], (~bits).nonzero()[0]
    bits[kept[0]], bits[dropped[0]] = False, True  # swap one position at the cut of layer 0, head 0
    e["prefill"]["kept"][0][0] = base64.b64encode(np.packbits(bits).tobytes()).decode()
    for margin, unexplained, exact, near in ((0.5, 1, 0, 0), (0.0, 0, 1, 0), (1e-7, 0, 0, 1)):
        e["cut_margins"][0][0] = margin
        r = next(r for r in xd.compare(a, other)["rows"] if r["rule"] == "h2o" and r["budget"] == 48)
        assert r["heads_differing"] == 1 and r["unexplained"] == unexplained, (margin, r)
        assert r["exact_ties_b"] - r["exact_ties_a"] == exact and r["near_ties_b"] - r["near_ties_a"] == near


def test_gzip_dump_is_reproducible(eager_dumps, tmp_path):
    xd.save(eager_dumps[0], tmp_path / "x.json.gz")
    xd.save(eager_dumps[0], tmp_path / "y.json.gz")
    assert (tmp_path / "x.json.gz").read_bytes() == (tmp_path / "y.json.gz").read_bytes()
    assert json.loads(gzip.decompress((tmp_path / "x.json.gz").read_bytes()))["format"] == xd.FORMAT


def test_dump_defaults_to_what_compare_picks(tmp_path, monkeypatch, capsys):
    """No --device/--dtype: cuda in bfloat16 when a GPU is visible, the CPU in float32 otherwise (as `compare`); a GPU
    that is not there is refused in one line before any model work."""
    import fxbudget.models

    seen = []

    def load_model(spec, **kwargs):
        seen.append((kwargs["device"], kwargs["dtype"]))
        raise RuntimeError("stop after the placement")

    monkeypatch.setattr(fxbudget.models, "load_model", load_model)
    with pytest.raises(RuntimeError, match="stop after"):
        xd.main(["dump", "--out", str(tmp_path / "x.json")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="stop after"):
        xd.main(["dump", "--out", str(tmp_path / "x.json")])
    with pytest.raises(RuntimeError, match="stop after"):
        xd.main(["dump", "--device", "cpu", "--out", str(tmp_path / "x.json")])
    assert seen == [("cpu", "float32"), ("cuda:0", "bfloat16"), ("cpu", "float32")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        xd.main(["dump", "--device", "cuda", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "no CUDA GPU is visible" in capsys.readouterr().err
    assert len(seen) == 3 and not (tmp_path / "x.json").exists()
