"""The architecture matrix (issue 20, item 2): every causal LM of the installed transformers, as a tiny random model
with windows shorter than the prompt. A covering budget reproduces the unmodified model over prefill + 20 greedy
steps, eagerly and under aot_eager, or fxbudget refuses it by name before any model work; a model whose tiny config
cannot be built is listed (docs/architectures.md), never dropped. The RoPE frequencies the rules read are the
model's own (partial rotary included) or marked unknown, never wrong."""

import pytest
import torch

import fxbudget
from architecture_matrix import NAMED, REFUSALS, TOL, backends_for, build, causal_lm_types, run_one
from fxbudget.models.layer_config import UnsupportedArchitectureError, rope_inv_freq

MATRIX = sorted(causal_lm_types().items())

# The feature each refused one of them is refused for.
REFUSED_FOR = {"gemma2": "attention logit soft-capping"}


def test_matrix_covers_the_named_architectures():
    missing = set(NAMED) - {t for t, _ in MATRIX}
    assert not missing, f"not causal LMs of this transformers: {sorted(missing)}"


@pytest.mark.newest
@pytest.mark.parametrize("model_type, cls", MATRIX, ids=[t for t, _ in MATRIX])
def test_architecture(model_type, cls):
    """Eagerly for every architecture; also under aot_eager for the named ones, which span every window kind
    (model-wide, per layer type, Qwen2's use_sliding_window) and rotary kind (default, partial, interleaved, none).
    An aot_eager compile costs ~10 s here, so the whole matrix under both backends is left to
    `python tests/architecture_matrix.py --compiled all`."""
    backends = backends_for(model_type)
    r = run_one(model_type, cls, backends=backends)
    if model_type in NAMED:
        assert r.status == NAMED[model_type], (r.status, r.detail, r.diffs)
    assert r.status != "failed", f"neither exact nor refused: {r.detail} {r.diffs}"
    if r.status == "supported":
        assert set(r.diffs) == {b or "eager" for b in backends} and max(r.diffs.values()) <= TOL
        assert r.rope_check in ("the model's", "unknown"), r.rope_check  # the RoPE signal is never wrong
    if r.status == "refused":
        assert r.detail.startswith(REFUSALS) and not r.diffs
        if model_type in REFUSED_FOR:
            assert REFUSED_FOR[model_type] in r.detail


def _pre_and_post_rope_queries(model, ids):
    """The queries of layer 0 before RoPE (q_proj's output) and as SDPA gets them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}
    attn = model.model.layers[0].self_attn

    def record(module, query, *args, **kwargs):
        if module is attn:
            seen["post"] = query
        return sdpa_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register("record_sdpa", record)
    hook = attn.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("pre", o))
    model.set_attn_implementation("record_sdpa")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        hook.remove()
        model.set_attn_implementation("sdpa")
    b, n, _ = seen["pre"].shape
    return seen["pre"].view(b, n, -1, attn.head_dim).transpose(1, 2), seen["post"]


@pytest.mark.newest
@pytest.mark.parametrize("model_type", ["llama", "stablelm"])
def test_expected_attention_unrotates_as_the_model_rotates(model_type):
    """Partial rotary (StableLM: the first quarter of each head's dims, factor in rope_parameters): un-rotating the
    model's own post-RoPE queries with the cache's frequencies gives back its pre-RoPE queries."""
    from fxbudget.rules.expected_attention import unrotate

    model = build(model_type, dict(MATRIX)[model_type])
    inv_freq = fxbudget.BudgetCache(model.config, 8).layers[0].inv_freq
    head_dim = model.model.layers[0].self_attn.head_dim
    if model_type == "stablelm":
        assert 2 * inv_freq.shape[-1] == int(head_dim * model.config.rope_parameters["partial_rotary_factor"]) \
            < head_dim
    ids = torch.randint(3, 96, (1, 11))
    pre, post = _pre_and_post_rope_queries(model, ids)
    assert not torch.allclose(pre, post)
    assert torch.allclose(unrotate(post, torch.arange(11), inv_freq), pre, atol=1e-5)


@pytest.mark.newest
def test_interleaved_rotary_is_unknown_and_expected_attention_refused():
    """GLM rotates interleaved pairs of dims: fxbudget cannot express that to rules, so the signal is unknown (NaN)
    and a rule that needs it is refused, never run with the wrong rotation."""
    model = build("glm", dict(MATRIX)["glm"])
    assert rope_inv_freq(model.config, "full_attention") is None
    assert not fxbudget.BudgetCache(model.config, 8).has_rope
    with pytest.raises(ValueError, match="needs the model's RoPE frequencies"):
        fxbudget.compile(model, rule="expected_attention", budget=8, backend=None)


@pytest.mark.parametrize("attr, value, feature", [
    ("attn_logit_softcapping", 30.0, "attention logit soft-capping"),
    ("alibi", True, "ALiBi"),
    ("attention_chunk_size", 16, "chunked attention"),
    ("layer_types", ["full_attention", "linear_attention"], "'linear_attention' layers"),
    ("kv_lora_rank", 32, "multi-head latent attention"),
    ("use_bidirectional_attention", True, "bidirectional attention"),
])
def test_refusal_names_the_feature_before_any_model_work(attr, value, feature):
    from conftest import tiny_model

    model = tiny_model("llama")
    setattr(model.config, attr, value)
    forward = model.forward
    with pytest.raises(UnsupportedArchitectureError, match=feature):
        fxbudget.compile(model, rule="snapkv", budget=8, backend=None)
    assert model.forward == forward  # nothing installed
    with pytest.raises(UnsupportedArchitectureError, match=feature):
        fxbudget.BudgetCache(model.config, 8)
