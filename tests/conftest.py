"""Tiny random-weight models of several architectures, and greedy decoding helpers."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from hypothesis import settings
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, \
    MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fxbudget.cache.keyword import cache_kwargs, output_cache

torch.set_num_threads(1)  # on 2 cores, OpenMP spinning makes everything slower

# Property tests draw the same examples on every run and machine (CI included): a fixed derivation per test, no
# example database carried between runs.
settings.register_profile("fxbudget", derandomize=True, database=None, deadline=None)
settings.load_profile("fxbudget")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, attn_implementation="sdpa")


def tiny_model(arch: str = "llama", layers: int = 2, seed: int = 0):
    """A random-weight causal LM in eval mode: llama, mistral, qwen2, qwen3, phi3 (GQA 2:1; phi3 fused QKV) or gemma3
    (sliding + full layers)."""
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **COMMON))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **COMMON))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=layers, **COMMON))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, head_dim=16, **COMMON))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(num_hidden_layers=layers, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                           **COMMON))
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(num_hidden_layers=max(layers, 3), head_dim=16, sliding_window=8,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"][:max(layers, 3)],
                               query_pre_attn_scalar=16, **COMMON)
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


def greedy(model, ids: torch.Tensor, steps: int, cache=None):
    """Prefill `ids` then `steps` greedy decode steps; returns (logits of every step `[steps + 1, batch, vocab]`, cache)."""
    # The cache keyword the model declares (`cache` from transformers 5.24, `past_key_values` before).
    out = model(input_ids=ids, use_cache=True, **cache_kwargs(model.forward, cache))
    cache = output_cache(out)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=tok, use_cache=True, **cache_kwargs(model.forward, cache))
        logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


def generated(model, ids: torch.Tensor, n: int = 8) -> torch.Tensor:
    """The `n` tokens `model.generate` decodes greedily after `ids` (the real-model tests' oracle)."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, temperature=None, top_p=None, top_k=None)
    return out[0, ids.shape[1]:]


def assert_covering_budget_exact(model, tok, ids: torch.Tensor, answer: str) -> None:
    """A budget that covers the prompt and its generation changes no greedy token of the unmodified model, whose
    output holds `answer`."""
    import fxbudget

    ref = generated(model, ids)
    fxbudget.compile(model, rule="snapkv", budget=ids.shape[1] + 16, backend=None)
    try:
        got = generated(model, ids)
    finally:
        model.forward.restore()
    assert torch.equal(got, ref), (tok.decode(got), tok.decode(ref))
    assert answer in tok.decode(ref), tok.decode(ref)


def chunked_prefill_then_decode(m, steps: int = 3, tokens: int = 70):
    """The budget's bread and butter on a compiled tiny model: a chunked prefill of `tokens` seeded random ids, then
    `steps` greedy decode steps; returns the last logits, each (layer, row) list of held positions and the cache."""
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = m.forward.new_cache(1)
    with torch.no_grad():
        out = m(input_ids=ids, past_key_values=cache)
        for _ in range(steps):
            out = m(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)
    held = [(i, [p for p in row if p >= 0]) for i in range(len(cache.layers))
            for row in cache.positions(i)[0].tolist()]
    return out.logits, held, cache


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def matmul_nodes(gm) -> int:
    """Matmul nodes (`aten.bmm`, `aten.mm`) of a graph, its subgraphs (scan bodies) included."""
    ops = (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)
    return sum(n.target in ops for n in gm.graph.nodes) + sum(
        matmul_nodes(m) for m in gm.children() if isinstance(m, torch.fx.GraphModule))


def fresh(model):
    return copy.deepcopy(model)


@contextlib.contextmanager
def registry_restored():
    """The rule registry (and the rule files `load_file` registered) as it was on entry, again on exit."""
    from fxbudget.rules import _LOADED, _REGISTRY

    before, loaded = dict(_REGISTRY), dict(_LOADED)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(before)
        _LOADED.clear()
        _LOADED.update(loaded)


@pytest.fixture(autouse=True)
def _own_rates_file(tmp_path_factory, monkeypatch):
    """Each test's `compare` runs record their rates in a file of their own (`fxbudget.cli.rates`), so an estimate
    line never depends on the runs of other tests or of the user's machine."""
    monkeypatch.setenv("FXBUDGET_RATES", str(tmp_path_factory.mktemp("rates") / "rates.jsonl"))


@pytest.fixture(autouse=True)
def _registry_restored():
    """Rules a test registers stay in that test: the registry is process-wide, and with pytest-xdist a later test in
    the same worker (e.g. cross_device's "every registered rule") would otherwise see them."""
    with registry_restored():
        yield


# Kernel fingerprints traced in this process, by everything a fingerprint depends on (see `memoized_fingerprints`).
_FINGERPRINTS: dict = {}


@contextlib.contextmanager
def memoized_fingerprints(module):
    """`module.kernel_fingerprint` (the harness's runner, lm-eval's model) traced once per process and
    configuration, not once per run, for the duration.

    A fingerprint is a pure function of the code, the model's architecture (its config; not its weights), dtype and
    device, the rule (class and hyperparameters), the budget, the cache layout and the traced input: every run of a
    test file on the same tiny model retraces the same ones (seconds each, most of a tiny `compare` run's time). The
    first call for a key traces for real, through the module; later calls return that value. For modules whose
    tests do not change the kernel (they would get the unchanged kernel's value); `fxbudget.kernel_fingerprint`
    itself is not replaced.
    """
    real = module.kernel_fingerprint

    def fingerprint(model, input_ids=None, *, rule, budget, **kwargs):
        config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
        param = next(model.parameters())
        key = (type(model), repr(sorted(config.items())), param.dtype, param.device, type(rule),
               getattr(rule, "name", rule), repr(rule.params()) if hasattr(rule, "params") else None, budget,
               repr(sorted(kwargs.items())), None if input_ids is None else repr(input_ids.tolist()))
        if key not in _FINGERPRINTS:
            _FINGERPRINTS[key] = real(model, input_ids, rule=rule, budget=budget, **kwargs)
        return _FINGERPRINTS[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "kernel_fingerprint", fingerprint)
        yield


@pytest.fixture(scope="module")
def shared_fingerprints():
    """The runner's kernel fingerprints memoized for a module's tests (`memoized_fingerprints`)."""
    from fxbudget.harness import runner

    with memoized_fingerprints(runner):
        yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Qwen2 with the embedded model's tokenizer, saved as a local model directory (prompts are
    tokenized as on the real model); built once per process (tests only read it)."""
    from transformers import AutoTokenizer

    from fxbudget.models import default_cache_dir, load_default

    path = default_cache_dir()
    if not (path / "tokenizer_config.json").is_file():
        load_default(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=8192, tie_word_embeddings=True))
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test (the tokenizer may load: it is not the model)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def fails_in_one_line(capsys, argv, match):
    """`fxbudget.cli.main(argv)` exits 2 with one line on stderr matching `match`; returns the line."""
    import re

    from fxbudget.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(match, err), err
    return err


@pytest.fixture(scope="session")
def tok():
    """The embedded model's tokenizer (installed on first use), loaded once per process (tests only read it)."""
    from transformers import AutoTokenizer

    from fxbudget.models import default_cache_dir, default_model_available, load_default
    path = default_cache_dir()
    if not (path / "tokenizer.json").is_file():
        if not default_model_available():
            pytest.skip("the embedded model is not installed")
        load_default(progress=False)
    return AutoTokenizer.from_pretrained(path)
