"""`--model random:CONFIG` (issue 55, item 2): the main job on a machine that holds no weights (a borrowed GPU): a
config's architecture with seeded random weights and a byte-level tokenizer, through `fxbudget compare` end to end.
The rows name the model by the spec that reruns it, the report says that its accuracy is meaningless, and a bad
spec is one line before anything loads."""

import json

import pytest
import torch

from conftest import fails_in_one_line
from fxbudget.cli import main
from fxbudget.models import load_model
from fxbudget.models.byte_tokenizer import byte_tokenizer
from fxbudget.models.source import resolve_model

CONFIG = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
          "pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(CONFIG))
    return path


def test_the_spec_resolves_without_loading(config):
    src = resolve_model(f"random:{config},layers=2,seed=7")
    assert (src.kind, src.layers, src.seed, src.location) == ("random", 2, 7, str(config.resolve()))
    assert src.name == f"random:{config},layers=2,seed=7"
    assert resolve_model(f"random:{config.parent}/tiny-llama.json").name.endswith(",seed=0")


def test_same_seed_same_model_and_bytes_round_trip(config):
    a, tok, name = load_model(f"random:{config},layers=2,seed=3", device="cpu")
    b, _, _ = load_model(f"random:{config},layers=2,seed=3", device="cpu", with_tokenizer=False)
    c, _, _ = load_model(f"random:{config},layers=2,seed=4", device="cpu", with_tokenizer=False)
    assert a.config.num_hidden_layers == 2 and name.startswith("random:")
    w = [m.model.layers[1].self_attn.q_proj.weight for m in (a, b, c)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    text = "The pass key is 68342. Remember it."
    assert tok.decode(tok(text)["input_ids"]) == text and max(tok(text)["input_ids"]) < 256
    assert len(byte_tokenizer()) == 259 and byte_tokenizer().chat_template is None


def test_compare_runs_end_to_end_and_says_accuracy_is_meaningless(config, tmp_path, capsys):
    out = tmp_path / "run"
    spec = f"random:{config},layers=2,seed=0"
    argv = ["compare", "--model", spec, "--tasks", "passkey", "--lengths", "400", "--samples", "1",
            "--max-new-tokens", "3", "--rules", "full,snapkv,knorm", "--budgets", "64", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "seeded random weights: it answers nothing, accuracy is meaningless" in err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {r["model"] for r in rows} == {spec}
    assert len({r["kernel_fingerprint"] for r in rows if r["rule"] != "full"}) == 1
    report = (out / "report.md").read_text()
    assert f"**seeded random weights** (`{spec}`): such a model answers nothing" in report


@pytest.mark.parametrize("spec,match", [
    ("random:", r"no config file at '\(empty\)'"),
    ("random:/nonexistent/config.json", r"no config file at '/nonexistent/config.json'"),
    ("random:{config},layers=0", r"'layers=0' is not layers=N \(N >= 1\) or seed=S"),
    ("random:{config},depth=2", r"'depth=2' is not layers=N"),
    ("random:{notjson}", r"is not JSON"),
    ("random:{notype}", r"has no model_type"),
])
def test_a_bad_spec_is_one_line_before_anything_loads(spec, match, config, tmp_path, capsys, no_model_load):
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "notype.json").write_text(json.dumps({"hidden_size": 8}))
    spec = spec.format(config=config, notjson=tmp_path / "bad.json", notype=tmp_path / "notype.json")
    fails_in_one_line(capsys, ["compare", "--model", spec, "--rules", "snapkv", "--out", str(tmp_path / "o")], match)
