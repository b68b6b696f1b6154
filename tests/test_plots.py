"""The report's figures, read back from matplotlib: a lone budget sits inside its panel, unbounded intervals are
noted with their reason, every title names the protocol, needle depths are labelled with the task's own values, and a
heatmap is drawn only on at least 2 x 2 cells (bars over the one dimension that varies, a sentence for 1 x 1)."""

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
    fig = P.metric_figure(_rows(2), metric, kind="tokens")
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    xs = _data_x(ax)
    assert xs, "nothing drawn"
    # At least a quarter of a doubling between every point and each edge (log axis).
    assert all(math.log2(x / lo) > 0.25 and math.log2(hi / x) > 0.25 for x in xs), (lo, hi, xs)


def test_several_budgets_keep_a_margin_too():
    ax = P.metric_figure(_rows(2, budgets=(8, 32, 128)), "accuracy", kind="tokens").axes[0]
    lo, hi = ax.get_xlim()
    assert lo < min(_data_x(ax)) and max(_data_x(ax)) < hi
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "32", "128"]


def test_unbounded_likelihood_intervals_are_noted_not_dropped_silently():
    few = P.metric_figure(_rows(2), "likelihood", kind="tokens").axes[0]
    assert "no bar: n=2: too few samples for an interval" in few.get_title()
    many = P.metric_figure(_rows(8), "likelihood", kind="tokens").axes[0]  # 8 paired samples: bounded
    assert P.UNBOUNDED_NOTE not in many.get_title()
    assert P.UNBOUNDED_NOTE not in P.metric_figure(_rows(2), "accuracy", kind="tokens").axes[0].get_title()


def test_every_title_names_the_protocol():
    rows = _rows(2, protocol="query-aware") + _rows(2, protocol="query-agnostic")
    for metric in ("accuracy", "likelihood"):
        fig = P.metric_figure(rows, metric, kind="tokens")
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert len(titles) == 2 and any("query-aware" in t for t in titles) and \
            any("query-agnostic" in t for t in titles)


def _needle(depths, lengths, n=1, rule="snapkv"):
    """Rows of one rule at B=8 over every depth x length, `n` samples each (score 1 on even samples)."""
    out, k = [], 0
    for d in depths:
        for length in lengths:
            for _ in range(n):
                out.append(row(rule, k, budget=8, score=float(k % 2 == 0), depth=d, length=length,
                               protocol="query-aware"))
                k += 1
    return out


def test_two_by_two_is_a_heatmap_labelled_with_the_tasks_own_depths():
    rs = _needle([0.2497, 0.7503], [1000, 2000], n=2)  # measured depths of needles asked at 0.25 and 0.75
    assert P.needle_shape(rs) == "heatmap"
    ax = P.heatmap_figure(rs, "snapkv").axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0.25", "0.75"]  # not round(d, 1): 0.2, 0.8
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1000", "2000"]
    assert ax.get_title() == "snapkv, B=8\nquery-aware"
    # 4 cells of 2 samples each, scores 1,0: mean 0.50 in every cell.
    assert [t.get_text() for t in ax.texts] == ["0.50\n(n=2)"] * 4
    assert len(ax.images) == 1 and ax.images[0].get_array().shape == (2, 2)


def test_one_length_draws_bars_over_the_depths_not_a_one_column_heatmap():
    rs = _needle([0.1, 0.25, 0.333333, 0.9], [1000])
    assert P.needle_shape(rs) == "bars"
    ax = P.needle_bars_figure(rs, "snapkv").axes[0]
    assert not ax.images
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.10", "0.25", "0.33", "0.90"]
    assert [round(p.get_height(), 6) for p in ax.patches] == [1.0, 0.0, 1.0, 0.0]
    assert [t.get_text() for t in ax.texts] == ["1.00\n(n=1)", "0.00\n(n=1)", "1.00\n(n=1)", "0.00\n(n=1)"]
    assert ax.get_xlabel() == "needle depth (context length 1000)"


def test_one_depth_several_lengths_draws_bars_over_the_lengths():
    rs = _needle([0.5], [500, 1000, 2000])
    ax = P.needle_bars_figure(rs, "snapkv").axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["500", "1000", "2000"]
    assert "needle depth 0.50" in ax.get_xlabel()


def test_one_by_one_is_a_sentence_not_a_figure(tmp_path):
    rs = _needle([0.5], [1000], n=2) + _needle([0.5], [1000], n=2, rule="h2o")
    assert P.needle_shape(rs) == "none"
    assert P.needle_note(rs) == ("Needle depth x context length: every needle sample sits at depth 0.50 in a "
                                 "1000-token context, so there is no depth or length figure: the accuracy tables "
                                 "above hold the same numbers.")
    names = P.plot(rs, tmp_path)
    assert not [n for n in names if n.startswith(("heatmap_", "needle_"))]
    assert P.needle_note(_needle([0.25, 0.75], [1000])) is None  # a figure is drawn: no sentence


def test_report_says_the_one_cell_sentence_under_its_plots(tmp_path):
    from fxbudget.harness import report as R

    rs = _needle([0.5], [1000], n=2) + _needle([0.5], [1000], n=2, rule="h2o")
    text = R.markdown(rs, ["accuracy_vs_budget.png"])
    plots = text.split("## plots", 1)[1].split("## glossary", 1)[0]  # the glossary closes the report
    assert plots.rstrip().endswith("the accuracy tables above hold the same numbers.")


def test_plot_writes_the_files_it_returns(tmp_path):
    names = P.plot(_rows(2), tmp_path)  # depths 0.25 and 0.75 at one length: bars
    assert names[:2] == ["accuracy_vs_budget.png", "likelihood_vs_budget.png"]
    assert sorted(names[2:]) == ["needle_h2o.png", "needle_snapkv.png", "needle_streamingllm.png"]
    assert sorted(names) == sorted(p.name for p in tmp_path.iterdir())
    assert all((tmp_path / n).stat().st_size > 0 for n in names)
    grid = [dict(r, length=1000 + 1000 * (r["sample"] // 2)) for r in _rows(4)]  # 2 depths x 2 lengths
    (tmp_path / "grid").mkdir()
    figures = [n for n in P.plot(grid, tmp_path / "grid") if n.startswith(("heatmap_", "needle_"))]
    assert sorted(figures) == ["heatmap_h2o.png", "heatmap_snapkv.png", "heatmap_streamingllm.png"]
