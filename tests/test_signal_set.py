"""The signal set, a kernel setting of the run (issue 56): the union of what the run's rules read, or "all". Every
rule is exact under its own set: the same output, signals it reads, kept sets and logits as under every signal, in
the block form and the flex form (flex's eager math path on a CPU), per-head slots and the head pool, full and
sliding layers, left padding, chunked prefill and decode. A signal not measured is absent, never a zero."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fxbudget
from fxbudget.kernel import HEAD_POOL, PER_HEAD, measure_phase, rule_region, select
from fxbudget.kernel.probe import RuleProbeError, signals_read
from fxbudget.kernel.settings import MEASURED_SIGNALS, MeasureSpec, signals_label
from fxbudget.kernel.signal_set import rule_signals, run_signals
from fxbudget.kernel.state import MARKER_TENSORS, marker_tensors
from fxbudget.passes.sdpa import trace_kernel
from fxbudget.rules.base import Rule, SignalNotMeasured

from conftest import tiny_model
from test_flex_measure import CALLS, _inputs, _rules

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
F32 = torch.float32
ALL = frozenset(MEASURED_SIGNALS)
SLOT_FIELDS = ("keys", "values", "pos", "state", "norms", "totals", "owner")


@pytest.mark.parametrize("name", ["capkv", "compactor", "cur", "lagkv", "non_causal_attention", "simlayerkv"])
def test_dtype_readers_do_not_read_attn(name):
    read = signals_read(fxbudget.rules.get(name))
    assert "dtype" in read and not read & {"attn", "acc_attn"}, sorted(read)


def test_weighted_reads_only_its_nonzero_weights():
    assert rule_signals(fxbudget.rules.get("weighted")) == {"window_attn"}
    assert rule_signals(fxbudget.rules.get("weighted", w_window_attn=0.0, w_key_norm=-1.0)) == {"key_norm"}
    assert rule_signals(fxbudget.rules.get("weighted", w_attn=0.5)) == {"attn", "window_attn"}
    assert rule_signals(fxbudget.rules.get("adakv:snapkv")) == {"window_attn"}  # a wrapper: the wrapped rule's


def test_run_signals_is_the_union_or_all():
    rules = [fxbudget.rules.get(r) for r in ("snapkv", "h2o", "knorm")]
    assert run_signals(rules) == {"window_attn", "acc_attn", "key_norm"}
    assert run_signals(rules, "all") == ALL
    assert signals_label(run_signals(rules)) == "window_attn,acc_attn,key_norm"  # MEASURED_SIGNALS order
    assert signals_label(ALL) == "all" and signals_label(()) == "none"
    assert run_signals([fxbudget.rules.get("streamingllm")]) == frozenset()  # positions only: nothing measured
    with pytest.raises(RuleProbeError, match=r"^rule 'h2o' reads acc_attn, which this run's kernel does not measure "
                                              r"\(signals: window_attn\)"):
        run_signals(rules, {"window_attn"})
    with pytest.raises(ValueError, match="signals: keys not measured by the kernel"):
        run_signals(rules, {"keys"})
    with pytest.raises(ValueError, match="signals must be 'all'"):
        run_signals(rules, "every")


def test_compile_refuses_a_rule_reading_outside_the_set_before_the_run():
    model = tiny_model("llama", layers=1)
    with pytest.raises(RuleProbeError, match=r"^rule 'h2o' reads acc_attn, which this run's kernel does not measure"):
        fxbudget.compile(model, rule="h2o", budget=8, signals={"attn"})
    assert not isinstance(model.forward, fxbudget.api.BudgetForward)  # the model left unmodified
    m = fxbudget.compile(model, rule="h2o", budget=8, backend=None)
    assert m.forward.measure.signals == {"acc_attn"} and m.forward.measure.label == "acc_attn"
    model.forward.restore()


class _ReadsAttn(Rule):
    name = "reads_attn"

    def score(self, s):
        return s.attn


def test_a_signal_not_measured_is_absent_not_zero():
    args = _inputs(**CALLS["chunk"])
    for form in ("blocks", "flex"):
        _, totals, sig = _measure(form, {"window_attn"}, *args)
        assert "attn" not in sig and "acc_attn" not in sig and "window_attn" in sig
        with pytest.raises(SignalNotMeasured, match=r"s\.attn is not measured by this run's kernel"):
            rule_region(_ReadsAttn(), 4, 4, sig)
        assert rule_region(fxbudget.rules.get("snapkv", window=4), 4, 4, sig).shape == sig["pos"].shape


def _measure(form, signals, q, slots, new, const, pooled=False, sliding=0, window=4):
    return measure_phase(HEAD_POOL if pooled else PER_HEAD, q, slots, new, const, window=window, sliding=sliding,
                         scale=None, block=4, form=MeasureSpec(form=form, signals=signals))


def _select(rule, measured, slots, new, pooled):
    out, totals, signals = measured
    s = replace(slots, **{f: getattr(slots, f).clone() for f in SLOT_FIELDS})
    select(HEAD_POOL if pooled else PER_HEAD, rule, signals, totals, s, new, budget=4, keep=4, window=4)
    return s


@pytest.mark.parametrize("form", ["blocks", "flex"])
@pytest.mark.parametrize("sliding", [0, 6])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_rule_exact_under_its_own_set(call, sliding, form):
    """Every rule (and a head-adaptive one on the pool) under its own set and under "all": the same output, the
    signals it reads bit for bit (a skipped signal changes nothing a rule reads), the same kept entries."""
    measured = {}
    for pooled in (False, True):
        args = _inputs(pooled=pooled, **CALLS[call])
        measured[pooled] = args, _measure(form, ALL, *args, pooled=pooled, sliding=sliding)
    for name in _rules():
        rule = fxbudget.rules.get(name, **({"window": 4} if name in ("snapkv", "pyramidkv") else {}))
        pooled = rule.head_adaptive
        (q, slots, new, const), full = measured[pooled]
        own = _measure(form, rule_signals(rule), q, slots, new, const, pooled=pooled, sliding=sliding)
        assert torch.equal(own[0], full[0]), name
        assert set(own[2]) == set(full[2]) - (ALL - rule_signals(rule)), name
        for key, x in own[2].items():
            assert torch.equal(x, full[2][key]), (name, key)
        a, b = _select(rule, own, slots, new, pooled), _select(rule, full, slots, new, pooled)
        for f in ("keys", "values", "pos", "owner"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (name, f)


@pytest.mark.parametrize("signals, calls", [(ALL, 2), ({"acc_attn", "window_attn"}, 2), ({"attn"}, 2),
                                             ({"window_attn", "key_norm"}, 1), (frozenset(), 1)])
def test_flex_drops_the_transposed_call_without_attn(signals, calls):
    q, slots, new, const = _inputs(**CALLS["chunk"])
    ev = {**dict(zip(MARKER_TENSORS, marker_tensors(slots, new, const))), "q": q}
    gm = trace_kernel(ev, fxbudget.rules.get("streamingllm"), budget=4, keep=4, sliding=0, window=4, scale=None, block=4,
                      budget_ints=False, measure=MeasureSpec(form="flex", signals=signals)).measure
    flex = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.flex_attention]
    assert len(flex) == calls


def test_carried_state_is_not_updated_without_attention():
    q, slots, new, const = _inputs(**CALLS["chunk"])
    rule = fxbudget.rules.get("knorm")
    for form in ("blocks", "flex"):
        a = _select(rule, _measure(form, {"key_norm"}, q, slots, new, const), slots, new, False)
        b = _select(rule, _measure(form, ALL, q, slots, new, const), slots, new, False)
        assert torch.equal(a.pos, b.pos)
        stayed = (a.pos >= 0) & (slots.pos == a.pos)  # entries kept in their slot
        assert bool(stayed.any())
        assert torch.equal(a.state[stayed], slots.state.to(a.state.dtype)[stayed])  # carried unchanged
        assert not torch.equal(a.state, b.state)  # under "all" it accumulated this call's attention


def _generate(m, ids, mask=None, steps=3):
    with torch.no_grad():
        out = m(input_ids=ids, attention_mask=mask)
        logits = [out.logits[:, -1]]
        for _ in range(steps):
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = m(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=out.past_key_values,
                    attention_mask=mask)
            logits.append(out.logits[:, -1])
    return torch.stack(logits), out.past_key_values


@pytest.mark.parametrize("form", ["blocks", "flex"])
def test_model_exact_under_own_set(form):
    """A tiny GQA model with a sliding layer: a left-padded batch, chunked prefill with eviction, then decode, for
    a rule per signal: the same logits and kept positions under the rule's own set and under "all"."""
    model = tiny_model("gemma3", layers=2)
    ids = torch.randint(1, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    for rule in ("snapkv", "h2o", "knorm", "tova", "observed_attention", "keydiff", "expected_attention"):
        runs = {}
        for signals in (None, "all"):
            m = fxbudget.compile(model, rule=rule, budget=12, chunk_size=16, backend=None, measure=form,
                                 signals=signals, **({"window": 4} if rule == "snapkv" else {}))
            try:
                runs[signals] = _generate(m, ids, mask)
            finally:
                model.forward.restore()
        (la, ca), (lb, cb) = runs[None], runs["all"]
        assert torch.equal(la, lb), rule
        for x, y in zip(ca.layers, cb.layers):
            assert torch.equal(x.pos, y.pos) and torch.equal(x.keys, y.keys), rule


def test_compiled_aot_eager_exact_under_own_set():
    model = tiny_model("qwen2", layers=1)
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    runs = {}
    for signals in (None, "all"):
        m = fxbudget.compile(model, rule="tova", budget=12, chunk_size=16, backend="aot_eager", signals=signals)
        try:
            runs[signals] = _generate(m, ids)
        finally:
            model.forward.restore()
    assert torch.equal(runs[None][0], runs["all"][0])
    assert all(torch.equal(x.pos, y.pos) for x, y in zip(runs[None][1].layers, runs["all"][1].layers))


def test_fingerprint_names_the_set():
    model = tiny_model("llama", layers=1)
    fp = {r: fxbudget.kernel_fingerprint(model, rule=r, budget=16, signals={"window_attn", "acc_attn"})
          for r in ("snapkv", "h2o")}
    assert len(set(fp.values())) == 1  # one kernel for every rule of the run
    own = fxbudget.kernel_fingerprint(model, rule="snapkv", budget=16, signals=None)
    assert len({own, fp["snapkv"], fxbudget.kernel_fingerprint(model, rule="snapkv", budget=16)}) == 3


def test_report_says_when_rows_pool_signal_sets():
    from fxbudget.harness.report import signal_set_line, signal_sets

    rows = [{"signals": "window_attn", "kernel_fingerprint": "a"}, {"kernel_fingerprint": "b"}]  # older: no field
    assert signal_sets(rows) == ["all", "window_attn"]
    line = signal_set_line(signal_sets(rows))
    assert line.startswith("- **2 different signal sets (all; window_attn)**") and "\n" not in line
    assert "accuracy columns comparable" in line and "cost columns (times, memory) not" in line
    assert signal_set_line(signal_sets(rows[:1])).endswith(": window_attn")


def test_grid_signal_set_is_the_union_of_its_rules():
    from fxbudget.harness.grid import Grid

    g = Grid(rules=["full", "snapkv", "knorm"], budgets=[16])
    assert g.signal_set() == {"window_attn", "key_norm"}
    assert Grid(rules=["full", "snapkv"], signals="all").signal_set() == ALL
