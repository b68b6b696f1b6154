"""The report's figures, read back from matplotlib: a lone budget sits inside its panel, unbounded intervals are
noted, every title names the protocol, and a one-cell heatmap is labelled."""

import math

import matplotlib
import pytest

from fxbudget.harness import plots as P
from test_report import row

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _rows(n_samples, budgets=(8,), rules=("snapkv", "h2o", "streamingllm"), protocol="query-aware"):
    out = [row("full", s, logprob=-0.1, protocol=protocol) for s in range(n_samples)]
    for i, rule in enumerate(rules):
        for b in budgets:
            for s in range(n_samples):
                out.append(row(rule, s, budget=b, score=float((s + i) % 2), logprob=-1.0 - 0.1 * i - 0.37 * s,
                               protocol=protocol))
    return out


def _data_x(ax) -> list[float]:
    """The x of every point drawn in data coordinates (the reference's horizontal line spans the axes instead)."""
    return [float(x) for line in ax.lines if line.get_label() != "full (unmodified)" for x in line.get_xdata()
            if not math.isnan(float(x))]


@pytest.mark.parametrize("metric", ["accuracy", "likelihood"])
def test_one_budget_points_sit_inside_the_panel(metric):
    fig = P.metric_figure(_rows(2), metric, relative=False)
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    xs = _data_x(ax)
    assert xs, "nothing drawn"
    # At least a quarter of a doubling between every point and each edge (log axis).
    assert all(math.log2(x / lo) > 0.25 and math.log2(hi / x) > 0.25 for x in xs), (lo, hi, xs)


def test_several_budgets_keep_a_margin_too():
    ax = P.metric_figure(_rows(2, budgets=(8, 32, 128)), "accuracy", relative=False).axes[0]
    lo, hi = ax.get_xlim()
    assert lo < min(_data_x(ax)) and max(_data_x(ax)) < hi
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "32", "128"]


def test_unbounded_likelihood_intervals_are_noted_not_dropped_silently():
    few = P.metric_figure(_rows(2), "likelihood", relative=False).axes[0]
    assert P.UNBOUNDED_NOTE in few.get_title()
    many = P.metric_figure(_rows(8), "likelihood", relative=False).axes[0]  # 8 paired samples: bounded
    assert P.UNBOUNDED_NOTE not in many.get_title()
    assert P.UNBOUNDED_NOTE not in P.metric_figure(_rows(2), "accuracy", relative=False).axes[0].get_title()


def test_every_title_names_the_protocol():
    rows = _rows(2, protocol="query-aware") + _rows(2, protocol="query-agnostic")
    for metric in ("accuracy", "likelihood"):
        fig = P.metric_figure(rows, metric, relative=False)
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert len(titles) == 2 and any("query-aware" in t for t in titles) and \
            any("query-agnostic" in t for t in titles)


def test_one_cell_heatmap_is_titled_with_protocol_and_labelled():
    rs = [r for r in _rows(2) if r["rule"] == "snapkv"]
    for r in rs:
        r["depth"] = 0.5  # one depth, one length: a single cell
    fig = P.heatmap_figure(rs, "snapkv")
    ax = fig.axes[0]
    assert ax.get_title() == "snapkv, B=8\nquery-aware"
    assert [t.get_text() for t in ax.texts] == ["0.50\n(n=2)"]
    width, height = fig.get_size_inches()
    assert width >= 4 and height >= 3  # a labelled square, not a sliver


def test_plot_writes_the_files_it_returns(tmp_path):
    names = P.plot(_rows(2), tmp_path)
    assert names == ["accuracy_vs_budget.png", "likelihood_vs_budget.png", "heatmap_h2o.png", "heatmap_snapkv.png",
                     "heatmap_streamingllm.png"] or sorted(names) == sorted(p.name for p in tmp_path.iterdir())
    assert all((tmp_path / n).stat().st_size > 0 for n in names)
