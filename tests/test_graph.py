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


def test_fingerprint_equal_across_rules():
    model = tiny_model("qwen2", layers=1)
    ids = torch.randint(0, 96, (1, 12))
    prints = {rule: fxbudget.kernel_fingerprint(model, ids, rule=rule, budget=8) for rule in fxbudget.rules.available()}
    assert len(set(prints.values())) == 1, prints
    # The hash does see the kernel: another budget or observation window gives another graph.
    assert fxbudget.kernel_fingerprint(model, ids, rule="knorm", budget=9) != prints["knorm"]
    assert fxbudget.kernel_fingerprint(model, ids, rule="snapkv", budget=8, window=4) != prints["snapkv"]


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
def forward(self, L_self_modules_emb_parameters_weight_ : torch.nn.parameter.Parameter, L_input_ids_ : torch.Tensor, L_self_modules_q_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_k_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_v_parameters_weight_ : torch.nn.parameter.Parameter, L_past_key_values_layers_0_seen : torch.Tensor, L_past_key_values_layers_0_keys : torch.Tensor, L_past_key_values_layers_0_values : torch.Tensor, L_past_key_values_layers_0_pos : torch.Tensor, L_past_key_values_layers_0_state : torch.Tensor, L_past_key_values_layers_0_totals : torch.Tensor, L_past_key_values_layers_0_limit : torch.Tensor, L_self_modules_out_parameters_weight_ : torch.nn.parameter.Parameter):
    l_self_modules_emb_parameters_weight_ = L_self_modules_emb_parameters_weight_
    l_input_ids_ = L_input_ids_
    l_self_modules_q_parameters_weight_ = L_self_modules_q_parameters_weight_
    l_self_modules_k_parameters_weight_ = L_self_modules_k_parameters_weight_
    l_self_modules_v_parameters_weight_ = L_self_modules_v_parameters_weight_
    l_past_key_values_layers_0_seen = L_past_key_values_layers_0_seen
    l_past_key_values_layers_0_keys = L_past_key_values_layers_0_keys
    l_past_key_values_layers_0_values = L_past_key_values_layers_0_values
    l_past_key_values_layers_0_pos = L_past_key_values_layers_0_pos
    l_past_key_values_layers_0_state = L_past_key_values_layers_0_state
    l_past_key_values_layers_0_totals = L_past_key_values_layers_0_totals
    l_past_key_values_layers_0_limit = L_past_key_values_layers_0_limit
    l_self_modules_out_parameters_weight_ = L_self_modules_out_parameters_weight_
    x = torch.nn.functional.embedding(l_input_ids_, l_self_modules_emb_parameters_weight_, None, None, 2.0, False, False);  l_input_ids_ = l_self_modules_emb_parameters_weight_ = None
    linear = torch._C._nn.linear(x, l_self_modules_q_parameters_weight_, None);  l_self_modules_q_parameters_weight_ = None
    view = linear.view(1, 3, 2, 4);  linear = None
    q = view.transpose(1, 2);  view = None
    linear_1 = torch._C._nn.linear(x, l_self_modules_k_parameters_weight_, None);  l_self_modules_k_parameters_weight_ = None
    view_1 = linear_1.view(1, 3, 1, 4);  linear_1 = None
    k = view_1.transpose(1, 2);  view_1 = None
    linear_2 = torch._C._nn.linear(x, l_self_modules_v_parameters_weight_, None);  x = l_self_modules_v_parameters_weight_ = None
    view_2 = linear_2.view(1, 3, 1, 4);  linear_2 = None
    v = view_2.transpose(1, 2);  view_2 = None
    arange = torch.arange(3, device = device(type='cpu'))
    new_pos = arange + l_past_key_values_layers_0_seen;  arange = None
    add_ = l_past_key_values_layers_0_seen.add_(3);  l_past_key_values_layers_0_seen = add_ = None
    view_3 = torch.ops.aten.view.default(new_pos, [1, 1, 3])
    expand = torch.ops.aten.expand.default(view_3, [1, 1, 3]);  view_3 = None
    cat = torch.ops.aten.cat.default([l_past_key_values_layers_0_pos, expand], 2);  expand = None
    clone = torch.ops.aten.clone.default(q, memory_format = torch.contiguous_format);  q = None
    _unsafe_view = torch.ops.aten._unsafe_view.default(clone, [1, 1, 6, 4]);  clone = None
    repeat = torch.ops.aten.repeat.default(new_pos, [2]);  new_pos = None
    view_4 = torch.ops.aten.view.default(repeat, [1, 1, 6, 1]);  repeat = None
    unsqueeze = torch.ops.aten.unsqueeze.default(cat, 2)
    ge = torch.ops.aten.ge.Scalar(unsqueeze, 0)
    le = torch.ops.aten.le.Tensor(unsqueeze, view_4);  unsqueeze = view_4 = None
    bitwise_and = torch.ops.aten.bitwise_and.Tensor(ge, le);  ge = le = None
    transpose_4 = torch.ops.aten.transpose.int(l_past_key_values_layers_0_keys, -1, -2)
    expand_1 = torch.ops.aten.expand.default(_unsafe_view, [1, 1, 6, 4])
    view_5 = torch.ops.aten.view.default(expand_1, [1, 6, 4]);  expand_1 = None
    expand_2 = torch.ops.aten.expand.default(transpose_4, [1, 1, 4, 4]);  transpose_4 = None
    view_6 = torch.ops.aten.view.default(expand_2, [1, 4, 4]);  expand_2 = None
    bmm = torch.ops.aten.bmm.default(view_5, view_6);  view_5 = view_6 = None
    _unsafe_view_1 = torch.ops.aten._unsafe_view.default(bmm, [1, 1, 6, 4]);  bmm = None
    transpose_5 = torch.ops.aten.transpose.int(k, -1, -2)
    expand_3 = torch.ops.aten.expand.default(_unsafe_view, [1, 1, 6, 4]);  _unsafe_view = None
    view_7 = torch.ops.aten.view.default(expand_3, [1, 6, 4]);  expand_3 = None
    expand_4 = torch.ops.aten.expand.default(transpose_5, [1, 1, 4, 3]);  transpose_5 = None
    view_8 = torch.ops.aten.view.default(expand_4, [1, 4, 3]);  expand_4 = None
    bmm_1 = torch.ops.aten.bmm.default(view_7, view_8);  view_7 = view_8 = None
    _unsafe_view_2 = torch.ops.aten._unsafe_view.default(bmm_1, [1, 1, 6, 3]);  bmm_1 = None
    cat_1 = torch.ops.aten.cat.default([_unsafe_view_1, _unsafe_view_2], -1);  _unsafe_view_1 = _unsafe_view_2 = None
    mul = torch.ops.aten.mul.Tensor(cat_1, 0.5);  cat_1 = None
    bitwise_not = torch.ops.aten.bitwise_not.default(bitwise_and)
    masked_fill = torch.ops.aten.masked_fill.Scalar(mul, bitwise_not, -inf);  mul = bitwise_not = None
    _softmax = torch.ops.aten._softmax.default(masked_fill, -1, False);  masked_fill = None
    any_1 = torch.ops.aten.any.dim(bitwise_and, -1, True);  bitwise_and = None
    bitwise_not_1 = torch.ops.aten.bitwise_not.default(any_1);  any_1 = None
    masked_fill_1 = torch.ops.aten.masked_fill.Scalar(_softmax, bitwise_not_1, 0.0);  _softmax = bitwise_not_1 = None
    slice_1 = torch.ops.aten.slice.Tensor(masked_fill_1, 3, 0, 4)
    expand_5 = torch.ops.aten.expand.default(slice_1, [1, 1, 6, 4]);  slice_1 = None
    view_9 = torch.ops.aten.view.default(expand_5, [1, 6, 4]);  expand_5 = None
    expand_6 = torch.ops.aten.expand.default(l_past_key_values_layers_0_values, [1, 1, 4, 4])
    view_10 = torch.ops.aten.view.default(expand_6, [1, 4, 4]);  expand_6 = None
    bmm_2 = torch.ops.aten.bmm.default(view_9, view_10);  view_9 = view_10 = None
    _unsafe_view_3 = torch.ops.aten._unsafe_view.default(bmm_2, [1, 1, 6, 4]);  bmm_2 = None
    slice_2 = torch.ops.aten.slice.Tensor(masked_fill_1, 3, 4, 9223372036854775807)
    expand_7 = torch.ops.aten.expand.default(slice_2, [1, 1, 6, 3]);  slice_2 = None
    view_11 = torch.ops.aten.view.default(expand_7, [1, 6, 3]);  expand_7 = None
    expand_8 = torch.ops.aten.expand.default(v, [1, 1, 3, 4])
    view_12 = torch.ops.aten.view.default(expand_8, [1, 3, 4]);  expand_8 = None
    bmm_3 = torch.ops.aten.bmm.default(view_11, view_12);  view_11 = view_12 = None
    _unsafe_view_4 = torch.ops.aten._unsafe_view.default(bmm_3, [1, 1, 6, 4]);  bmm_3 = None
    add_1 = torch.ops.aten.add.Tensor(_unsafe_view_3, _unsafe_view_4);  _unsafe_view_3 = _unsafe_view_4 = None
    view_13 = torch.ops.aten.view.default(add_1, [1, 1, 2, 3, -1]);  add_1 = None
    view_14 = torch.ops.aten.view.default(view_13, [1, 2, 3, -1]);  view_13 = None
    view_15 = torch.ops.aten.view.default(masked_fill_1, [1, 1, 2, 3, 7]);  masked_fill_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(view_15, [2, 3])
    alias = torch.ops.aten.alias.default(view_15)
    sum_2 = torch.ops.aten.sum.dim_IntList(alias, [2, 3]);  alias = None
    select = torch.ops.aten.select.int(view_15, 3, 2);  view_15 = None
    sum_3 = torch.ops.aten.sum.dim_IntList(select, [2]);  select = None
    new_zeros = torch.ops.aten.new_zeros.default(l_past_key_values_layers_0_state, [1, 1, 3], pin_memory = False)
    cat_2 = torch.ops.aten.cat.default([l_past_key_values_layers_0_state, new_zeros], 2);  new_zeros = None
    add_2 = torch.ops.aten.add.Tensor(cat_2, sum_1);  cat_2 = None
    linalg_vector_norm = torch.ops.aten.linalg_vector_norm.default(l_past_key_values_layers_0_keys, 2, [-1], dtype = torch.float32)
    linalg_vector_norm_1 = torch.ops.aten.linalg_vector_norm.default(k, 2, [-1], dtype = torch.float32)
    cat_3 = torch.ops.aten.cat.default([linalg_vector_norm, linalg_vector_norm_1], -1);  linalg_vector_norm = linalg_vector_norm_1 = None
    linalg_vector_norm_2 = torch.ops.aten.linalg_vector_norm.default(l_past_key_values_layers_0_values, 2, [-1], dtype = torch.float32)
    linalg_vector_norm_3 = torch.ops.aten.linalg_vector_norm.default(v, 2, [-1], dtype = torch.float32)
    cat_4 = torch.ops.aten.cat.default([linalg_vector_norm_2, linalg_vector_norm_3], -1);  linalg_vector_norm_2 = linalg_vector_norm_3 = None
    sort = torch.ops.aten.sort.stable(cat, stable = True)
    getitem_3 = sort[1];  sort = None
    sum_4 = torch.ops.aten.sum.dim_IntList(sum_1, [-1]);  sum_1 = None
    sum_5 = torch.ops.aten.sum.dim_IntList(sum_2, [-1]);  sum_2 = None
    sum_6 = torch.ops.aten.sum.dim_IntList(sum_3, [-1]);  sum_3 = None
    sum_7 = torch.ops.aten.sum.dim_IntList(add_2, [-1])
    sum_8 = torch.ops.aten.sum.dim_IntList(cat_3, [-1])
    sum_9 = torch.ops.aten.sum.dim_IntList(cat_4, [-1]);  cat_4 = None
    _to_copy = torch.ops.aten._to_copy.default(cat, dtype = torch.float32)
    sum_10 = torch.ops.aten.sum.dim_IntList(_to_copy, [-1]);  _to_copy = None
    _to_copy_1 = torch.ops.aten._to_copy.default(getitem_3, dtype = torch.float32);  getitem_3 = None
    sum_11 = torch.ops.aten.sum.dim_IntList(_to_copy_1, [-1]);  _to_copy_1 = None
    stack = torch.ops.aten.stack.default([sum_4, sum_5, sum_6, sum_7, sum_8, sum_9, sum_10, sum_11], -1);  sum_4 = sum_5 = sum_6 = sum_7 = sum_8 = sum_9 = sum_10 = sum_11 = None
    neg = torch.ops.aten.neg.default(cat_3);  cat_3 = None
    lt = torch.ops.aten.lt.Scalar(cat, 0)
    masked_fill_2 = torch.ops.aten.masked_fill.Scalar(neg, lt, -inf);  neg = lt = None
    ge_1 = torch.ops.aten.ge.Scalar(cat, 0)
    sort_1 = torch.ops.aten.sort.stable(cat, stable = True, descending = True)
    getitem_5 = sort_1[1];  sort_1 = None
    gather = torch.ops.aten.gather.default(masked_fill_2, -1, getitem_5);  masked_fill_2 = None
    sort_2 = torch.ops.aten.sort.stable(gather, stable = True, descending = True);  gather = None
    getitem_7 = sort_2[1];  sort_2 = None
    empty_like = torch.ops.aten.empty_like.default(getitem_7, pin_memory = False)
    gather_1 = torch.ops.aten.gather.default(getitem_5, -1, getitem_7);  getitem_5 = getitem_7 = None
    arange_1 = torch.ops.aten.arange.default(7, device = device(type='cpu'), pin_memory = False)
    expand_9 = torch.ops.aten.expand.default(arange_1, [1, 1, 7]);  arange_1 = None
    scatter = torch.ops.aten.scatter.src(empty_like, -1, gather_1, expand_9);  empty_like = gather_1 = expand_9 = None
    lt_1 = torch.ops.aten.lt.Tensor(scatter, l_past_key_values_layers_0_limit);  scatter = l_past_key_values_layers_0_limit = None
    bitwise_and_1 = torch.ops.aten.bitwise_and.Tensor(lt_1, ge_1);  lt_1 = ge_1 = None
    slice_3 = torch.ops.aten.slice.Tensor(bitwise_and_1, 2, 0, 4)
    slice_4 = torch.ops.aten.slice.Tensor(bitwise_and_1, 2, 4, 9223372036854775807);  bitwise_and_1 = None
    _to_copy_2 = torch.ops.aten._to_copy.default(slice_3, dtype = torch.int8)
    sort_3 = torch.ops.aten.sort.stable(_to_copy_2, stable = True);  _to_copy_2 = None
    getitem_9 = sort_3[1];  sort_3 = None
    slice_5 = torch.ops.aten.slice.Tensor(getitem_9, 2, 0, 3);  getitem_9 = None
    bitwise_not_2 = torch.ops.aten.bitwise_not.default(slice_4)
    _to_copy_3 = torch.ops.aten._to_copy.default(bitwise_not_2, dtype = torch.int8);  bitwise_not_2 = None
    sort_4 = torch.ops.aten.sort.stable(_to_copy_3, stable = True);  _to_copy_3 = None
    getitem_11 = sort_4[1];  sort_4 = None
    alias_1 = torch.ops.aten.alias.default(getitem_11);  getitem_11 = None
    arange_2 = torch.ops.aten.arange.default(3, device = device(type='cpu'), pin_memory = False)
    sum_12 = torch.ops.aten.sum.dim_IntList(slice_4, [-1], True);  slice_4 = None
    lt_2 = torch.ops.aten.lt.Tensor(arange_2, sum_12);  arange_2 = sum_12 = None
    arange_3 = torch.ops.aten.arange.default(1, device = device(type='cpu'), pin_memory = False)
    view_16 = torch.ops.aten.view.default(arange_3, [1, 1, 1]);  arange_3 = None
    arange_4 = torch.ops.aten.arange.default(1, device = device(type='cpu'), pin_memory = False)
    view_17 = torch.ops.aten.view.default(arange_4, [1, 1, 1]);  arange_4 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(lt_2, -1)
    index = torch.ops.aten.index.Tensor(k, [view_16, view_17, alias_1]);  k = None
    index_1 = torch.ops.aten.index.Tensor(l_past_key_values_layers_0_keys, [view_16, view_17, slice_5])
    where = torch.ops.aten.where.self(unsqueeze_1, index, index_1);  unsqueeze_1 = index = index_1 = None
    index_put_ = torch.ops.aten.index_put_.default(l_past_key_values_layers_0_keys, [view_16, view_17, slice_5], where);  l_past_key_values_layers_0_keys = where = index_put_ = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(lt_2, -1)
    index_2 = torch.ops.aten.index.Tensor(v, [view_16, view_17, alias_1]);  v = None
    index_3 = torch.ops.aten.index.Tensor(l_past_key_values_layers_0_values, [view_16, view_17, slice_5])
    where_1 = torch.ops.aten.where.self(unsqueeze_2, index_2, index_3);  unsqueeze_2 = index_2 = index_3 = None
    index_put__1 = torch.ops.aten.index_put_.default(l_past_key_values_layers_0_values, [view_16, view_17, slice_5], where_1);  l_past_key_values_layers_0_values = view_16 = view_17 = where_1 = index_put__1 = None
    bitwise_not_3 = torch.ops.aten.bitwise_not.default(slice_3)
    masked_fill_3 = torch.ops.aten.masked_fill.Scalar(l_past_key_values_layers_0_pos, bitwise_not_3, -1);  bitwise_not_3 = None
    slice_6 = torch.ops.aten.slice.Tensor(cat, 2, 4, 9223372036854775807);  cat = None
    gather_2 = torch.ops.aten.gather.default(slice_6, -1, alias_1);  slice_6 = None
    gather_3 = torch.ops.aten.gather.default(masked_fill_3, -1, slice_5)
    where_2 = torch.ops.aten.where.self(lt_2, gather_2, gather_3);  gather_2 = gather_3 = None
    scatter_1 = torch.ops.aten.scatter.src(masked_fill_3, -1, slice_5, where_2);  masked_fill_3 = where_2 = None
    copy_ = torch.ops.aten.copy_.default(l_past_key_values_layers_0_pos, scatter_1);  l_past_key_values_layers_0_pos = scatter_1 = copy_ = None
    slice_7 = torch.ops.aten.slice.Tensor(add_2, 2, 0, 4)
    bitwise_not_4 = torch.ops.aten.bitwise_not.default(slice_3);  slice_3 = None
    masked_fill_4 = torch.ops.aten.masked_fill.Scalar(slice_7, bitwise_not_4, 0.0);  slice_7 = bitwise_not_4 = None
    slice_8 = torch.ops.aten.slice.Tensor(add_2, 2, 4, 9223372036854775807);  add_2 = None
    gather_4 = torch.ops.aten.gather.default(slice_8, -1, alias_1);  slice_8 = alias_1 = None
    gather_5 = torch.ops.aten.gather.default(masked_fill_4, -1, slice_5)
    where_3 = torch.ops.aten.where.self(lt_2, gather_4, gather_5);  lt_2 = gather_4 = gather_5 = None
    scatter_2 = torch.ops.aten.scatter.src(masked_fill_4, -1, slice_5, where_3);  masked_fill_4 = slice_5 = where_3 = None
    copy__1 = torch.ops.aten.copy_.default(l_past_key_values_layers_0_state, scatter_2);  l_past_key_values_layers_0_state = scatter_2 = copy__1 = None
    copy__2 = torch.ops.aten.copy_.default(l_past_key_values_layers_0_totals, stack);  l_past_key_values_layers_0_totals = stack = copy__2 = None
    transpose_3 = view_14.transpose(1, 2);  view_14 = None
    reshape = transpose_3.reshape(1, 3, 8);  transpose_3 = None
    linear_3 = torch._C._nn.linear(reshape, l_self_modules_out_parameters_weight_, None);  reshape = l_self_modules_out_parameters_weight_ = None
    return (linear_3,)""")
