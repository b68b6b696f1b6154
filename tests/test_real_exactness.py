"""A covering budget on the embedded models' real weights, against their float64 model: the kernel adds no error to
any layer's attention (each layer fed the float64 model's input: its error against float64 is the unmodified model's
within 10% in float32, 25% in bfloat16), and in float32 the end-to-end logits on random tokens are as close to float64
as the unmodified model's (<= 1.25x). Prompts of 640 tokens, past Gemma 3's sliding window of 512. The study behind
it, with the repetitive passkey prompt whose end-to-end ratio moves with any reordering of the sums (issue 41's
2.4x): benchmarks/embedded_exactness.py, docs/embedded-models.md.

Eager kernel (backend=None), as tests/test_real_model.py.
"""

import copy
import importlib
import sys
from pathlib import Path

import pytest
import torch

import fxbudget
from fxbudget.models.embedded import EMBEDDED
from fxbudget.models import default_model_available, load_embedded

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
study = importlib.import_module("embedded_exactness")

pytestmark = pytest.mark.model
TOKENS, KEEP = 640, 16


@pytest.fixture(scope="module", params=sorted(EMBEDDED))
def case(request):
    entry = EMBEDDED[request.param]
    if not default_model_available(entry):
        pytest.skip(f"{entry.name} weights not installed: {entry.install_hint}")
    model, _ = load_embedded(entry, progress=False, with_tokenizer=False)
    ids = torch.randint(10, min(model.config.vocab_size, 150_000), (1, TOKENS),
                        generator=torch.Generator().manual_seed(0))
    f64 = copy.deepcopy(model).double()
    ref_in, ref_out, ref = study.attention_inputs(f64, ids, KEEP)
    del f64
    return model, ids, ref, ref_in, ref_out


def _covering(model):
    return fxbudget.compile(model, rule="snapkv", budget=TOKENS + 16, backend=None)


def test_float32_covering_budget_adds_no_error(case):
    model, ids, ref, ref_in, ref_out = case
    plain_local = study.local_errors(model, ids, ref_in, ref_out, torch.float32)
    plain = study.rms(study.logits(model, ids, KEEP) - ref)
    _covering(model)
    try:
        fx_local = study.local_errors(model, ids, ref_in, ref_out, torch.float32)
        fx = study.rms(study.logits(model, ids, KEEP) - ref)
    finally:
        model.forward.restore()
    ratios = [f / p for f, p in zip(fx_local, plain_local)]
    assert max(ratios) <= 1.1, ratios
    assert fx <= 1.25 * plain, (fx, plain)


def test_bfloat16_covering_budget_adds_no_error(case):
    """bf16 end to end: each layer's attention, fed the float64 model's input in bf16, is as close to float64 as the
    unmodified bf16 model's (<= 1.25x; measured 0.99-1.00 on every layer of both models). The end-to-end logits'
    ratio is not asserted on one prompt: it moves either way with any reordering of the sums (Gemma 3 at 640 random
    tokens: 1.43; at 1476: 0.92; docs/embedded-models.md)."""
    model, ids, _, ref_in, ref_out = case
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    plain = study.local_errors(bf16, ids, ref_in, ref_out, torch.bfloat16)
    _covering(bf16)
    fx = study.local_errors(bf16, ids, ref_in, ref_out, torch.bfloat16)
    ratios = [f / p for f, p in zip(fx, plain)]
    assert max(ratios) <= 1.25, ratios
