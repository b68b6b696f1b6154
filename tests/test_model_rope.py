"""RoPE frequencies from the model's own rotary embedding (issue 32, item 2): the rules that read them (`needs_rope`:
expected_attention, leverage, compactor) run on both leaderboard architectures with their real RoPE settings
(Llama-3.1's `llama3` scaling, Qwen3's default RoPE) and on Llama with YaRN and linear scaling. Oracles: the model's
`rotary_emb` buffers, and the model's own pre- and post-RoPE keys captured from a float64 forward."""

import copy

import pytest
import torch
from transformers import (AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          SmolLM3Config, SmolLM3ForCausalLM)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import fxbudget
from conftest import greedy
from fxbudget.cache.rope import model_rope, rope_refusal_for
from fxbudget.rules.base import unrotate

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192, rope_theta=500000.0)
# name -> (model class, config): the two leaderboard models' RoPE, and Llama with YaRN and linear scaling.
MODELS = {
    "llama3.1": (LlamaForCausalLM, lambda: LlamaConfig(**TINY, max_position_embeddings=131072,
                                                       rope_parameters=dict(LLAMA31))),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**TINY, max_position_embeddings=40960,
                                                    rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "llama-yarn": (LlamaForCausalLM, lambda: LlamaConfig(**TINY, max_position_embeddings=32768, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=8192, rope_theta=500000.0))),
    "llama-linear": (LlamaForCausalLM, lambda: LlamaConfig(**TINY, max_position_embeddings=32768, rope_parameters=dict(
        rope_type="linear", factor=4.0, rope_theta=500000.0))),
}
RULES = ("expected_attention", "leverage", "compactor")
PROMPT, STEPS, COVERING, OFFSET = 37, 12, 64, 500


def build(name, dtype=torch.float32):
    cls, make = MODELS[name]
    cfg = make()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg).to(dtype).eval()


def default_inv_freq(model):
    """What default RoPE would give (the config's theta, no scaling): the frequencies a config-only cache knows."""
    theta, d = model.config.rope_parameters["rope_theta"], model.config.head_dim
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


@pytest.mark.parametrize("name", MODELS)
def test_cache_frequencies_are_the_models_rotary_embedding(name):
    """(a) Every layer of the cache a compiled model builds carries `rotary_emb.inv_freq` and `.attention_scaling`;
    a cache built from the config alone knows only default RoPE (Qwen3's), and leaves the others unknown."""
    model = build(name)
    rot = model.model.rotary_emb
    compiled = fxbudget.compile(copy.deepcopy(model), rule="expected_attention", budget=8, backend=None)
    cache = compiled.forward.new_cache()
    assert cache.has_rope
    for layer in cache.layers:
        assert torch.equal(layer.inv_freq, rot.inv_freq.float())
        assert layer.rope_scaling == rot.attention_scaling
    scaled = name != "qwen3"
    assert torch.allclose(rot.inv_freq, default_inv_freq(model)) != scaled  # the oracle tells the types apart
    alone = fxbudget.BudgetCache(model.config, 8)
    assert alone.has_rope != scaled
    assert (name == "llama-yarn") == (rot.attention_scaling != 1.0)  # YaRN's 0.1 ln(4) + 1; 1 for the others


def _pre_and_post_rope_keys(model, ids, positions):
    """Layer 0's keys before RoPE (k_proj's output, after Qwen3's k_norm) and as SDPA gets them."""
    seen = {}
    attn = model.model.layers[0].self_attn
    pre_module = getattr(attn, "k_norm", None) or attn.k_proj

    def record(module, query, key, *args, **kwargs):
        if module is attn:
            seen["post"] = key
        return sdpa_attention_forward(module, query, key, *args, **kwargs)

    AttentionInterface.register("record_keys", record)
    hook = pre_module.register_forward_hook(lambda m, i, o: seen.__setitem__("pre", o))
    model.set_attn_implementation("record_keys")
    try:
        with torch.no_grad():
            model(ids, position_ids=positions)
    finally:
        hook.remove()
        model.set_attn_implementation("sdpa")
    b, n = ids.shape
    return seen["pre"].reshape(b, n, -1, attn.head_dim).transpose(1, 2), seen["post"]


@pytest.mark.parametrize("name", MODELS)
def test_unrotating_the_models_keys_gives_its_prerope_keys(name):
    """(b) `Signals.prerope_keys`' un-rotation (`rules.base.unrotate`) of the model's own post-RoPE keys with the
    cache's frequencies, divided by the cache's `rope_scaling`, gives its pre-RoPE keys (float64 forward; the model
    computes its angles and cos/sin in float32, hence 1e-5 of the keys' scale); with default-RoPE frequencies it
    misses by more than a tenth of that scale, except on Qwen3. Positions start at 500, where llama3's low-frequency
    scaling moves the angles by a tenth of a radian and more."""
    model = build(name, torch.float64)
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (1, PROMPT))
    positions = torch.arange(PROMPT).unsqueeze(0) + OFFSET
    pre, post = _pre_and_post_rope_keys(model, ids, positions)
    compiled = fxbudget.compile(model, rule="leverage", budget=8, backend=None)
    layer = compiled.forward.new_cache().layers[0]
    assert post.dtype == torch.float64 and not torch.allclose(pre, post, atol=1e-2)
    scale = pre.abs().max()
    back = unrotate(post, positions[0], layer.inv_freq) / layer.rope_scaling
    assert (back - pre).abs().max() <= 1e-5 * scale, (back - pre).abs().max()
    wrong = (unrotate(post, positions[0], default_inv_freq(model)) - pre).abs().max()
    assert (wrong <= 1e-5 * scale) if name == "qwen3" else (wrong > 0.1 * scale), wrong


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("rule", RULES)
def test_rope_rules_run_and_a_covering_budget_is_exact(name, rule):
    """(c) The rules compile on the model; a covering budget reproduces the unmodified model's logits over prefill and
    greedy steps (1e-4); a tight budget evicts (each layer holds the budget) with finite logits."""
    model = build(name)
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (1, PROMPT))
    with torch.no_grad():
        ref, _ = greedy(model, ids, STEPS)
        out, cache = greedy(fxbudget.compile(copy.deepcopy(model), rule=rule, budget=COVERING, backend=None), ids,
                            STEPS)
        assert cache.has_rope
        assert (out - ref).abs().max() <= 1e-4
        tight, cache = greedy(fxbudget.compile(copy.deepcopy(model), rule=rule, budget=16, backend=None), ids, STEPS)
    assert torch.isfinite(tight).all()
    assert all(int((layer.pos >= 0).sum()) == 16 * layer.num_heads for layer in cache.layers)


def test_llama31_compiled_under_aot_eager_is_exact():
    """The leaderboard's Llama-3.1 RoPE through the compiled path as well (one rule: a compile costs ~10 s here)."""
    model = build("llama3.1")
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (1, PROMPT))
    with torch.no_grad():
        ref, _ = greedy(model, ids, STEPS)
        out, cache = greedy(fxbudget.compile(copy.deepcopy(model), rule="expected_attention", budget=COVERING,
                                             backend="aot_eager"), ids, STEPS)
    assert torch.equal(cache.layers[0].inv_freq, model.model.rotary_emb.inv_freq.float())
    assert (out - ref).abs().max() <= 1e-4


def test_dynamic_rope_is_refused_by_name():
    """Dynamic NTK RoPE changes `inv_freq` with the sequence length inside the forward: refused, never run with the
    frequencies of another length."""
    cfg = LlamaConfig(**TINY, max_position_embeddings=256, rope_parameters=dict(rope_type="dynamic", factor=4.0,
                                                                                rope_theta=10000.0))
    model = LlamaForCausalLM(cfg).eval()
    assert "'dynamic' RoPE changes its frequencies" in rope_refusal_for(model)
    for rule in RULES:
        with pytest.raises(ValueError, match="needs the model's RoPE frequencies.*'dynamic' RoPE"):
            fxbudget.compile(model, rule=rule, budget=8, backend=None)
    fxbudget.compile(model, rule="snapkv", budget=8, backend=None)  # rules that do not read RoPE still run


def test_nope_layers_keep_zero_frequencies():
    """SmolLM3's NoPE layers (no_rope_layers: 0 = no RoPE) get zeros (a rotation by angle 0), the others the model's
    frequencies."""
    cfg = SmolLM3Config(**TINY, max_position_embeddings=256, no_rope_layers=[1, 0])
    cfg._attn_implementation = "sdpa"
    model = SmolLM3ForCausalLM(cfg).eval()
    entries = model_rope(model)
    assert torch.equal(entries[0][0], model.model.rotary_emb.inv_freq.float())
    assert torch.equal(entries[1][0], torch.zeros(8))
    cache = fxbudget.compile(model, rule="leverage", budget=8, backend=None).forward.new_cache()
    assert torch.equal(cache.layers[1].inv_freq, torch.zeros(8)) and cache.has_rope


def test_a_config_only_cache_for_llama31_is_refused_until_given_the_models_rope():
    """A cache built from Llama-3.1's config alone has no frequencies (NaN): `set_rope` attaches the model's."""
    model = build("llama3.1")
    cache = fxbudget.BudgetCache(model.config, 8)
    assert not cache.has_rope and torch.isnan(cache.layers[0].inv_freq).all()
    cache.set_rope(model_rope(model))
    assert cache.has_rope and torch.equal(cache.layers[1].inv_freq, model.model.rotary_emb.inv_freq.float())
    with pytest.raises(ValueError, match="set_rope: 1 entries for 2 layers"):
        cache.set_rope(model_rope(model)[:1])


def test_per_layer_type_rotary_embedding():
    """Gemma 3 keeps one set of frequencies per layer type in one rotary embedding (`<layer_type>_inv_freq`, thetas
    1e4 for sliding and 1e6 for full layers, here with linear scaling on the full ones): each layer gets its type's."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**TINY, max_position_embeddings=256, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"],
                           rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                                            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6)})
    model = Gemma3ForCausalLM(cfg).eval()
    rot = model.model.rotary_emb
    entries = model_rope(model)
    for entry, t in zip(entries, cfg.layer_types):
        assert torch.equal(entry[0], getattr(rot, f"{t}_inv_freq").float())
    assert not torch.allclose(entries[0][0], entries[1][0])
    cache = fxbudget.compile(model, rule="expected_attention", budget=8, backend=None).forward.new_cache()
    assert cache.has_rope and torch.equal(cache.layers[1].inv_freq, rot.full_attention_inv_freq.float())
