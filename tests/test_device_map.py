"""A model spread over devices (`device_map="auto"`): each layer's cache slots live on that layer's device.

This machine has one device (CPU), so the placement is checked with a layer moved to the `meta` device (allocation
only, nothing runs on it) or declared by accelerate's dispatch hooks; a dispatched model runs through the same hooks
a multi-GPU one does, all on CPU. A real run over two GPUs is not done here.
"""

import pytest
import torch

import fxbudget
from conftest import fresh, greedy, tiny_model
from fxbudget.api import layer_devices, model_cache
from fxbudget.cache import BudgetCache
from fxbudget.rules import get

CPU, META = torch.device("cpu"), torch.device("meta")
LAYER_TENSORS = ("keys", "values", "pos", "state", "norms", "totals", "seen", "inv_freq", "wo")


def _dispatched(model):
    """`model` dispatched by accelerate as `device_map=...` does (a hook per module), every part on CPU."""
    names = ["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"]
    names += [f"model.layers.{i}" for i in range(len(model.model.layers))]
    from accelerate import dispatch_model  # the [models] extra: imported here so `make test-newest` collects this file

    return dispatch_model(model, device_map={n: "cpu" for n in names}, main_device="cpu", force_hooks=True)


def test_each_layer_slots_on_its_layers_device():
    model = tiny_model("qwen2", layers=3)
    model.model.layers[1].to("meta")  # layer 1 on another device
    assert layer_devices(model) == [CPU, META, CPU]
    cache = model_cache(model, get("snapkv"), 16, headroom=8)
    assert cache.devices == [CPU, META, CPU] and cache.device == CPU and cache.next_pos.device == CPU
    for layer, device in zip(cache.layers, [CPU, META, CPU]):
        assert {name: getattr(layer, name).device for name in LAYER_TENSORS} == dict.fromkeys(LAYER_TENSORS, device)
    assert cache.kv_bytes() == 3 * 2 * (1 * 2 * 24 * 16 * 4)  # layers x (K, V) x (batch, heads, slots, dim, fp32)


def test_a_one_device_cache_is_refused_for_a_spread_model():
    model = tiny_model("qwen2", layers=3)
    model.model.layers[1].to("meta")
    fxbudget.compile(model, rule="snapkv", budget=16, backend=None)
    try:
        with pytest.raises(ValueError, match="cache is torch.float32 on cpu, model is torch.float32 on layers' "
                                             "devices cpu, meta, cpu"):
            model.forward._resolve_cache(BudgetCache(model.config, 16), 1, 4)
        spread = model.forward.new_cache()
        assert model.forward._resolve_cache(spread, 1, 4) is spread  # accepted, nothing runs on meta
        assert BudgetCache(model.config, 16, device=[CPU, META, CPU]).devices == spread.devices
        with pytest.raises(ValueError, match=r"one per layer \(3\)"):
            BudgetCache(model.config, 16, device=[CPU, META])
    finally:
        model.forward.restore()


def test_offloaded_layer_cached_where_it_executes():
    """accelerate runs an offloaded layer on its hook's execution device: the cache goes there, not to the weights."""
    model = _dispatched(tiny_model("qwen2", layers=3))
    assert layer_devices(model) == [CPU, CPU, CPU]
    model.model.layers[2]._hf_hook.execution_device = META  # weights on CPU, executed elsewhere
    assert layer_devices(model) == [CPU, CPU, META]
    assert model_cache(model, get("knorm"), 16).layers[2].keys.device == META


@pytest.mark.parametrize("budget", [8, 64])
def test_dispatched_model_runs_like_the_plain_one(budget):
    """Through accelerate's dispatch hooks (what device_map loading installs), eviction (budget 8) and a covering
    budget (64) give the logits of the same model without hooks."""
    plain = tiny_model("qwen2", layers=2)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 24))
    with torch.no_grad():
        want, _ = greedy(fxbudget.compile(fresh(plain), rule="snapkv", budget=budget, backend=None, window=4), ids, 6)
        hooked = fxbudget.compile(_dispatched(fresh(plain)), rule="snapkv", budget=budget, backend=None, window=4)
        got, cache = greedy(hooked, ids, 6)
    assert isinstance(cache, BudgetCache) and cache.devices == [CPU, CPU]
    assert torch.equal(got, want)
