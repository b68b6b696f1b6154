"""The SDPA call's arguments mean the same on the eager path and through the graph pass (`fxbudget/passes/sdpa_args.py`):
dropout and any attn_mask are refused, `scale` is honoured (torch takes it by keyword only)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

import fxbudget
from tiny_attention import CONFIG, OneLayer

PATHS = [None, "eager"]  # the eager kernel; Dynamo + the SDPA pass
IDS = torch.arange(6).view(1, 6) % 16


def _mask(dtype):
    def sdpa(q, k, v):
        shape = (q.shape[2], k.shape[2])
        mask = torch.ones(shape, dtype=torch.bool) if dtype == torch.bool else torch.zeros(shape, dtype=dtype)
        return F.scaled_dot_product_attention(q, k, v, mask)
    return sdpa


REFUSED = {
    "dropout": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), "dropout"),
    "float_mask": (_mask(torch.float32), r"attn_mask \(torch.float32\).*additive bias"),
    "bool_mask": (_mask(torch.bool), r"attn_mask \(torch.bool\)"),
}
# torch's SDPA takes `scale` (and `enable_gqa`) by keyword only: a positional scale is a TypeError in torch itself.
SCALED = {
    "keyword": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
    "positional_is_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.3),
}


def _run(sdpa, backend):
    m = fxbudget.compile(OneLayer(sdpa=sdpa), rule="knorm", budget=16, backend=backend)
    with torch.no_grad():
        return m(input_ids=IDS, past_key_values=fxbudget.BudgetCache(CONFIG, 16)).logits


@pytest.mark.parametrize("backend", PATHS)
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_on_both_paths(case, backend):
    sdpa, match = REFUSED[case]
    with pytest.raises(Exception, match=match):
        _run(sdpa, backend)


@pytest.mark.parametrize("backend", PATHS)
@pytest.mark.parametrize("case", sorted(SCALED))
def test_scale_honoured_on_both_paths(case, backend):
    sdpa = SCALED[case]
    with torch.no_grad():  # the unmodified module with a plain cache: SDPA over every key, at scale 0.3
        expected = OneLayer(sdpa=sdpa)(IDS, past_key_values=DynamicCache()).logits
        default = OneLayer(sdpa=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))(
            IDS, past_key_values=DynamicCache()).logits
    assert not torch.allclose(expected, default, atol=1e-4)  # the scale matters here
    torch.testing.assert_close(_run(sdpa, backend), expected, rtol=1e-5, atol=1e-5)


def test_torch_takes_scale_by_keyword_only():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(TypeError, match="positional"):
        F.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.3)


def test_packed_gqa_decode_without_touching_the_environment(monkeypatch):
    # Where transformers does not pass enable_gqa (head_dim > 256 on CUDA), its eager decode packs the query's GQA
    # group into the sequence dim (`pack_gqa`). The eager path unpacks it; it used to set TRANSFORMERS_SDPA_FORCE_GQA
    # in os.environ around every forward instead (process-wide, not thread-safe).
    import os

    import transformers.integrations.sdpa_attention as hf_sdpa

    from conftest import fresh, greedy, tiny_model

    env = []

    def no_gqa(attention_mask, key, value):
        env.append(os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA"))
        return False

    monkeypatch.setattr(hf_sdpa, "use_gqa_in_sdpa", no_gqa)
    model = tiny_model("qwen2")  # 4 query heads per 2 KV heads
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        expected, _ = greedy(fresh(model), ids, 4)
        got, _ = greedy(fxbudget.compile(fresh(model), rule="knorm", budget=32, backend=None), ids, 4)
    assert env and set(env) == {None}
    assert (got - expected).abs().max().item() <= 1e-4
