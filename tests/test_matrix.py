"""The combination matrix (issue 29), generated from the rule registry: a rule joins it by being registered.

Factors: every rule in each of its forms (plain, each wrapper prefix: `adakv:`, `noprotect:`, `protectonly:` where
it takes the rule, and `Pyramid`) x layout (per-head slots, head pool) x
protocol (query-agnostic, query-aware, streaming; kvzip's replay for replay-only rules) x backend (the eager kernel,
aot_eager) x architecture feature (GQA, MQA, MHA, partial rotary, NoPE layers, a model-wide and a per-layer sliding
window, a left-padded batch). Every (form, layout, protocol) cell is run; the backend and architecture rotate over
them so that every pair of values of any two factors meets in at least one cell (`test_the_design_covers_all_pairs`
checks it). Each cell holds all of:

- a budget covering the sequence reproduces the unmodified model (every step's logits);
- eviction keeps exactly the budget per KV head (a head-adaptive rule: the layer's total) on every budgeted layer;
- a uniform rule on the head pool keeps the unpooled layout's sets (the same run on both layouts);
- a cache snapshot restored after further evicting calls is bit-identical (`BudgetCache.snapshot/restore`);

or it is refused before any model work, with a message naming the rule and the feature (`REFUSED` lists which).
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PhiConfig,
                          PhiForCausalLM, Qwen2Config, Qwen2ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

import fxbudget
from fxbudget.cache import LAYER_STATE
from fxbudget.harness.kvzip_protocol import compress
from fxbudget.rules import available, get, wrapper_prefixes
from fxbudget.rules.pyramidkv import Pyramid

from conftest import COMMON

CTX, QUESTION, STEPS = 20, 4, 3  # tokens: context, question, greedy steps
SMALL = 12  # the evicting budget; pyramid forms and windowed rules get window 4 (< SMALL)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHS = ("gqa", "mqa", "mha", "partial-rotary", "nope", "sliding-model", "sliding-layers", "left-padded")
PROTOCOLS = ("query-agnostic", "query-aware", "streaming")
BACKENDS = ("eager", "aot_eager")
LAYOUTS = ("slots", "head-pool")
# Pairs no call can express: kvzip's `compress` takes rows of one length and no attention mask (its docstring), so
# a left-padded batch cannot be handed to the replay protocol at all.
NOT_EXPRESSIBLE = {("replay", "left-padded")}


def _model(arch: str):
    torch.manual_seed(0)
    kw = dict(num_hidden_layers=2, **COMMON)
    if arch in ("gqa", "left-padded"):
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    if arch in ("mqa", "mha"):
        kw["num_key_value_heads"] = 1 if arch == "mqa" else 4
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    if arch == "partial-rotary":
        return PhiForCausalLM(PhiConfig(**TOKENS, **kw)).eval()
    if arch == "nope":
        kw["num_hidden_layers"] = 4  # no_rope_layers [1, 1, 1, 0]
        return SmolLM3ForCausalLM(SmolLM3Config(**TOKENS, **kw)).eval()
    if arch == "sliding-model":  # a model-wide window (Qwen2's use_sliding_window): layer 1 slides, layer 0 is full
        return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                            **kw)).eval()
    if arch == "sliding-layers":
        kw["num_hidden_layers"] = 3
        return Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                                  layer_types=["sliding_attention", "sliding_attention",
                                                               "full_attention"], **kw)).eval()
    raise ValueError(arch)


_MODELS: dict = {}


def model_for(arch: str):
    if arch not in _MODELS:
        _MODELS[arch] = _model(arch)
    return _MODELS[arch]


def forms() -> list[str]:
    """Every rule name of the registry in each form: plain, each wrapper prefix (`adakv:`), and `pyramid(...)`
    (the `Pyramid` wrapper, built in `_rule`). Rules that never evict have no wrapped forms."""
    out = []
    for name in available():
        out.append(name)
        if get(name).never_evicts:
            continue
        out += [prefix + name for prefix in wrapper_prefixes() if _wraps(prefix, name)] + [f"pyramid({name})"]
    return out


def _wraps(prefix: str, name: str) -> bool:
    """Whether the wrapper takes the rule (`noprotect:`/`protectonly:` refuse a rule that protects nothing)."""
    try:
        get(prefix + name)
    except ValueError:
        return False
    return True


def _rule(form: str, budget: int):
    """The rule of a form, its observation window shrunk to fit `SMALL` (the same rule otherwise)."""
    if form.startswith("pyramid("):
        return Pyramid(_rule(form[len("pyramid("):-1], budget), beta=2)  # beta 2: every layer > 0 at SMALL
    params = {}
    base = form.split(":")[-1]
    if "window" in (fxbudget.rules.rule_fields(base) or []):
        params["window"] = 4
    if base == "weighted":
        params["n_recent"] = 4
    if base == "kvzip":
        params["chunk_size"] = 64
    return get(form, **params)


def _layouts_protocols(rule) -> list[tuple[str, str]]:
    layouts = ("head-pool",) if rule.head_adaptive else LAYOUTS
    protocols = ("replay",) if rule.replay_only else PROTOCOLS
    return list(itertools.product(layouts, protocols))


def design() -> list[tuple[str, str, str, str, str]]:
    """`(form, layout, protocol, backend, arch)` cells: every form x layout x protocol it can take (replay-only
    rules: their replay; head-adaptive forms: the pool only) on the eager kernel, the architecture in rotation; then,
    while a pair of values of two of the other factors meets in no cell, one more cell for it, its other factors
    chosen to meet as many missing pairs as possible (a greedy all-pairs design). aot_eager cells come from that
    completion only: each compiles several graphs (a minute on two loaded cores), so they are kept few."""
    cells = []
    counter = itertools.count()
    for form in forms():
        for layout, protocol in _layouts_protocols(_rule(form, SMALL)):
            arch = ARCHS[next(counter) % len(ARCHS)]
            if (protocol, arch) in NOT_EXPRESSIBLE:
                arch = ARCHS[next(counter) % len(ARCHS)]
            cells.append((form, layout, protocol, BACKENDS[0], arch))
    values = {1: LAYOUTS, 2: PROTOCOLS + ("replay",), 3: BACKENDS, 4: ARCHS}
    pairs = list(itertools.combinations(values, 2))

    def missing(cells):
        return {(i, j, x, y) for i, j in pairs for x, y in itertools.product(values[i], values[j])
                if (x, y) not in NOT_EXPRESSIBLE} - {(i, j, c[i], c[j]) for c in cells for i, j in pairs}

    todo = missing(cells)
    used: dict[str, int] = {}  # forms picked by the completion so far: ties go to the least used, for variety
    while todo:
        best = None
        for form in forms():
            for layout, protocol in _layouts_protocols(_rule(form, SMALL)):
                for backend, arch in itertools.product(BACKENDS, ARCHS):
                    cell = (form, layout, protocol, backend, arch)
                    if (protocol, arch) in NOT_EXPRESSIBLE:
                        continue
                    gain = (sum((i, j, cell[i], cell[j]) in todo for i, j in pairs), -used.get(form, 0))
                    if best is None or gain > best[0]:
                        best = (gain, cell)
        cells.append(best[1])
        used[best[1][0]] = used.get(best[1][0], 0) + 1
        todo = missing(cells)
    return cells


CELLS = design()

# Combinations refused by design, each before any model work with a message naming the rule and the feature:
# (predicate over (rule, arch, protocol), the message's pattern).
REFUSED = [
    (lambda rule, arch, protocol: isinstance(rule, Pyramid) and (rule.window or 0) >= SMALL,
     "pyramid budgets need budget > window"),
    (lambda rule, arch, protocol: rule.replay_only and arch in ("sliding-model", "sliding-layers"),
     "sliding-window layers are not supported"),
    (lambda rule, arch, protocol: rule.needs_wo and arch == "partial-rotary", "W_o"),
]


def _refusal(rule, arch, protocol):
    return next((pattern for pred, pattern in REFUSED if pred(rule, arch, protocol)), None)


def test_the_design_covers_all_pairs():
    """Every form in every layout and protocol it can take; every pair of the other factors' values in a cell."""
    for form in forms():
        want = set(_layouts_protocols(_rule(form, SMALL)))
        assert {(c[1], c[2]) for c in CELLS if c[0] == form} == want, form
    values = {1: LAYOUTS, 2: PROTOCOLS + ("replay",), 3: BACKENDS, 4: ARCHS}
    for i, j in itertools.combinations(values, 2):
        missing = set(itertools.product(values[i], values[j])) - NOT_EXPRESSIBLE - {(c[i], c[j]) for c in CELLS}
        assert not missing, (i, j, sorted(missing))
    assert not any((c[2], c[4]) in NOT_EXPRESSIBLE for c in CELLS)


def _inputs(arch: str, n: int):
    g = torch.Generator().manual_seed(n)
    batch = 2 if arch == "left-padded" else 1
    ids = torch.randint(3, 96, (batch, n), generator=g)
    mask = torch.ones_like(ids)
    if arch == "left-padded":
        mask[0, :3] = 0  # row 0: three pads on the left
    return ids, mask


def _drive(model, protocol: str, arch: str, rule=None, *, compiled: bool = False):
    """Run a protocol: context (and question, query-aware), then the question (unless prefilled) and `STEPS` greedy
    steps, eviction frozen except under streaming. Returns every step's logits `[steps, b, vocab]` and the cache.

    `compiled`: the model is fxbudget-compiled (a cache with head-room for the frozen calls is made). With `rule`
    (the rule it is compiled with), right after the evicting prefill each budgeted layer must
    hold exactly its budget per head (`_counts_ok`), and a snapshot of the cache, restored after two more evicting
    calls, must be bit-identical (`_check_restore`)."""
    ids, mask = _inputs(arch, CTX + QUESTION)
    ctx, question = ids[:, :CTX], ids[:, CTX:]
    kw = {}
    if compiled or rule is not None:
        # The prompt's length, as compare passes it: a pyramid schedule then adapts to it (a short prompt gets the
        # uniform budget, so a covering budget covers every layer).
        kw["past_key_values"] = model.forward.new_cache(ids.shape[0], headroom=QUESTION + STEPS + 1,
                                                        prompt=CTX + QUESTION)
    logits = []
    with torch.no_grad():
        if protocol == "replay":
            done = compress(model, ctx, ctx, cache=kw["past_key_values"])
            cache, last, am, steps = done.cache, done.logits, mask[:, :CTX], [question]
        else:
            first = ids if protocol == "query-aware" else ctx
            am = mask[:, :first.shape[1]]
            out = model(input_ids=first, attention_mask=am, use_cache=True, **kw)
            cache, last = out.past_key_values, out.logits[:, -1]
            steps = [] if protocol == "query-aware" else [question]
        if rule is not None:
            _counts_ok(cache, rule, arch)
            _check_restore(model, cache, am, frozen=protocol == "replay")
        logits.append(last)
        frozen = (compiled or rule is not None) and protocol != "streaming"
        with cache.frozen() if frozen else contextlib.nullcontext():
            for x in steps:
                am = torch.cat([am, torch.ones_like(x)], dim=1)
                logits.append(model(input_ids=x, attention_mask=am, past_key_values=cache,
                                    use_cache=True).logits[:, -1])
            for _ in range(STEPS):
                tok = logits[-1].argmax(-1, keepdim=True)
                am = torch.cat([am, torch.ones_like(tok)], dim=1)
                logits.append(model(input_ids=tok, attention_mask=am, past_key_values=cache,
                                    use_cache=True).logits[:, -1])
        if rule is not None and protocol == "streaming":
            _counts_ok(cache, rule, arch)
    return torch.stack(logits), cache


def _check_restore(model, cache, mask, frozen: bool):
    """Snapshot, two more calls (evicting, unless `frozen`: a replay rule evicts only in its replay), restore: every
    state tensor of every layer bit-identical (NaN where NaN: `wov_norm` of a model whose W_o is unknown)."""
    snap = cache.snapshot()
    want = [{n: getattr(layer, n).clone() for n in LAYER_STATE} for layer in cache.layers]
    extra = torch.randint(3, 96, (mask.shape[0], 2))
    with cache.frozen() if frozen else contextlib.nullcontext():
        model(input_ids=extra, attention_mask=torch.cat([mask, torch.ones_like(extra)], dim=1),
              past_key_values=cache, use_cache=True)
    cache.restore(snap)
    for layer, w in zip(cache.layers, want):
        for n in LAYER_STATE:
            assert torch.equal(getattr(layer, n), w[n]) or torch.allclose(getattr(layer, n), w[n], rtol=0, atol=0,
                                                                          equal_nan=True), \
                f"layer {layer.layer} {n} not restored"


def _kept(cache):
    return [[[sorted(p for p in head if p >= 0) for head in row] for row in cache.head_positions(i).tolist()]
            for i in range(len(cache.layers)) if not cache.layers[i].sliding]


def _counts_ok(cache, rule, arch):
    pads = [3, 0] if arch == "left-padded" else [0]
    for layer in cache._budgeted():
        counts = layer.head_counts()  # [b, h]
        for row, pad in enumerate(pads):
            held = min(layer.budget, cache.tokens_seen - pad)
            if rule.head_adaptive:
                assert int(counts[row].sum()) == held * counts.shape[1], (layer.layer, counts.tolist())
            else:
                assert counts[row].tolist() == [held] * counts.shape[1], (layer.layer, counts.tolist())


@pytest.mark.parametrize("form, layout, protocol, backend, arch", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell(form, layout, protocol, backend, arch):
    model = model_for(arch)
    total = CTX + QUESTION + STEPS + 3
    small, covering = _rule(form, SMALL), _rule(form, total)
    pool = {"head_pool": True} if layout == "head-pool" else {}
    be = None if backend == "eager" else backend
    refusal = _refusal(small, arch, protocol)
    if refusal:
        with pytest.raises((ValueError, NotImplementedError), match=refusal) as err:
            m = fxbudget.compile(model, rule=small, budget=SMALL, backend=be, **pool)
            try:
                _drive(m, protocol, arch, small)
            finally:
                m.forward.restore()
        assert small.name in str(err.value)
        return
    ref, _ = _drive(model, "query-aware" if protocol == "query-aware" else "query-agnostic", arch)
    m = fxbudget.compile(model, rule=covering, budget=total, backend=be, **pool)
    try:
        got, _ = _drive(m, protocol, arch, compiled=True)
    finally:
        m.forward.restore()
    assert (got - ref).abs().max().item() <= 1e-4, "a covering budget must reproduce the model"
    if small.never_evicts:
        m = fxbudget.compile(model, rule=small, budget=SMALL, backend=be, **pool)
        try:
            with pytest.raises(ValueError, match=f"rule {small.name!r} keeps everything"):
                _drive(m, protocol, arch, small)
        finally:
            m.forward.restore()
        return
    m = fxbudget.compile(model, rule=small, budget=SMALL, backend=be, **pool)
    try:
        _, cache = _drive(m, protocol, arch, small)
    finally:
        m.forward.restore()
    if layout == "head-pool" and not small.head_adaptive and backend == "eager":
        m = fxbudget.compile(model, rule=small, budget=SMALL, backend=be)
        try:
            _, unpooled = _drive(m, protocol, arch, small)
        finally:
            m.forward.restore()
        assert _kept(cache) == _kept(unpooled), "a uniform rule keeps the unpooled layout's sets on the pool"
