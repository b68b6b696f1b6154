"""The prepared GPU run's dry run (issue 51, item 2): every step of benchmarks/gpu/lease.py at tiny sizes on the CPU,
so a script bug is found here and not in a 15-minute GPU lease. It checks the files the run writes (at most 8 come
back from the GPU machine), that every step ran ok with its checks passing, and the summary table printed last."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "lease.py"


def _steps():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import lease as gpu_lease
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu_lease.STEPS, gpu_lease.BOXES


def test_time_boxes_fit_the_lease():
    steps, boxes = _steps()
    assert set(boxes) == set(steps)
    assert sum(boxes.values()) <= 480  # 8 minutes of a 15-minute lease, cold compiles included


@pytest.mark.lease_dry_run  # CI runs it on the oldest torch the package declares (make test-oldest-torch)
def test_dry_run_runs_every_step(tmp_path):
    out = tmp_path / "lease"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--dry-run", "--out", str(out), "--budget-s", "900"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    steps, _ = _steps()
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + log[-4000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["log.txt", "rows.jsonl", "summary.md"]
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    checks = [r for r in rows if r["kind"] == "check"]
    assert checks and all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]
    assert {r["step"] for r in rows if r["kind"] == "key"} == set(steps)  # every step reached its key numbers
    assert {r["side"] for r in rows if r["kind"] == "prefill"} == {"full", "eager", "compiled"}
    # Issue 58: the decode step with the dry run's second slot storage, beside the model-dtype one, at its budget.
    quantized = [r for r in rows if r["kind"] == "decode" and r.get("slot_dtype")]
    assert [(r["side"], r["budget"]) for r in quantized] == [("fxbudget B=32 evicting, int8 slots", 32)], quantized
    assert quantized[0]["ms"] > 0 and quantized[0]["kv_bytes"] > 0
    # The main job (issue 55): compare end to end per backend, its rows and report folded into rows.jsonl.
    runs = [r for r in rows if r["kind"] == "compare-run"]
    assert [r["backend"] for r in runs] == ["none", "aot_eager"] and all(r["rc"] == 0 for r in runs), runs
    assert all("**seeded random weights**" in r["report"] and r["s_per_row"] > 0 for r in runs)
    assert {r["rule"] for r in rows if r["kind"] == "compare-row"} == {"full", "snapkv", "h2o"}
    # The summary table is the last thing printed: one row per step, every one ok.
    tail = proc.stdout.strip().splitlines()
    table = [line for line in tail if line.startswith("| ") and not line.startswith("| step")]
    assert [line.split("|")[1].strip() for line in table] == list(steps)
    assert all(line.split("|")[2].strip() == "ok" for line in table), table
    assert tail[-1].startswith(f"{len(steps)} steps in ")
    assert "| step | status | seconds | key numbers |" in (out / "summary.md").read_text()


@pytest.mark.lease_dry_run  # on the oldest torch, as the GPU image's
def test_flex_check_dry_run_in_bf16():
    """The next lease's bf16 check of the flex form (benchmarks/studies/flex_gpu_check.py) on the CPU: every case
    runs both forms, the attention signals agree and each form is within bf16's bounds of the float64 block form."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "studies" / "flex_gpu_check.py"), "--device",
                           "cpu", "--dtype", "bfloat16"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    cases = [line for line in lines if "sum(attn) flex/blocks" in line]
    assert len(cases) == 5 and all(line.endswith("flex/blocks 1.000000") for line in cases), cases
    assert len([line for line in lines if "against float64 (error / bound)" in line]) == 5, lines
    assert lines[-1].endswith("(within bfloat16's bounds)"), lines[-1]


def test_random_weights_are_seeded_and_per_tensor():
    # The GPU run compares kept sets on the GPU with the same weights on the CPU: a model built twice with one seed
    # must be identical, and layer i's weights must not depend on how many layers were asked.
    import torch

    from fxbudget.models import load_config, load_random

    tiny = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 64, "num_hidden_layers": 24, "tie_word_embeddings": True}
    a, b = load_random(tiny, seed=3, layers=2), load_random(tiny, seed=3, layers=2)
    assert a.config.num_hidden_layers == 2 and load_config(tiny).num_hidden_layers == 24
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    one = load_random(tiny, seed=3, layers=1).state_dict()
    assert torch.equal(one["model.layers.0.self_attn.q_proj.bias"], sa["model.layers.0.self_attn.q_proj.bias"])
    assert not torch.equal(load_random(tiny, seed=4, layers=1).state_dict()["model.embed_tokens.weight"],
                           one["model.embed_tokens.weight"])
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied, as the config says
    assert torch.equal(a.model.norm.weight, torch.ones(32))
    with pytest.raises(ValueError, match="no model_type"):
        load_config({"hidden_size": 8})
