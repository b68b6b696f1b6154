"""The fingerprint's budget-int normalization (a second trace of each kernel at one more slot) is done for the graphs
`kernel_fingerprint` hashes and skipped for compiled forwards, whose graphs are the same and never hashed."""

import torch

import fxbudget
from conftest import fresh, tiny_model
from fxbudget.compiler.backend import make_backend
from fxbudget.cache.keyword import cache_kwargs
from fxbudget.fairness.fingerprint import _maskless_attention
from fxbudget.cache.for_model import model_cache
from fxbudget.passes import sdpa
from fxbudget.passes.sdpa import INTS_KEY, BudgetInt
from fxbudget.compiler.regions import whole_model_forward


def _counting_traces(monkeypatch) -> list[int]:
    """Calls of `sdpa._trace_phases`, by the slots they trace."""
    calls: list[int] = []
    real = sdpa._trace_phases

    def traced(fake, *args, **kwargs):
        calls.append(fake["keys"].shape[2])
        return real(fake, *args, **kwargs)

    monkeypatch.setattr(sdpa, "_trace_phases", traced)
    return calls


def _graphs(model, ids, budget_ints: bool):
    graphs = []
    backend = make_backend("snapkv", inner="eager", on_graph=graphs.append, budget_ints=budget_ints)
    cache = model_cache(model, backend.rule, 8, 1)
    with torch.no_grad(), _maskless_attention(model):  # as `captured_graphs` traces
        whole_model_forward(model.forward, backend)(input_ids=ids, use_cache=True,
                                                    **cache_kwargs(model.forward, cache))
    return graphs


def test_same_graphs_with_and_without_budget_ints(monkeypatch):
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    calls = _counting_traces(monkeypatch)
    marked = _graphs(model, ids, True)
    assert len(calls) == 2 and calls[1] == calls[0] + 1  # both layers share one trace, and its grown twin
    plain = _graphs(model, ids, False)
    assert len(calls) == 3  # one trace, no grown twin
    assert [g.code for g in plain] == [g.code for g in marked]
    ints = [v for g in marked for n in g.graph.nodes for v in n.meta.get(INTS_KEY, [])]
    assert any(isinstance(v, BudgetInt) for v in ints)
    assert not any(INTS_KEY in n.meta for g in plain for n in g.graph.nodes)


def test_compiled_forward_traces_each_kernel_once_and_fingerprint_twice(monkeypatch):
    model = tiny_model("llama", layers=2)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    calls = _counting_traces(monkeypatch)
    m = fxbudget.compile(fresh(model), rule="h2o", budget=6, backend="aot_eager")
    with torch.no_grad():
        m(input_ids=ids)
    assert len(calls) == 1  # the prefill's one kernel configuration, traced once
    calls.clear()
    fxbudget.kernel_fingerprint(model, rule="h2o", budget=6)
    assert len(calls) == 4  # the probe's prefill and decode kernels, each with its grown twin
