"""What `--model`, `--device` and `--dtype` resolve to before anything loads (`model_source`, `devices`), and what
`load_model` then loads."""

from argparse import Namespace

import pytest
import torch

from fxbudget.models import devices
from fxbudget.cli.preflight import UsageError, placement
from fxbudget.models.source import DEFAULT_MODEL_NAME, resolve_model
from fxbudget.models import load_model


def test_local_directory_gguf_and_default(tiny_dir, tmp_path):
    src = resolve_model(tiny_dir)
    assert (src.kind, src.location, src.pretrained_kwargs()) == ("dir", tiny_dir, {})
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    src = resolve_model(str(gguf))
    assert (src.kind, src.location, src.gguf_file, src.name) == ("gguf", str(tmp_path), "m.gguf", "m.gguf")
    assert resolve_model(None).name == DEFAULT_MODEL_NAME
    assert resolve_model(tiny_dir, trust_remote_code=True).pretrained_kwargs() == {"trust_remote_code": True}


def test_hub_ids_online_are_left_to_the_hub(monkeypatch):
    monkeypatch.setattr("fxbudget.models.source.hub_offline", lambda: False)
    src = resolve_model("Qwen/Qwen2.5-0.5B-Instruct", revision="abc123")
    assert (src.kind, src.location, src.name) == ("hub", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct@abc123")
    assert src.pretrained_kwargs() == {"revision": "abc123"}  # no trust_remote_code unless asked


def test_offline_hub_id_missing_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr("fxbudget.models.source.hub_offline", lambda: True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache .*offline \(HF_HUB_OFFLINE\)"):
        resolve_model("someorg/absent-model")


@pytest.mark.parametrize("spec, kwargs, match", [
    ("/nonexistent", {}, "does not exist"),
    ("x y z", {}, "not a valid hub id"),
    (None, {"revision": "v1"}, "--revision needs --model with a hub id"),
])
def test_bad_specs(spec, kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_model(spec, **kwargs)


def test_devices_and_dtypes(monkeypatch):
    assert devices.resolve("cpu") == devices.Placement("cpu", "float32")
    assert devices.resolve("cpu", "bfloat16").torch_dtype() is torch.bfloat16
    for bad, match in (({"device": "mps"}, "unknown device"), ({"device": "cuda:x"}, "unknown device"),
                       ({"dtype": "fp16"}, "unknown dtype; use one of float32, bfloat16, float16")):
        with pytest.raises(ValueError, match=match):
            devices.resolve(**bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve() == devices.Placement("cpu", "float32")  # the default without a GPU
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        devices.resolve("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.resolve() == devices.Placement("cuda:0", "bfloat16")  # the default with one: cuda, bf16
    assert devices.resolve("cuda:1", "float16") == devices.Placement("cuda:1", "float16")
    with pytest.raises(ValueError, match=r"only 2 CUDA GPU\(s\) are visible"):
        devices.resolve("cuda:2")


def test_ray_devices_follow_the_gpus_per_worker():
    args = Namespace(device=None, dtype=None, gpus_per_worker=None)
    assert placement(args, ray=True) == devices.Placement("cpu", "float32")
    args.gpus_per_worker = 1.0
    assert placement(args, ray=True) == devices.Placement("cuda:0", "bfloat16")
    with pytest.raises(UsageError, match="--device cpu with --ray needs --gpus-per-worker 0"):
        placement(Namespace(device="cpu", dtype=None, gpus_per_worker=1.0), ray=True)
    with pytest.raises(UsageError, match="--device cuda with --ray needs --gpus-per-worker > 0"):
        placement(Namespace(device="cuda", dtype=None, gpus_per_worker=None), ray=True)


def test_load_model_dtype_and_device(tiny_dir):
    model, tok, name = load_model(tiny_dir, progress=False, device="cpu", dtype="bfloat16")
    p = next(model.parameters())
    assert (p.dtype, p.device.type, name) == (torch.bfloat16, "cpu", resolve_model(tiny_dir).name)
    assert model.config._attn_implementation == "sdpa" and not model.training
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tiny_dir, progress=False, dtype="float64")
