"""CUDA only (`-m cuda`; benchmarks/gpu/run.sh runs them first): no host sync in a warm decode step, CUDA graphs engage
for it, and the compiled bucketed path equals the eager one in bf16 on the device.

Where no GPU is present (no `nvidia-smi`) these are skipped, and `make test` reports them as such; where one is, they
run, and a torch that cannot reach it fails them rather than skipping.
"""

import shutil

import pytest
import torch

import fxbudget
from conftest import fresh, tiny_model

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs a CUDA GPU (no nvidia-smi here)")]


def _model(dtype=torch.float32):
    return tiny_model("qwen3").to("cuda", dtype)


def _ids(n, seed=0):
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_warm_decode_step_does_not_sync(backend):
    # torch's own detector: any synchronizing CUDA call (.item(), a device-to-host copy, nonzero, ...) raises.
    m = fxbudget.compile(fresh(_model()), rule="snapkv", budget=8, backend=backend)
    ids = _ids(12)
    with torch.no_grad():
        cache = m(input_ids=ids).past_key_values
        m(input_ids=ids[:, -1:], past_key_values=cache, attention_mask=torch.ones(1, 13, dtype=torch.long,
                                                                                     device="cuda"))
        mask = torch.ones(1, 14, dtype=torch.long, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            m(input_ids=ids[:, -1:], past_key_values=cache, attention_mask=mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_cudagraphs_engage_for_generate():
    from torch._dynamo.utils import counters

    kw = dict(rule="snapkv", budget=16)
    ref = fxbudget.compile(fresh(_model()), backend=None, **kw)
    m = fxbudget.compile(fresh(_model()), backend="inductor", cudagraphs=True, **kw)
    counters.clear()
    with torch.no_grad(), torch._inductor.config.patch({"triton.cudagraph_or_error": True}):  # a skip raises
        for seed, n in enumerate((10, 23, 10)):  # the third reuses generate()'s cache and the recorded graphs
            ids = _ids(n, seed)
            got = m.generate(ids, max_new_tokens=6, do_sample=False)
            want = ref.generate(ids, max_new_tokens=6, do_sample=False)
            assert torch.equal(got, want), n
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_bf16_bucketed_generate_equals_eager():
    kw = dict(rule="snapkv", budget=12, block=8)
    ref = fxbudget.compile(fresh(_model(torch.bfloat16)), backend=None, **kw)
    m = fxbudget.compile(fresh(_model(torch.bfloat16)), backend="aot_eager", **kw)
    for n in (3, 17, 40):
        ids = _ids(n, n)
        with torch.no_grad():
            got = m.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
            want = ref.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
        assert (torch.stack(got.logits).float() - torch.stack(want.logits).float()).abs().max().item() <= 2e-2, n
