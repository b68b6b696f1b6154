"""The rewritten graphs: one shared kernel for every rule, what is rewritten and what is left alone."""

import logging

import pytest
import torch
from expecttest import assert_expected_inline

import fxbudget
from conftest import tiny_model
from tiny_attention import CONFIG, OneLayer


def _ids(n=6):
    return torch.arange(n).view(1, n) % 16


def test_fingerprint_equal_across_rules(monkeypatch):
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (1, 12))
    prints = {rule: fxbudget.kernel_fingerprint(model, ids, rule=rule, budget=40)
              for rule in fxbudget.rules.available()}  # pyramidkv's two layers hold 62 and 18 slots
    assert len(set(prints.values())) == 1, prints
    # The hash does see the kernel: a change to the shared measure phase changes it.
    from fxbudget.passes import sdpa

    original = sdpa.measure

    def measure_variant(*args, **kwargs):
        out, *rest = original(*args, **kwargs)
        return (out * 1.0, *rest)

    monkeypatch.setattr(sdpa, "measure", measure_variant)
    assert fxbudget.kernel_fingerprint(model, ids, rule="knorm", budget=40) != prints["knorm"]


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
def forward(self, L_forward_self_modules_emb_parameters_weight_ : torch.nn.parameter.Parameter, L_kwargs_input_ids_ : torch.Tensor, L_forward_self_modules_q_parameters_weight_ : torch.nn.parameter.Parameter, L_forward_self_modules_k_parameters_weight_ : torch.nn.parameter.Parameter, L_forward_self_modules_v_parameters_weight_ : torch.nn.parameter.Parameter, L_kwargs_past_key_values_layers_0_seen : torch.Tensor, L_kwargs_past_key_values_layers_0_keys : torch.Tensor, L_kwargs_past_key_values_layers_0_values : torch.Tensor, L_kwargs_past_key_values_layers_0_pos : torch.Tensor, L_kwargs_past_key_values_layers_0_state : torch.Tensor, L_kwargs_past_key_values_layers_0_norms : torch.Tensor, L_kwargs_past_key_values_layers_0_totals : torch.Tensor, L_kwargs_past_key_values_layers_0_inv_freq : torch.Tensor, L_forward_self_modules_out_parameters_weight_ : torch.nn.parameter.Parameter):
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
    l_kwargs_past_key_values_layers_0_inv_freq = L_kwargs_past_key_values_layers_0_inv_freq
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
    new_pos = arange + l_kwargs_past_key_values_layers_0_seen;  arange = None
    add_ = l_kwargs_past_key_values_layers_0_seen.add_(3);  l_kwargs_past_key_values_layers_0_seen = add_ = None
    view_3 = torch.ops.aten.view.default(new_pos, [1, 1, 3])
    expand = torch.ops.aten.expand.default(view_3, [1, 1, 3]);  view_3 = None
    cat = torch.ops.aten.cat.default([l_kwargs_past_key_values_layers_0_pos, expand], 2);  expand = None
    clone = torch.ops.aten.clone.default(q, memory_format = torch.contiguous_format);  q = None
    _unsafe_view = torch.ops.aten._unsafe_view.default(clone, [1, 1, 6, 4]);  clone = None
    _to_copy = torch.ops.aten._to_copy.default(new_pos, dtype = torch.int32)
    repeat = torch.ops.aten.repeat.default(_to_copy, [2]);  _to_copy = None
    view_4 = torch.ops.aten.view.default(repeat, [1, 1, 6, 1]);  repeat = None
    _to_copy_1 = torch.ops.aten._to_copy.default(l_kwargs_past_key_values_layers_0_pos, dtype = torch.int32)
    unsqueeze = torch.ops.aten.unsqueeze.default(_to_copy_1, 2);  _to_copy_1 = None
    _to_copy_2 = torch.ops.aten._to_copy.default(new_pos, dtype = torch.int32);  new_pos = None
    view_5 = torch.ops.aten.view.default(_to_copy_2, [1, 1, 1, 3]);  _to_copy_2 = None
    ge = torch.ops.aten.ge.Scalar(unsqueeze, 0)
    le = torch.ops.aten.le.Tensor(unsqueeze, view_4);  unsqueeze = None
    bitwise_and = torch.ops.aten.bitwise_and.Tensor(ge, le);  ge = le = None
    ge_1 = torch.ops.aten.ge.Scalar(view_5, 0)
    le_1 = torch.ops.aten.le.Tensor(view_5, view_4);  view_5 = view_4 = None
    bitwise_and_1 = torch.ops.aten.bitwise_and.Tensor(ge_1, le_1);  ge_1 = le_1 = None
    transpose_4 = torch.ops.aten.transpose.int(l_kwargs_past_key_values_layers_0_keys, -1, -2)
    expand_1 = torch.ops.aten.expand.default(_unsafe_view, [1, 1, 6, 4])
    view_6 = torch.ops.aten.view.default(expand_1, [1, 6, 4]);  expand_1 = None
    expand_2 = torch.ops.aten.expand.default(transpose_4, [1, 1, 4, 4]);  transpose_4 = None
    view_7 = torch.ops.aten.view.default(expand_2, [1, 4, 4]);  expand_2 = None
    bmm = torch.ops.aten.bmm.default(view_6, view_7);  view_6 = view_7 = None
    _unsafe_view_1 = torch.ops.aten._unsafe_view.default(bmm, [1, 1, 6, 4]);  bmm = None
    mul = torch.ops.aten.mul.Tensor(_unsafe_view_1, 0.5);  _unsafe_view_1 = None
    bitwise_not = torch.ops.aten.bitwise_not.default(bitwise_and);  bitwise_and = None
    masked_fill = torch.ops.aten.masked_fill.Scalar(mul, bitwise_not, -inf);  mul = bitwise_not = None
    transpose_5 = torch.ops.aten.transpose.int(k, -1, -2)
    expand_3 = torch.ops.aten.expand.default(_unsafe_view, [1, 1, 6, 4]);  _unsafe_view = None
    view_8 = torch.ops.aten.view.default(expand_3, [1, 6, 4]);  expand_3 = None
    expand_4 = torch.ops.aten.expand.default(transpose_5, [1, 1, 4, 3]);  transpose_5 = None
    view_9 = torch.ops.aten.view.default(expand_4, [1, 4, 3]);  expand_4 = None
    bmm_1 = torch.ops.aten.bmm.default(view_8, view_9);  view_8 = view_9 = None
    _unsafe_view_2 = torch.ops.aten._unsafe_view.default(bmm_1, [1, 1, 6, 3]);  bmm_1 = None
    mul_1 = torch.ops.aten.mul.Tensor(_unsafe_view_2, 0.5);  _unsafe_view_2 = None
    bitwise_not_1 = torch.ops.aten.bitwise_not.default(bitwise_and_1);  bitwise_and_1 = None
    masked_fill_1 = torch.ops.aten.masked_fill.Scalar(mul_1, bitwise_not_1, -inf);  mul_1 = bitwise_not_1 = None
    amax = torch.ops.aten.amax.default(masked_fill, [-1], True)
    amax_1 = torch.ops.aten.amax.default(masked_fill_1, [-1], True)
    maximum = torch.ops.aten.maximum.default(amax, amax_1);  amax = amax_1 = None
    eq = torch.ops.aten.eq.Scalar(maximum, -inf)
    masked_fill_2 = torch.ops.aten.masked_fill.Scalar(maximum, eq, 0.0);  maximum = eq = None
    sub = torch.ops.aten.sub.Tensor(masked_fill, masked_fill_2);  masked_fill = None
    exp = torch.ops.aten.exp.default(sub);  sub = None
    sub_1 = torch.ops.aten.sub.Tensor(masked_fill_1, masked_fill_2);  masked_fill_1 = masked_fill_2 = None
    exp_1 = torch.ops.aten.exp.default(sub_1);  sub_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(exp, [-1], True)
    sum_2 = torch.ops.aten.sum.dim_IntList(exp_1, [-1], True)
    add_1 = torch.ops.aten.add.Tensor(sum_1, sum_2);  sum_1 = sum_2 = None
    eq_1 = torch.ops.aten.eq.Scalar(add_1, 0)
    masked_fill_3 = torch.ops.aten.masked_fill.Scalar(add_1, eq_1, 1.0);  add_1 = eq_1 = None
    div = torch.ops.aten.div.Tensor(exp, masked_fill_3);  exp = None
    div_1 = torch.ops.aten.div.Tensor(exp_1, masked_fill_3);  exp_1 = masked_fill_3 = None
    expand_5 = torch.ops.aten.expand.default(div, [1, 1, 6, 4])
    view_10 = torch.ops.aten.view.default(expand_5, [1, 6, 4]);  expand_5 = None
    expand_6 = torch.ops.aten.expand.default(l_kwargs_past_key_values_layers_0_values, [1, 1, 4, 4])
    view_11 = torch.ops.aten.view.default(expand_6, [1, 4, 4]);  expand_6 = None
    bmm_2 = torch.ops.aten.bmm.default(view_10, view_11);  view_10 = view_11 = None
    _unsafe_view_3 = torch.ops.aten._unsafe_view.default(bmm_2, [1, 1, 6, 4]);  bmm_2 = None
    expand_7 = torch.ops.aten.expand.default(div_1, [1, 1, 6, 3])
    view_12 = torch.ops.aten.view.default(expand_7, [1, 6, 3]);  expand_7 = None
    expand_8 = torch.ops.aten.expand.default(v, [1, 1, 3, 4])
    view_13 = torch.ops.aten.view.default(expand_8, [1, 3, 4]);  expand_8 = None
    bmm_3 = torch.ops.aten.bmm.default(view_12, view_13);  view_12 = view_13 = None
    _unsafe_view_4 = torch.ops.aten._unsafe_view.default(bmm_3, [1, 1, 6, 4]);  bmm_3 = None
    add_2 = torch.ops.aten.add.Tensor(_unsafe_view_3, _unsafe_view_4);  _unsafe_view_3 = _unsafe_view_4 = None
    view_14 = torch.ops.aten.view.default(add_2, [1, 1, 2, 3, -1]);  add_2 = None
    view_15 = torch.ops.aten.view.default(view_14, [1, 2, 3, -1]);  view_14 = None
    view_16 = torch.ops.aten.view.default(div, [1, 1, 2, 3, 4])
    sum_3 = torch.ops.aten.sum.dim_IntList(view_16, [2, 3]);  view_16 = None
    view_17 = torch.ops.aten.view.default(div_1, [1, 1, 2, 3, 3])
    sum_4 = torch.ops.aten.sum.dim_IntList(view_17, [2, 3]);  view_17 = None
    cat_1 = torch.ops.aten.cat.default([sum_3, sum_4], -1);  sum_3 = sum_4 = None
    view_18 = torch.ops.aten.view.default(div, [1, 1, 2, 3, 4])
    alias = torch.ops.aten.alias.default(view_18);  view_18 = None
    sum_5 = torch.ops.aten.sum.dim_IntList(alias, [2, 3]);  alias = None
    view_19 = torch.ops.aten.view.default(div_1, [1, 1, 2, 3, 3])
    alias_1 = torch.ops.aten.alias.default(view_19);  view_19 = None
    sum_6 = torch.ops.aten.sum.dim_IntList(alias_1, [2, 3]);  alias_1 = None
    cat_2 = torch.ops.aten.cat.default([sum_5, sum_6], -1);  sum_5 = sum_6 = None
    view_20 = torch.ops.aten.view.default(div, [1, 1, 2, 3, 4]);  div = None
    select = torch.ops.aten.select.int(view_20, 3, 2);  view_20 = None
    sum_7 = torch.ops.aten.sum.dim_IntList(select, [2]);  select = None
    view_21 = torch.ops.aten.view.default(div_1, [1, 1, 2, 3, 3]);  div_1 = None
    select_1 = torch.ops.aten.select.int(view_21, 3, 2);  view_21 = None
    sum_8 = torch.ops.aten.sum.dim_IntList(select_1, [2]);  select_1 = None
    cat_3 = torch.ops.aten.cat.default([sum_7, sum_8], -1);  sum_7 = sum_8 = None
    new_zeros = torch.ops.aten.new_zeros.default(l_kwargs_past_key_values_layers_0_state, [1, 1, 3], pin_memory = False)
    cat_4 = torch.ops.aten.cat.default([l_kwargs_past_key_values_layers_0_state, new_zeros], 2);  new_zeros = None
    add_3 = torch.ops.aten.add.Tensor(cat_4, cat_1);  cat_4 = None
    select_2 = torch.ops.aten.select.int(l_kwargs_past_key_values_layers_0_norms, 3, 0)
    linalg_vector_norm = torch.ops.aten.linalg_vector_norm.default(k, 2, [-1], dtype = torch.float32)
    cat_5 = torch.ops.aten.cat.default([select_2, linalg_vector_norm], -1);  select_2 = linalg_vector_norm = None
    select_3 = torch.ops.aten.select.int(l_kwargs_past_key_values_layers_0_norms, 3, 1)
    linalg_vector_norm_1 = torch.ops.aten.linalg_vector_norm.default(v, 2, [-1], dtype = torch.float32)
    cat_6 = torch.ops.aten.cat.default([select_3, linalg_vector_norm_1], -1);  select_3 = linalg_vector_norm_1 = None
    sum_9 = torch.ops.aten.sum.dim_IntList(cat_1, [-1]);  cat_1 = None
    sum_10 = torch.ops.aten.sum.dim_IntList(cat_2, [-1]);  cat_2 = None
    sum_11 = torch.ops.aten.sum.dim_IntList(cat_3, [-1]);  cat_3 = None
    sum_12 = torch.ops.aten.sum.dim_IntList(add_3, [-1])
    sum_13 = torch.ops.aten.sum.dim_IntList(cat_5, [-1])
    sum_14 = torch.ops.aten.sum.dim_IntList(cat_6, [-1])
    _to_copy_3 = torch.ops.aten._to_copy.default(cat, dtype = torch.float32)
    sum_15 = torch.ops.aten.sum.dim_IntList(_to_copy_3, [-1]);  _to_copy_3 = None
    stack = torch.ops.aten.stack.default([sum_9, sum_10, sum_11, sum_12, sum_13, sum_14, sum_15], -1);  sum_9 = sum_10 = sum_11 = sum_12 = sum_13 = sum_14 = sum_15 = None
    neg = torch.ops.aten.neg.default(cat_5)
    lt = torch.ops.aten.lt.Scalar(cat, 0)
    masked_fill_4 = torch.ops.aten.masked_fill.Scalar(neg, lt, -inf);  neg = lt = None
    view_22 = torch.ops.aten.view.dtype(masked_fill_4, torch.int32);  masked_fill_4 = None
    detach = torch.ops.aten.detach.default(view_22);  view_22 = None
    ge_2 = torch.ops.aten.ge.Scalar(detach, 0)
    bitwise_xor = torch.ops.aten.bitwise_xor.Scalar(detach, 2147483647)
    where = torch.ops.aten.where.self(ge_2, detach, bitwise_xor);  ge_2 = detach = bitwise_xor = None
    _to_copy_4 = torch.ops.aten._to_copy.default(where, dtype = torch.int64);  where = None
    arange_1 = torch.ops.aten.arange.default(7, device = device(type='cpu'), pin_memory = False)
    ge_3 = torch.ops.aten.ge.Scalar(cat, 0)
    add_4 = torch.ops.aten.add.Tensor(cat, 7)
    where_1 = torch.ops.aten.where.self(ge_3, add_4, arange_1);  ge_3 = add_4 = None
    mul_2 = torch.ops.aten.mul.Tensor(_to_copy_4, 4294967296);  _to_copy_4 = None
    add_5 = torch.ops.aten.add.Tensor(mul_2, where_1);  mul_2 = where_1 = None
    topk = torch.ops.aten.topk.default(add_5, 3, -1, False);  add_5 = None
    getitem_3 = topk[1];  topk = None
    zeros_like = torch.ops.aten.zeros_like.default(cat, dtype = torch.bool, pin_memory = False)
    scatter = torch.ops.aten.scatter.value(zeros_like, -1, getitem_3, True);  zeros_like = getitem_3 = None
    slice_1 = torch.ops.aten.slice.Tensor(scatter, 2, 0, 4)
    slice_2 = torch.ops.aten.slice.Tensor(scatter, 2, 4, 9223372036854775807);  scatter = None
    bitwise_not_2 = torch.ops.aten.bitwise_not.default(slice_2);  slice_2 = None
    slice_3 = torch.ops.aten.slice.Tensor(arange_1, 0, 0, 4)
    rsub = torch.ops.aten.rsub.Scalar(slice_3, 4);  slice_3 = None
    scalar_tensor = torch.ops.aten.scalar_tensor.default(0, dtype = torch.int64, layout = torch.strided, device = device(type='cpu'))
    where_2 = torch.ops.aten.where.self(slice_1, rsub, scalar_tensor);  rsub = scalar_tensor = None
    topk_1 = torch.ops.aten.topk.default(where_2, 3);  where_2 = None
    getitem_5 = topk_1[1];  topk_1 = None
    slice_4 = torch.ops.aten.slice.Tensor(arange_1, 0, 0, 3);  arange_1 = None
    rsub_1 = torch.ops.aten.rsub.Scalar(slice_4, 3);  slice_4 = None
    scalar_tensor_1 = torch.ops.aten.scalar_tensor.default(0, dtype = torch.int64, layout = torch.strided, device = device(type='cpu'))
    where_3 = torch.ops.aten.where.self(bitwise_not_2, rsub_1, scalar_tensor_1);  rsub_1 = scalar_tensor_1 = None
    topk_2 = torch.ops.aten.topk.default(where_3, 3);  where_3 = None
    getitem_7 = topk_2[1];  topk_2 = None
    arange_2 = torch.ops.aten.arange.default(3, device = device(type='cpu'), pin_memory = False)
    sum_16 = torch.ops.aten.sum.dim_IntList(bitwise_not_2, [-1], True);  bitwise_not_2 = None
    lt_1 = torch.ops.aten.lt.Tensor(arange_2, sum_16);  arange_2 = sum_16 = None
    arange_3 = torch.ops.aten.arange.default(1, device = device(type='cpu'), pin_memory = False)
    view_23 = torch.ops.aten.view.default(arange_3, [1, 1, 1]);  arange_3 = None
    arange_4 = torch.ops.aten.arange.default(1, device = device(type='cpu'), pin_memory = False)
    view_24 = torch.ops.aten.view.default(arange_4, [1, 1, 1]);  arange_4 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(lt_1, -1)
    index = torch.ops.aten.index.Tensor(k, [view_23, view_24, getitem_7]);  k = None
    index_1 = torch.ops.aten.index.Tensor(l_kwargs_past_key_values_layers_0_keys, [view_23, view_24, getitem_5])
    where_4 = torch.ops.aten.where.self(unsqueeze_1, index, index_1);  unsqueeze_1 = index = index_1 = None
    index_put_ = torch.ops.aten.index_put_.default(l_kwargs_past_key_values_layers_0_keys, [view_23, view_24, getitem_5], where_4);  l_kwargs_past_key_values_layers_0_keys = where_4 = index_put_ = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(lt_1, -1)
    index_2 = torch.ops.aten.index.Tensor(v, [view_23, view_24, getitem_7]);  v = None
    index_3 = torch.ops.aten.index.Tensor(l_kwargs_past_key_values_layers_0_values, [view_23, view_24, getitem_5])
    where_5 = torch.ops.aten.where.self(unsqueeze_2, index_2, index_3);  unsqueeze_2 = index_2 = index_3 = None
    index_put__1 = torch.ops.aten.index_put_.default(l_kwargs_past_key_values_layers_0_values, [view_23, view_24, getitem_5], where_5);  l_kwargs_past_key_values_layers_0_values = view_23 = view_24 = where_5 = index_put__1 = None
    masked_fill_5 = torch.ops.aten.masked_fill.Scalar(l_kwargs_past_key_values_layers_0_pos, slice_1, -1)
    slice_5 = torch.ops.aten.slice.Tensor(cat, 2, 4, 9223372036854775807);  cat = None
    gather = torch.ops.aten.gather.default(slice_5, -1, getitem_7);  slice_5 = None
    gather_1 = torch.ops.aten.gather.default(masked_fill_5, -1, getitem_5)
    where_6 = torch.ops.aten.where.self(lt_1, gather, gather_1);  gather = gather_1 = None
    scatter_1 = torch.ops.aten.scatter.src(masked_fill_5, -1, getitem_5, where_6);  masked_fill_5 = where_6 = None
    copy_ = torch.ops.aten.copy_.default(l_kwargs_past_key_values_layers_0_pos, scatter_1);  l_kwargs_past_key_values_layers_0_pos = scatter_1 = copy_ = None
    slice_6 = torch.ops.aten.slice.Tensor(add_3, 2, 0, 4)
    masked_fill_6 = torch.ops.aten.masked_fill.Scalar(slice_6, slice_1, 0.0);  slice_6 = None
    slice_7 = torch.ops.aten.slice.Tensor(add_3, 2, 4, 9223372036854775807);  add_3 = None
    gather_2 = torch.ops.aten.gather.default(slice_7, -1, getitem_7);  slice_7 = None
    gather_3 = torch.ops.aten.gather.default(masked_fill_6, -1, getitem_5)
    where_7 = torch.ops.aten.where.self(lt_1, gather_2, gather_3);  gather_2 = gather_3 = None
    scatter_2 = torch.ops.aten.scatter.src(masked_fill_6, -1, getitem_5, where_7);  masked_fill_6 = where_7 = None
    copy__1 = torch.ops.aten.copy_.default(l_kwargs_past_key_values_layers_0_state, scatter_2);  l_kwargs_past_key_values_layers_0_state = scatter_2 = copy__1 = None
    slice_8 = torch.ops.aten.slice.Tensor(cat_5, 2, 0, 4)
    masked_fill_7 = torch.ops.aten.masked_fill.Scalar(slice_8, slice_1, 0.0);  slice_8 = None
    slice_9 = torch.ops.aten.slice.Tensor(cat_5, 2, 4, 9223372036854775807);  cat_5 = None
    gather_4 = torch.ops.aten.gather.default(slice_9, -1, getitem_7);  slice_9 = None
    gather_5 = torch.ops.aten.gather.default(masked_fill_7, -1, getitem_5)
    where_8 = torch.ops.aten.where.self(lt_1, gather_4, gather_5);  gather_4 = gather_5 = None
    scatter_3 = torch.ops.aten.scatter.src(masked_fill_7, -1, getitem_5, where_8);  masked_fill_7 = where_8 = None
    slice_10 = torch.ops.aten.slice.Tensor(cat_6, 2, 0, 4)
    masked_fill_8 = torch.ops.aten.masked_fill.Scalar(slice_10, slice_1, 0.0);  slice_10 = slice_1 = None
    slice_11 = torch.ops.aten.slice.Tensor(cat_6, 2, 4, 9223372036854775807);  cat_6 = None
    gather_6 = torch.ops.aten.gather.default(slice_11, -1, getitem_7);  slice_11 = getitem_7 = None
    gather_7 = torch.ops.aten.gather.default(masked_fill_8, -1, getitem_5)
    where_9 = torch.ops.aten.where.self(lt_1, gather_6, gather_7);  lt_1 = gather_6 = gather_7 = None
    scatter_4 = torch.ops.aten.scatter.src(masked_fill_8, -1, getitem_5, where_9);  masked_fill_8 = getitem_5 = where_9 = None
    stack_1 = torch.ops.aten.stack.default([scatter_3, scatter_4], -1);  scatter_3 = scatter_4 = None
    copy__2 = torch.ops.aten.copy_.default(l_kwargs_past_key_values_layers_0_norms, stack_1);  l_kwargs_past_key_values_layers_0_norms = stack_1 = copy__2 = None
    copy__3 = torch.ops.aten.copy_.default(l_kwargs_past_key_values_layers_0_totals, stack);  l_kwargs_past_key_values_layers_0_totals = stack = copy__3 = None
    transpose_3 = view_15.transpose(1, 2);  view_15 = None
    reshape = transpose_3.reshape(1, 3, 8);  transpose_3 = None
    linear_3 = torch._C._nn.linear(reshape, l_forward_self_modules_out_parameters_weight_, None);  reshape = l_forward_self_modules_out_parameters_weight_ = None
    return (linear_3,)""")


def _kernels(gm) -> int:
    """Budget kernels spliced into a graph: each writes keys and values back with one index_put_ apiece."""
    return sum(n.target is torch.ops.aten.index_put_.default for n in gm.graph.nodes) // 2


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


@pytest.mark.inductor
def test_torch_compile_with_the_registered_backend():
    # The whole-model path: `torch.compile(model, backend="fxbudget")` traces every layer into one graph.
    from conftest import fresh

    model = tiny_model("llama", layers=2)
    ids = torch.randint(0, 96, (1, 10))
    ref = fxbudget.compile(fresh(model), rule="snapkv", budget=6, backend=None)
    ref_cache, cache = ref.forward.new_cache(), fxbudget.BudgetCache(model.config, 6)
    compiled = torch.compile(model, backend="fxbudget", fullgraph=True)
    with torch.no_grad():
        expected = ref(input_ids=ids, past_key_values=ref_cache).logits
        got = compiled(input_ids=ids, past_key_values=cache, use_cache=True).logits
    assert (got - expected).abs().max().item() <= 1e-4
    assert all(torch.equal(cache.positions(i), ref_cache.positions(i)) for i in range(2))
