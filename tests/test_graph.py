"""The rewritten graphs: one shared kernel for every rule, what is rewritten and what is left alone."""

import logging
from types import SimpleNamespace

import pytest
import torch
from expecttest import assert_expected_inline

import fxbudget
from conftest import tiny_model
from tiny_attention import CONFIG, OneLayer, Output


def _ids(n=6):
    return torch.arange(n).view(1, n) % 16


def _wrapped_forms() -> list[str]:
    """Every wrapper form of the uniform layout (`noprotect:`, `protectonly:`; head-adaptive `adakv:` runs on the
    pooled layout: tests/test_adakv.py) around every registered rule it accepts: a wrapper registered later is
    picked up here without touching this test."""
    out = []
    for prefix in fxbudget.rules.wrapper_prefixes():
        for rule in fxbudget.rules.available():
            try:
                wrapped = fxbudget.rules.get(prefix + rule)
            except ValueError:  # e.g. noprotect: of a rule that protects nothing
                continue
            if not wrapped.head_adaptive:
                out.append(prefix + rule)
    return out


def test_fingerprint_equal_across_rules(monkeypatch):
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (1, 12))
    forms = _wrapped_forms()
    assert {"noprotect:snapkv", "protectonly:h2o", "protectonly:expected_attention"} <= set(forms)
    prints = {rule: fxbudget.kernel_fingerprint(model, ids, rule=rule, budget=40)
              for rule in fxbudget.rules.available() + forms}  # pyramidkv's two layers hold 62 and 18 slots
    assert len(set(prints.values())) == 1, prints
    # The hash does see the kernel: a change to the shared measure phase changes it.
    from fxbudget.passes import sdpa

    original = sdpa.measure_phase

    def measure_variant(*args, **kwargs):
        out, *rest = original(*args, **kwargs)
        return (out * 1.0, *rest)

    monkeypatch.setattr(sdpa, "measure_phase", measure_variant)
    assert fxbudget.kernel_fingerprint(model, ids, rule="knorm", budget=40) != prints["knorm"]


# A kernel change that only moves an integer (the window's slice, the number kept, a reduction dim) must change the
# fingerprint: two variants of the shared kernel, `p` being the only difference between them.
_KERNEL_VARIANTS = {
    "window": ("measure_phase", (0, -1), lambda f, p: lambda *a, window, **k: f(*a, window=window + p, **k)),
    "keep": ("evict_phase", (0, -1), lambda f, p: lambda *a, keep, **k: f(*a, keep=keep + p, **k)),
    "reduction_dim": ("measure_phase", (1, 2),
                      lambda f, p: lambda *a, **k: (lambda r: (r[0], r[1].cumsum(p), *r[2:]))(f(*a, **k))),
}


@pytest.mark.parametrize("change", sorted(_KERNEL_VARIANTS))
def test_fingerprint_sees_kernel_integers(monkeypatch, change):
    from fxbudget.passes import sdpa

    phase, params, variant = _KERNEL_VARIANTS[change]
    original = getattr(sdpa, phase)
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (1, 12))
    prints = []
    for p in params:
        monkeypatch.setattr(sdpa, phase, variant(original, p))
        prints.append(fxbudget.kernel_fingerprint(model, ids, rule="snapkv", budget=8, window=4))
    assert prints[0] != prints[1]


class _WritesSignal(fxbudget.rules.Rule):
    """Zeroes one of its signals in place (`k_slots` is the cache, `acc_attn` what evict writes back)."""

    name = "writes_signal"

    def __init__(self, signal):
        self.signal = signal

    def score(self, s):
        getattr(s, self.signal).zero_()
        return s.attn


@pytest.mark.parametrize("signal", ["acc_attn", "k_slots"])
def test_rule_writing_a_signal_is_refused_when_traced(signal):
    model = tiny_model("qwen2", layers=1)
    with pytest.raises(Exception, match=r"'writes_signal' writes a signal tensor in place \(aten.zero_.default\)"):
        fxbudget.kernel_fingerprint(model, torch.randint(0, 96, (1, 12)), rule=_WritesSignal(signal), budget=8)


@pytest.mark.parametrize("signal", ["acc_attn", "k_slots"])
def test_rule_writing_a_signal_is_refused_eagerly(signal):
    from fxbudget.kernel import RuleContractError

    # signals="all": no dry run at compile (which refuses it first, as RuleProbeError): the kernel's own refusal
    m = fxbudget.compile(tiny_model("qwen2", layers=1), rule=_WritesSignal(signal), budget=8, backend=None,
                         signals="all")
    with pytest.raises(RuleContractError, match=r"writes a signal tensor in place \(aten.zero_.default\)"):
        m(input_ids=torch.randint(0, 96, (1, 12)))


def test_traced_rule_graph_writing_an_input_is_refused():
    # The pass's own check of the traced rule graph (a backstop behind rule_region's refusal while tracing).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxbudget.kernel import RuleContractError
    from fxbudget.passes.sdpa import _check_pure

    def writes(x):
        y = x.clone().clamp_min_(0)  # the rule's own temporary: allowed
        x[..., :1].zero_()
        return y

    with FakeTensorMode():
        gm = make_fx(writes)(torch.empty(2, 3))
    with pytest.raises(RuleContractError, match=r"aten.zero_.default"):
        _check_pure(gm, _WritesSignal("attn"))


def test_fingerprint_equal_on_sliding_model():
    model = tiny_model("gemma3", layers=3)
    ids = torch.randint(0, 96, (1, 12))
    assert fxbudget.kernel_fingerprint(model, ids, rule="h2o", budget=8) == \
        fxbudget.kernel_fingerprint(model, ids, rule="streamingllm", budget=8)


def test_rule_ops_differ_between_rules():
    model = tiny_model("llama", layers=1)
    ids = torch.randint(0, 96, (1, 5))
    a = fxbudget.inspect(model, ids, rule="knorm", budget=4)
    b = fxbudget.inspect(model, ids, rule="h2o", budget=4)
    assert a != b and "scaled_dot_product_attention" not in a and "fxbudget.candidates" not in a
    assert "index_put_" in a  # the in-place write-back survived dead-code elimination


def test_cross_attention_left_alone(caplog):
    model = OneLayer(cross=True)
    with caplog.at_level(logging.WARNING, logger="fxbudget"):
        code = fxbudget.inspect(model, _ids(), rule="knorm", budget=4, cache=fxbudget.BudgetCache(CONFIG, 4))
    assert code.count("_nn.scaled_dot_product_attention(") == 1  # the cross-attention call, unchanged
    assert "not fed by a BudgetCache left unchanged" in caplog.text


def test_rewritten_graph_snapshot():
    code = fxbudget.inspect(OneLayer(), _ids(3), rule="knorm", budget=4, cache=fxbudget.BudgetCache(CONFIG, 4))
    assert_expected_inline(code, """\
def forward(self, L_forward_self_modules_emb_parameters_weight_ : torch.nn.parameter.Parameter, L_kwargs_input_ids_ : torch.Tensor, L_forward_self_modules_q_parameters_weight_ : torch.nn.parameter.Parameter, L_forward_self_modules_k_parameters_weight_ : torch.nn.parameter.Parameter, L_forward_self_modules_v_parameters_weight_ : torch.nn.parameter.Parameter, L_kwargs_past_key_values_layers_0_seen : torch.Tensor, L_kwargs_past_key_values_layers_0_keys : torch.Tensor, L_kwargs_past_key_values_layers_0_values : torch.Tensor, L_kwargs_past_key_values_layers_0_pos : torch.Tensor, L_kwargs_past_key_values_layers_0_state : torch.Tensor, L_kwargs_past_key_values_layers_0_norms : torch.Tensor, L_kwargs_past_key_values_layers_0_totals : torch.Tensor, L_kwargs_past_key_values_layers_0_owner : torch.Tensor, L_kwargs_past_key_values_layers_0_inv_freq : torch.Tensor, L_kwargs_past_key_values_layers_0_wo : torch.Tensor, L_forward_self_modules_out_parameters_weight_ : torch.nn.parameter.Parameter):
    l_forward_self_modules_emb_parameters_weight_ = L_forward_self_modules_emb_parameters_weight_
    l_kwargs_input_ids_ = L_kwargs_input_ids_
    l_forward_self_modules_q_parameters_weight_ = L_forward_self_modules_q_parameters_weight_
    l_forward_self_modules_k_parameters_weight_ = L_forward_self_modules_k_parameters_weight_
    l_forward_self_modules_v_parameters_weight_ = L_forward_self_modules_v_parameters_weight_
    l_kwargs_past_key_values_layers_0_seen = L_kwargs_past_key_values_layers_0_seen
    l_kwargs_past_key_values_layers_0_keys = L_kwargs_past_key_values_layers_0_keys
    l_kwargs_past_key_values_layers_0_values = L_kwargs_past_key_values_layers_0_values
    l_kwargs_past_key_values_layers_0_pos = L_kwargs_past_key_values_layers_0_pos
    l_kwargs_past_key_values_layers_0_state = L_kwargs_past_key_values_layers_0_state
    l_kwargs_past_key_values_layers_0_norms = L_kwargs_past_key_values_layers_0_norms
    l_kwargs_past_key_values_layers_0_totals = L_kwargs_past_key_values_layers_0_totals
    l_kwargs_past_key_values_layers_0_owner = L_kwargs_past_key_values_layers_0_owner
    l_kwargs_past_key_values_layers_0_inv_freq = L_kwargs_past_key_values_layers_0_inv_freq
    l_kwargs_past_key_values_layers_0_wo = L_kwargs_past_key_values_layers_0_wo
    l_forward_self_modules_out_parameters_weight_ = L_forward_self_modules_out_parameters_weight_
    x = torch.nn.functional.embedding(l_kwargs_input_ids_, l_forward_self_modules_emb_parameters_weight_, None, None, 2.0, False, False);  l_kwargs_input_ids_ = l_forward_self_modules_emb_parameters_weight_ = None
    linear = torch._C._nn.linear(x, l_forward_self_modules_q_parameters_weight_, None);  l_forward_self_modules_q_parameters_weight_ = None
    view = linear.view(1, 3, 2, 4);  linear = None
    q = view.transpose(1, 2);  view = None
    linear_1 = torch._C._nn.linear(x, l_forward_self_modules_k_parameters_weight_, None);  l_forward_self_modules_k_parameters_weight_ = None
    view_1 = linear_1.view(1, 3, 1, 4);  linear_1 = None
    k = view_1.transpose(1, 2);  view_1 = None
    linear_2 = torch._C._nn.linear(x, l_forward_self_modules_v_parameters_weight_, None);  x = l_forward_self_modules_v_parameters_weight_ = None
    view_2 = linear_2.view(1, 3, 1, 4);  linear_2 = None
    v = view_2.transpose(1, 2);  view_2 = None
    arange = torch.arange(3, device = device(type='cpu'))
    add = arange + l_kwargs_past_key_values_layers_0_seen;  arange = None
    new_pos = add.expand(1, 3);  add = None
    add_ = l_kwargs_past_key_values_layers_0_seen.add_(3);  l_kwargs_past_key_values_layers_0_seen = add_ = None
    unsqueeze = torch.ops.aten.unsqueeze.default(new_pos, 1)
    expand_1 = torch.ops.aten.expand.default(unsqueeze, [1, 1, 3]);  unsqueeze = None
    cat = torch.ops.aten.cat.default([l_kwargs_past_key_values_layers_0_pos, expand_1], 2);  expand_1 = None
    clone = torch.ops.aten.clone.default(q, memory_format = torch.contiguous_format);  q = None
    _unsafe_view = torch.ops.aten._unsafe_view.default(clone, [1, 1, 6, 4]);  clone = None
    _to_copy = torch.ops.aten._to_copy.default(new_pos, dtype = torch.int32);  new_pos = None
    amax = torch.ops.aten.amax.default(_to_copy, [-1], True)
    ge = torch.ops.aten.ge.Scalar(_to_copy, 0)
    sub = torch.ops.aten.sub.Tensor(amax, 3)
    gt = torch.ops.aten.gt.Tensor(_to_copy, sub);  sub = None
    bitwise_and = torch.ops.aten.bitwise_and.Tensor(ge, gt);  gt = None
    eq = torch.ops.aten.eq.Tensor(_to_copy, amax);  amax = None
    bitwise_and_1 = torch.ops.aten.bitwise_and.Tensor(ge, eq);  eq = None
    stack = torch.ops.aten.stack.default([ge, bitwise_and, bitwise_and_1], 1);  ge = bitwise_and = bitwise_and_1 = None
    _to_copy_1 = torch.ops.aten._to_copy.default(stack, dtype = torch.float32);  stack = None
    _to_copy_2 = torch.ops.aten._to_copy.default(l_kwargs_past_key_values_layers_0_pos, dtype = torch.int32)
    alias = torch.ops.aten.alias.default(l_kwargs_past_key_values_layers_0_keys)
    alias_1 = torch.ops.aten.alias.default(l_kwargs_past_key_values_layers_0_values)
    alias_2 = torch.ops.aten.alias.default(_to_copy_2);  _to_copy_2 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(_to_copy, 1)
    view_3 = torch.ops.aten.view.default(_to_copy, [1, 1, 1, 3, 1]);  _to_copy = None
    mul = torch.ops.aten.mul.Tensor(_unsafe_view, 0.5);  _unsafe_view = None
    transpose_4 = torch.ops.aten.transpose.int(alias, -1, -2);  alias = None
    expand_2 = torch.ops.aten.expand.default(mul, [1, 1, 6, 4])
    view_4 = torch.ops.aten.view.default(expand_2, [1, 6, 4]);  expand_2 = None
    expand_3 = torch.ops.aten.expand.default(transpose_4, [1, 1, 4, 4]);  transpose_4 = None
    view_5 = torch.ops.aten.view.default(expand_3, [1, 4, 4]);  expand_3 = None
    bmm = torch.ops.aten.bmm.default(view_4, view_5);  view_4 = view_5 = None
    _unsafe_view_1 = torch.ops.aten._unsafe_view.default(bmm, [1, 1, 6, 4]);  bmm = None
    view_6 = torch.ops.aten.view.default(_unsafe_view_1, [1, 1, 2, 3, -1]);  _unsafe_view_1 = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(alias_2, 2);  alias_2 = None
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(unsqueeze_2, 2);  unsqueeze_2 = None
    ge_1 = torch.ops.aten.ge.Scalar(unsqueeze_3, 0)
    le = torch.ops.aten.le.Tensor(unsqueeze_3, view_3);  unsqueeze_3 = None
    bitwise_and_2 = torch.ops.aten.bitwise_and.Tensor(ge_1, le);  ge_1 = le = None
    bitwise_not = torch.ops.aten.bitwise_not.default(bitwise_and_2);  bitwise_and_2 = None
    masked_fill_ = torch.ops.aten.masked_fill_.Scalar(view_6, bitwise_not, -inf);  view_6 = bitwise_not = None
    slice_1 = torch.ops.aten.slice.Tensor(k, 2, 0, 3)
    slice_2 = torch.ops.aten.slice.Tensor(unsqueeze_1, -1, 0, 3);  unsqueeze_1 = None
    transpose_5 = torch.ops.aten.transpose.int(slice_1, -1, -2);  slice_1 = None
    expand_4 = torch.ops.aten.expand.default(mul, [1, 1, 6, 4]);  mul = None
    view_7 = torch.ops.aten.view.default(expand_4, [1, 6, 4]);  expand_4 = None
    expand_5 = torch.ops.aten.expand.default(transpose_5, [1, 1, 4, 3]);  transpose_5 = None
    view_8 = torch.ops.aten.view.default(expand_5, [1, 4, 3]);  expand_5 = None
    bmm_1 = torch.ops.aten.bmm.default(view_7, view_8);  view_7 = view_8 = None
    _unsafe_view_2 = torch.ops.aten._unsafe_view.default(bmm_1, [1, 1, 6, 3]);  bmm_1 = None
    view_9 = torch.ops.aten.view.default(_unsafe_view_2, [1, 1, 2, 3, -1]);  _unsafe_view_2 = None
    unsqueeze_4 = torch.ops.aten.unsqueeze.default(slice_2, 2);  slice_2 = None
    unsqueeze_5 = torch.ops.aten.unsqueeze.default(unsqueeze_4, 2);  unsqueeze_4 = None
    ge_2 = torch.ops.aten.ge.Scalar(unsqueeze_5, 0)
    le_1 = torch.ops.aten.le.Tensor(unsqueeze_5, view_3);  unsqueeze_5 = view_3 = None
    bitwise_and_3 = torch.ops.aten.bitwise_and.Tensor(ge_2, le_1);  ge_2 = le_1 = None
    bitwise_not_1 = torch.ops.aten.bitwise_not.default(bitwise_and_3);  bitwise_and_3 = None
    masked_fill__1 = torch.ops.aten.masked_fill_.Scalar(view_9, bitwise_not_1, -inf);  view_9 = bitwise_not_1 = None
    amax_1 = torch.ops.aten.amax.default(masked_fill__1, [-1], True)
    amax_2 = torch.ops.aten.amax.default(masked_fill_, [-1], True)
    maximum = torch.ops.aten.maximum.default(amax_2, amax_1);  amax_2 = amax_1 = None
    eq_1 = torch.ops.aten.eq.Scalar(maximum, -inf)
    masked_fill = torch.ops.aten.masked_fill.Scalar(maximum, eq_1, 0.0);  maximum = eq_1 = None
    sub_ = torch.ops.aten.sub_.Tensor(masked_fill_, masked_fill);  masked_fill_ = None
    exp_ = torch.ops.aten.exp_.default(sub_);  sub_ = None
    view_10 = torch.ops.aten.view.default(exp_, [1, 1, 6, -1]);  exp_ = None
    sub__1 = torch.ops.aten.sub_.Tensor(masked_fill__1, masked_fill);  masked_fill__1 = masked_fill = None
    exp__1 = torch.ops.aten.exp_.default(sub__1);  sub__1 = None
    view_11 = torch.ops.aten.view.default(exp__1, [1, 1, 6, -1]);  exp__1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(view_10, [-1], True)
    sum_2 = torch.ops.aten.sum.dim_IntList(view_11, [-1], True)
    add_1 = torch.ops.aten.add.Tensor(sum_1, sum_2);  sum_1 = sum_2 = None
    eq_2 = torch.ops.aten.eq.Scalar(add_1, 0)
    masked_fill_1 = torch.ops.aten.masked_fill.Scalar(add_1, eq_2, 1.0);  add_1 = eq_2 = None
    reciprocal = torch.ops.aten.reciprocal.default(masked_fill_1);  masked_fill_1 = None
    mul_1 = torch.ops.aten.mul.Tensor(reciprocal, 1.0);  reciprocal = None
    expand_6 = torch.ops.aten.expand.default(view_10, [1, 1, 6, 4])
    view_12 = torch.ops.aten.view.default(expand_6, [1, 6, 4]);  expand_6 = None
    expand_7 = torch.ops.aten.expand.default(alias_1, [1, 1, 4, 4]);  alias_1 = None
    view_13 = torch.ops.aten.view.default(expand_7, [1, 4, 4]);  expand_7 = None
    bmm_2 = torch.ops.aten.bmm.default(view_12, view_13);  view_12 = view_13 = None
    _unsafe_view_3 = torch.ops.aten._unsafe_view.default(bmm_2, [1, 1, 6, 4]);  bmm_2 = None
    slice_3 = torch.ops.aten.slice.Tensor(v, 2, 0, 3)
    expand_8 = torch.ops.aten.expand.default(view_11, [1, 1, 6, 3])
    view_14 = torch.ops.aten.view.default(expand_8, [1, 6, 3]);  expand_8 = None
    expand_9 = torch.ops.aten.expand.default(slice_3, [1, 1, 3, 4]);  slice_3 = None
    view_15 = torch.ops.aten.view.default(expand_9, [1, 3, 4]);  expand_9 = None
    bmm_3 = torch.ops.aten.bmm.default(view_14, view_15);  view_14 = view_15 = None
    _unsafe_view_4 = torch.ops.aten._unsafe_view.default(bmm_3, [1, 1, 6, 4]);  bmm_3 = None
    add_2 = torch.ops.aten.add.Tensor(_unsafe_view_3, _unsafe_view_4);  _unsafe_view_3 = _unsafe_view_4 = None
    mul_2 = torch.ops.aten.mul.Tensor(add_2, mul_1);  add_2 = None
    unsqueeze_6 = torch.ops.aten.unsqueeze.default(_to_copy_1, 2)
    expand_10 = torch.ops.aten.expand.default(unsqueeze_6, [1, 3, 2, 3]);  unsqueeze_6 = None
    clone_1 = torch.ops.aten.clone.default(expand_10, memory_format = torch.contiguous_format);  expand_10 = None
    _unsafe_view_5 = torch.ops.aten._unsafe_view.default(clone_1, [1, 1, 3, 6]);  clone_1 = None
    transpose_6 = torch.ops.aten.transpose.int(mul_1, -1, -2)
    mul_3 = torch.ops.aten.mul.Tensor(_unsafe_view_5, transpose_6);  _unsafe_view_5 = transpose_6 = None
    expand_11 = torch.ops.aten.expand.default(mul_3, [1, 1, 3, 6])
    view_16 = torch.ops.aten.view.default(expand_11, [1, 3, 6]);  expand_11 = None
    expand_12 = torch.ops.aten.expand.default(view_10, [1, 1, 6, 4])
    view_17 = torch.ops.aten.view.default(expand_12, [1, 6, 4]);  expand_12 = None
    bmm_4 = torch.ops.aten.bmm.default(view_16, view_17);  view_16 = view_17 = None
    _unsafe_view_6 = torch.ops.aten._unsafe_view.default(bmm_4, [1, 1, 3, 4]);  bmm_4 = None
    expand_13 = torch.ops.aten.expand.default(mul_3, [1, 1, 3, 6]);  mul_3 = None
    view_18 = torch.ops.aten.view.default(expand_13, [1, 3, 6]);  expand_13 = None
    expand_14 = torch.ops.aten.expand.default(view_11, [1, 1, 6, 3])
    view_19 = torch.ops.aten.view.default(expand_14, [1, 6, 3]);  expand_14 = None
    bmm_5 = torch.ops.aten.bmm.default(view_18, view_19);  view_18 = view_19 = None
    _unsafe_view_7 = torch.ops.aten._unsafe_view.default(bmm_5, [1, 1, 3, 3]);  bmm_5 = None
    select = torch.ops.aten.select.int(_to_copy_1, 1, 1);  _to_copy_1 = None
    view_20 = torch.ops.aten.view.default(mul_1, [1, 1, 2, 3, 1]);  mul_1 = None
    view_21 = torch.ops.aten.view.default(select, [1, 1, 1, 3, 1]);  select = None
    mul_4 = torch.ops.aten.mul.Tensor(view_20, view_21);  view_20 = view_21 = None
    alias_3 = torch.ops.aten.alias.default(mul_4);  mul_4 = None
    view_22 = torch.ops.aten.view.default(view_10, [1, 1, 2, 3, -1]);  view_10 = None
    alias_4 = torch.ops.aten.alias.default(view_22);  view_22 = None
    mul_5 = torch.ops.aten.mul.Tensor(alias_4, alias_3);  alias_4 = None
    amax_3 = torch.ops.aten.amax.default(mul_5, [2, 3]);  mul_5 = None
    view_23 = torch.ops.aten.view.default(view_11, [1, 1, 2, 3, -1]);  view_11 = None
    alias_5 = torch.ops.aten.alias.default(view_23);  view_23 = None
    mul_6 = torch.ops.aten.mul.Tensor(alias_5, alias_3);  alias_5 = alias_3 = None
    amax_4 = torch.ops.aten.amax.default(mul_6, [2, 3]);  mul_6 = None
    cat_1 = torch.ops.aten.cat.default([amax_3, amax_4], -1);  amax_3 = amax_4 = None
    view_24 = torch.ops.aten.view.default(mul_2, [1, 2, 3, -1]);  mul_2 = None
    select_1 = torch.ops.aten.select.int(_unsafe_view_6, 2, 0)
    select_2 = torch.ops.aten.select.int(_unsafe_view_7, 2, 0)
    cat_2 = torch.ops.aten.cat.default([select_1, select_2], -1);  select_1 = select_2 = None
    select_3 = torch.ops.aten.select.int(_unsafe_view_6, 2, 1)
    select_4 = torch.ops.aten.select.int(_unsafe_view_7, 2, 1)
    cat_3 = torch.ops.aten.cat.default([select_3, select_4], -1);  select_3 = select_4 = None
    select_5 = torch.ops.aten.select.int(_unsafe_view_6, 2, 2);  _unsafe_view_6 = None
    select_6 = torch.ops.aten.select.int(_unsafe_view_7, 2, 2);  _unsafe_view_7 = None
    cat_4 = torch.ops.aten.cat.default([select_5, select_6], -1);  select_5 = select_6 = None
    new_zeros = torch.ops.aten.new_zeros.default(l_kwargs_past_key_values_layers_0_state, [1, 1, 3], pin_memory = False)
    cat_5 = torch.ops.aten.cat.default([l_kwargs_past_key_values_layers_0_state, new_zeros], 2);  new_zeros = None
    add_3 = torch.ops.aten.add.Tensor(cat_5, cat_2);  cat_5 = None
    select_7 = torch.ops.aten.select.int(l_kwargs_past_key_values_layers_0_norms, 3, 0)
    linalg_vector_norm = torch.ops.aten.linalg_vector_norm.default(k, 2, [-1], dtype = torch.float32)
    cat_6 = torch.ops.aten.cat.default([select_7, linalg_vector_norm], -1);  select_7 = linalg_vector_norm = None
    select_8 = torch.ops.aten.select.int(l_kwargs_past_key_values_layers_0_norms, 3, 1)
    linalg_vector_norm_1 = torch.ops.aten.linalg_vector_norm.default(v, 2, [-1], dtype = torch.float32)
    cat_7 = torch.ops.aten.cat.default([select_8, linalg_vector_norm_1], -1);  select_8 = linalg_vector_norm_1 = None
    select_9 = torch.ops.aten.select.int(l_kwargs_past_key_values_layers_0_norms, 3, 2)
    transpose_7 = torch.ops.aten.transpose.int(v, 0, 1)
    view_25 = torch.ops.aten.view.default(transpose_7, [1, 3, 4]);  transpose_7 = None
    bmm_6 = torch.ops.aten.bmm.default(view_25, l_kwargs_past_key_values_layers_0_wo);  view_25 = l_kwargs_past_key_values_layers_0_wo = None
    view_26 = torch.ops.aten.view.default(bmm_6, [1, 1, 3, 2, 4]);  bmm_6 = None
    linalg_vector_norm_2 = torch.ops.aten.linalg_vector_norm.default(view_26, 2, [-1]);  view_26 = None
    mean = torch.ops.aten.mean.dim(linalg_vector_norm_2, [-1]);  linalg_vector_norm_2 = None
    transpose_8 = torch.ops.aten.transpose.int(mean, 0, 1);  mean = None
    cat_8 = torch.ops.aten.cat.default([select_9, transpose_8], -1);  select_9 = transpose_8 = None
    sum_3 = torch.ops.aten.sum.dim_IntList(cat_2, [-1]);  cat_2 = None
    sum_4 = torch.ops.aten.sum.dim_IntList(cat_3, [-1]);  cat_3 = None
    sum_5 = torch.ops.aten.sum.dim_IntList(cat_4, [-1]);  cat_4 = None
    sum_6 = torch.ops.aten.sum.dim_IntList(add_3, [-1])
    sum_7 = torch.ops.aten.sum.dim_IntList(cat_6, [-1])
    sum_8 = torch.ops.aten.sum.dim_IntList(cat_7, [-1])
    _to_copy_3 = torch.ops.aten._to_copy.default(cat, dtype = torch.float32)
    sum_9 = torch.ops.aten.sum.dim_IntList(_to_copy_3, [-1]);  _to_copy_3 = None
    sum_10 = torch.ops.aten.sum.dim_IntList(cat_1, [-1]);  cat_1 = None
    sum_11 = torch.ops.aten.sum.dim_IntList(cat_8, [-1])
    stack_1 = torch.ops.aten.stack.default([sum_3, sum_4, sum_5, sum_6, sum_7, sum_8, sum_9, sum_10, sum_11], -1);  sum_3 = sum_4 = sum_5 = sum_6 = sum_7 = sum_8 = sum_9 = sum_10 = sum_11 = None
    neg = torch.ops.aten.neg.default(cat_6)
    isnan = torch.ops.aten.isnan.default(neg)
    masked_fill_2 = torch.ops.aten.masked_fill.Scalar(neg, isnan, -inf);  neg = isnan = None
    lt = torch.ops.aten.lt.Scalar(cat, 0)
    masked_fill_3 = torch.ops.aten.masked_fill.Scalar(masked_fill_2, lt, -inf);  masked_fill_2 = lt = None
    eq_3 = torch.ops.aten.eq.Scalar(masked_fill_3, 0)
    scalar_tensor = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where = torch.ops.aten.where.self(eq_3, scalar_tensor, masked_fill_3);  eq_3 = scalar_tensor = masked_fill_3 = None
    view_28 = torch.ops.aten.view.dtype(where, torch.int32);  where = None
    detach = torch.ops.aten.detach.default(view_28);  view_28 = None
    ge_4 = torch.ops.aten.ge.Scalar(detach, 0)
    bitwise_xor = torch.ops.aten.bitwise_xor.Scalar(detach, 2147483647)
    where_1 = torch.ops.aten.where.self(ge_4, detach, bitwise_xor);  ge_4 = detach = bitwise_xor = None
    _to_copy_4 = torch.ops.aten._to_copy.default(where_1, dtype = torch.int64);  where_1 = None
    arange_1 = torch.ops.aten.arange.default(7, device = device(type='cpu'), pin_memory = False)
    ge_5 = torch.ops.aten.ge.Scalar(cat, 0)
    add_4 = torch.ops.aten.add.Tensor(cat, 7)
    rsub = torch.ops.aten.rsub.Scalar(arange_1, 6)
    where_2 = torch.ops.aten.where.self(ge_5, add_4, rsub);  ge_5 = add_4 = rsub = None
    mul_7 = torch.ops.aten.mul.Tensor(_to_copy_4, 4294967296);  _to_copy_4 = None
    add_5 = torch.ops.aten.add.Tensor(mul_7, where_2);  mul_7 = where_2 = None
    topk = torch.ops.aten.topk.default(add_5, 3, -1, False);  add_5 = None
    getitem_3 = topk[1];  topk = None
    zeros_like = torch.ops.aten.zeros_like.default(cat, dtype = torch.bool, pin_memory = False)
    scatter = torch.ops.aten.scatter.value(zeros_like, -1, getitem_3, True);  zeros_like = getitem_3 = None
    slice_4 = torch.ops.aten.slice.Tensor(scatter, 2, 0, 4)
    slice_5 = torch.ops.aten.slice.Tensor(scatter, 2, 4, 9223372036854775807);  scatter = None
    bitwise_not_2 = torch.ops.aten.bitwise_not.default(slice_5);  slice_5 = None
    slice_6 = torch.ops.aten.slice.Tensor(arange_1, 0, 0, 4)
    rsub_1 = torch.ops.aten.rsub.Scalar(slice_6, 4);  slice_6 = None
    scalar_tensor_1 = torch.ops.aten.scalar_tensor.default(0, dtype = torch.int64, layout = torch.strided, device = device(type='cpu'))
    where_3 = torch.ops.aten.where.self(slice_4, rsub_1, scalar_tensor_1);  rsub_1 = scalar_tensor_1 = None
    topk_1 = torch.ops.aten.topk.default(where_3, 3);  where_3 = None
    getitem_5 = topk_1[1];  topk_1 = None
    slice_7 = torch.ops.aten.slice.Tensor(arange_1, 0, 0, 3);  arange_1 = None
    rsub_2 = torch.ops.aten.rsub.Scalar(slice_7, 3);  slice_7 = None
    scalar_tensor_2 = torch.ops.aten.scalar_tensor.default(0, dtype = torch.int64, layout = torch.strided, device = device(type='cpu'))
    where_4 = torch.ops.aten.where.self(bitwise_not_2, rsub_2, scalar_tensor_2);  rsub_2 = scalar_tensor_2 = None
    topk_2 = torch.ops.aten.topk.default(where_4, 3);  where_4 = None
    getitem_7 = topk_2[1];  topk_2 = None
    arange_2 = torch.ops.aten.arange.default(3, device = device(type='cpu'), pin_memory = False)
    sum_13 = torch.ops.aten.sum.dim_IntList(bitwise_not_2, [-1], True);  bitwise_not_2 = None
    lt_1 = torch.ops.aten.lt.Tensor(arange_2, sum_13);  arange_2 = sum_13 = None
    arange_3 = torch.ops.aten.arange.default(1, device = device(type='cpu'), pin_memory = False)
    view_29 = torch.ops.aten.view.default(arange_3, [1, 1, 1]);  arange_3 = None
    arange_4 = torch.ops.aten.arange.default(1, device = device(type='cpu'), pin_memory = False)
    view_30 = torch.ops.aten.view.default(arange_4, [1, 1, 1]);  arange_4 = None
    unsqueeze_7 = torch.ops.aten.unsqueeze.default(lt_1, -1)
    index = torch.ops.aten.index.Tensor(k, [view_29, view_30, getitem_7]);  k = None
    index_1 = torch.ops.aten.index.Tensor(l_kwargs_past_key_values_layers_0_keys, [view_29, view_30, getitem_5])
    where_5 = torch.ops.aten.where.self(unsqueeze_7, index, index_1);  unsqueeze_7 = index = index_1 = None
    index_put_ = torch.ops.aten.index_put_.default(l_kwargs_past_key_values_layers_0_keys, [view_29, view_30, getitem_5], where_5);  l_kwargs_past_key_values_layers_0_keys = where_5 = index_put_ = None
    unsqueeze_8 = torch.ops.aten.unsqueeze.default(lt_1, -1)
    index_2 = torch.ops.aten.index.Tensor(v, [view_29, view_30, getitem_7]);  v = None
    index_3 = torch.ops.aten.index.Tensor(l_kwargs_past_key_values_layers_0_values, [view_29, view_30, getitem_5])
    where_6 = torch.ops.aten.where.self(unsqueeze_8, index_2, index_3);  unsqueeze_8 = index_2 = index_3 = None
    index_put__1 = torch.ops.aten.index_put_.default(l_kwargs_past_key_values_layers_0_values, [view_29, view_30, getitem_5], where_6);  l_kwargs_past_key_values_layers_0_values = where_6 = index_put__1 = None
    masked_fill_4 = torch.ops.aten.masked_fill.Scalar(l_kwargs_past_key_values_layers_0_pos, slice_4, -1)
    slice_8 = torch.ops.aten.slice.Tensor(cat, 2, 4, 9223372036854775807);  cat = None
    gather = torch.ops.aten.gather.default(slice_8, -1, getitem_7);  slice_8 = None
    gather_1 = torch.ops.aten.gather.default(masked_fill_4, -1, getitem_5)
    where_7 = torch.ops.aten.where.self(lt_1, gather, gather_1);  gather = gather_1 = None
    index_put = torch.ops.aten.index_put.default(masked_fill_4, [view_29, view_30, getitem_5], where_7);  masked_fill_4 = where_7 = None
    copy_ = torch.ops.aten.copy_.default(l_kwargs_past_key_values_layers_0_pos, index_put);  l_kwargs_past_key_values_layers_0_pos = index_put = copy_ = None
    slice_9 = torch.ops.aten.slice.Tensor(add_3, 2, 0, 4)
    masked_fill_5 = torch.ops.aten.masked_fill.Scalar(slice_9, slice_4, 0.0);  slice_9 = None
    slice_10 = torch.ops.aten.slice.Tensor(add_3, 2, 4, 9223372036854775807);  add_3 = None
    gather_2 = torch.ops.aten.gather.default(slice_10, -1, getitem_7);  slice_10 = None
    gather_3 = torch.ops.aten.gather.default(masked_fill_5, -1, getitem_5)
    where_8 = torch.ops.aten.where.self(lt_1, gather_2, gather_3);  gather_2 = gather_3 = None
    index_put_1 = torch.ops.aten.index_put.default(masked_fill_5, [view_29, view_30, getitem_5], where_8);  masked_fill_5 = where_8 = None
    copy__1 = torch.ops.aten.copy_.default(l_kwargs_past_key_values_layers_0_state, index_put_1);  l_kwargs_past_key_values_layers_0_state = index_put_1 = copy__1 = None
    slice_11 = torch.ops.aten.slice.Tensor(cat_6, 2, 0, 4)
    masked_fill_6 = torch.ops.aten.masked_fill.Scalar(slice_11, slice_4, 0.0);  slice_11 = None
    slice_12 = torch.ops.aten.slice.Tensor(cat_6, 2, 4, 9223372036854775807);  cat_6 = None
    gather_4 = torch.ops.aten.gather.default(slice_12, -1, getitem_7);  slice_12 = None
    gather_5 = torch.ops.aten.gather.default(masked_fill_6, -1, getitem_5)
    where_9 = torch.ops.aten.where.self(lt_1, gather_4, gather_5);  gather_4 = gather_5 = None
    index_put_2 = torch.ops.aten.index_put.default(masked_fill_6, [view_29, view_30, getitem_5], where_9);  masked_fill_6 = where_9 = None
    slice_13 = torch.ops.aten.slice.Tensor(cat_7, 2, 0, 4)
    masked_fill_7 = torch.ops.aten.masked_fill.Scalar(slice_13, slice_4, 0.0);  slice_13 = None
    slice_14 = torch.ops.aten.slice.Tensor(cat_7, 2, 4, 9223372036854775807);  cat_7 = None
    gather_6 = torch.ops.aten.gather.default(slice_14, -1, getitem_7);  slice_14 = None
    gather_7 = torch.ops.aten.gather.default(masked_fill_7, -1, getitem_5)
    where_10 = torch.ops.aten.where.self(lt_1, gather_6, gather_7);  gather_6 = gather_7 = None
    index_put_3 = torch.ops.aten.index_put.default(masked_fill_7, [view_29, view_30, getitem_5], where_10);  masked_fill_7 = where_10 = None
    slice_15 = torch.ops.aten.slice.Tensor(cat_8, 2, 0, 4)
    masked_fill_8 = torch.ops.aten.masked_fill.Scalar(slice_15, slice_4, 0.0);  slice_15 = slice_4 = None
    slice_16 = torch.ops.aten.slice.Tensor(cat_8, 2, 4, 9223372036854775807);  cat_8 = None
    gather_8 = torch.ops.aten.gather.default(slice_16, -1, getitem_7);  slice_16 = getitem_7 = None
    gather_9 = torch.ops.aten.gather.default(masked_fill_8, -1, getitem_5)
    where_11 = torch.ops.aten.where.self(lt_1, gather_8, gather_9);  lt_1 = gather_8 = gather_9 = None
    index_put_4 = torch.ops.aten.index_put.default(masked_fill_8, [view_29, view_30, getitem_5], where_11);  masked_fill_8 = view_29 = view_30 = getitem_5 = where_11 = None
    stack_2 = torch.ops.aten.stack.default([index_put_2, index_put_3, index_put_4], -1);  index_put_2 = index_put_3 = index_put_4 = None
    copy__2 = torch.ops.aten.copy_.default(l_kwargs_past_key_values_layers_0_norms, stack_2);  l_kwargs_past_key_values_layers_0_norms = stack_2 = copy__2 = None
    copy__3 = torch.ops.aten.copy_.default(l_kwargs_past_key_values_layers_0_totals, stack_1);  l_kwargs_past_key_values_layers_0_totals = stack_1 = copy__3 = None
    transpose_3 = view_24.transpose(1, 2);  view_24 = None
    reshape = transpose_3.reshape(1, 3, 8);  transpose_3 = None
    linear_3 = torch._C._nn.linear(reshape, l_forward_self_modules_out_parameters_weight_, None);  reshape = l_forward_self_modules_out_parameters_weight_ = None
    return (linear_3,)""")


def test_fingerprint_covers_the_query_block_loop(monkeypatch):
    """The fingerprint traces a call long enough for measure's scan over query blocks, and hashes the scan's body:
    a change inside one block's ops changes it."""
    model = tiny_model("qwen2", layers=1)
    ids = torch.randint(0, 96, (1, 9))
    base = fxbudget.kernel_fingerprint(model, ids, rule="h2o", budget=40)
    assert base == fxbudget.kernel_fingerprint(model, ids, rule="tova", budget=40)
    from fxbudget.kernel.attention import Block

    original = Block.__call__

    def variant(self, *args, **kwargs):  # kwargs: `win`, the window max's rows (then two more outputs)
        out, *rest = original(self, *args, **kwargs)
        return out * 1.0, *rest

    monkeypatch.setattr(Block, "__call__", variant)
    assert fxbudget.kernel_fingerprint(model, ids, rule="h2o", budget=40) != base


def _kernels(gm) -> int:
    """Budget kernels spliced into a graph: each writes its layer's cached keys back with one index_put_ (a decode
    step writes positions and norms in place too, so the keys' writes are what is counted)."""
    return sum(n.target is torch.ops.aten.index_put_.default and n.args[0].op == "placeholder"
               and n.args[0].name.endswith("_keys") for n in gm.graph.nodes)


@pytest.mark.parametrize("arch, rule, regions", [
    ("qwen2", "snapkv", 1),       # 4 identical layers: one region
    ("gemma3", "h2o", 2),         # sliding and full layers: one region each
    ("qwen2", "pyramidkv", 4),    # 4 per-layer budgets: one region per budget
])
def test_decoder_layers_share_compiled_regions(arch, rule, regions):
    from conftest import greedy

    model = tiny_model(arch, layers=3 if arch == "gemma3" else 4)
    m = fxbudget.compile(model, rule=rule, budget=8, backend="aot_eager", chunk_size=6,
                         **({"window": 4} if rule == "pyramidkv" else {}))
    with torch.no_grad():
        greedy(m, torch.randint(0, 96, (1, 12)), 3)
    graphs = m.forward.graphs
    # One graph per region and input shape (prefill chunk, decode), each holding one layer's kernel: the layer
    # index never reaches a graph, so Dynamo reuses the region's graph for every layer of its configuration.
    assert len(graphs) == 2 * regions
    assert [_kernels(gm) for gm in graphs] == [1] * len(graphs)


def test_backend_window_is_the_rules_parameter():
    # `window=` is a rule parameter (snapkv's window, hence the kernel's observation window); the frozen runner's
    # override of the kernel window has its own name, so it cannot swallow the rule's.
    backend = fxbudget.make_backend("snapkv", inner="eager", window=8)
    assert backend.rule.window == 8 and backend.window == 8
    backend = fxbudget.make_backend("window", inner="eager", observation_window=8)
    assert backend.rule.name == "window" and backend.window == 8


def test_torch_compile_with_the_registered_backend():
    # The whole-model path: `torch.compile(model, backend="fxbudget")` traces every layer into one graph. The model
    # must build no attention mask (the kernel computes visibility from positions): fxbudget's attention
    # implementation, registered on import. `options` reach the backend: aot_eager instead of Inductor (slow).
    from conftest import fresh

    model = tiny_model("llama", layers=2)
    ids = torch.randint(0, 96, (1, 10))
    ref = fxbudget.compile(fresh(model), rule="snapkv", budget=6, backend=None)
    ref_cache, cache = ref.forward.new_cache(), fxbudget.BudgetCache(model.config, 6)
    model.set_attn_implementation("fxbudget_sdpa")
    compiled = torch.compile(model, backend="fxbudget", fullgraph=True, options={"inner": "aot_eager"})
    with torch.no_grad():
        expected = ref(input_ids=ids, past_key_values=ref_cache).logits
        got = compiled(input_ids=ids, past_key_values=cache, use_cache=True).logits
    assert (got - expected).abs().max().item() <= 1e-4
    assert all(torch.equal(cache.positions(i), ref_cache.positions(i)) for i in range(2))


class _TwoLayers(torch.nn.Module):
    """Two attention layers over one BudgetCache; the second reads its keys through `op` (e.g. `.clone()`)."""

    def __init__(self, op: str):
        super().__init__()
        torch.manual_seed(0)
        self.config, self.op = None, op
        self.emb = torch.nn.Embedding(16, 8)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(8, 16, bias=False) for _ in range(2))

    def forward(self, input_ids, past_key_values=None, use_cache=True, **kwargs):
        x = self.emb(input_ids)
        b, n, _ = x.shape
        for i, proj in enumerate(self.qkv):
            q, k, v = proj(x).view(b, n, 4, 4).transpose(1, 2).split([2, 1, 1], dim=1)
            k, v = past_key_values.update(k, v, i)
            if i == 1:
                k = getattr(k, self.op)()
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + y.transpose(1, 2).reshape(b, n, 8)
        return Output(x, past_key_values)


@pytest.mark.parametrize("op", ["clone", "float"])
@pytest.mark.parametrize("backend", [None, "eager", "aot_eager"])
def test_attention_through_an_unfollowed_op_is_refused(backend, op):
    """A layer whose keys reach SDPA through an op the pass does not walk (`.clone()`, `.float()`) is refused, naming
    the layer and the op, on every path: before, the compiled paths rewrote layer 0, left layer 1's SDPA over the
    raw slots with a warning, and ran."""
    m = fxbudget.compile(_TwoLayers(op), rule="h2o", budget=16, backend=backend)
    cache = fxbudget.BudgetCache(SimpleNamespace(**{**vars(CONFIG), "num_hidden_layers": 2}), 16)
    with torch.no_grad(), pytest.raises(fxbudget.NoBudgetAttentionError, match=rf"layer 1: .*keys through `{op}`"):
        m(input_ids=_ids(10), past_key_values=cache)
