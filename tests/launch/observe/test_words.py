"""Plots that cannot show a shape say so in words (launch/observe/plot_words.py): one step only, or
every value 0, in the training report's per-step panels and progress plot, `kiln sft`'s loss plot
and `kiln eval`'s chart; count axes tick on whole numbers."""

from __future__ import annotations

import pytest

from launch.observe import report_plots
from launch.observe.plot_words import thin_data_note


def test_the_note_names_one_step_and_all_zeros():
    assert thin_data_note([(3, 0.5)]) == "one step only (step 3): no trend to draw yet"
    assert thin_data_note([(3, 0.5), (3, 0.2)]) == "one step only (step 3): no trend to draw yet"  # two lines
    assert thin_data_note([(1, 0.0)]) == "one step only (step 1), and every value is 0"
    assert thin_data_note([(1, 0.0), (2, 0.0), (3, 0.0)]) == "every value is 0"
    assert thin_data_note([(1, 0.0), (2, 1.0)]) is None and thin_data_note([]) is None


@pytest.fixture
def said(monkeypatch) -> list[str]:
    """What the plots write across their axes."""
    texts: list[str] = []

    def record(ax, text):
        if text:
            texts.append(text)

    for module in ("launch.observe.report_plots", "launch.stages.sft.report", "launch.stages.eval.table"):
        monkeypatch.setattr(f"{module}.say_on", record)
    return texts


def test_a_per_step_panel_of_one_step_or_zeros_says_so(tmp_path, said):
    panels = [
        report_plots.Panel("loss", "nats", (("train/loss", "loss"),)),
        report_plots.Panel("dropped", "share", (("mirrorpop/dropped", "dropped"),)),
    ]
    series = {"train/loss": [(1, 2.5)], "mirrorpop/dropped": [(1, 0.0)]}
    path, absent = report_plots.line_plot(series, tmp_path / "p.png", "t", panels)
    assert path.is_file() and not absent
    assert said == ["one step only (step 1): no trend to draw yet", "one step only (step 1), and every value is 0"]


def test_the_progress_plot_has_whole_number_count_ticks_and_says_when_nothing_completed(tmp_path, said, monkeypatch):
    ticks = []
    real = report_plots._integer_counts

    def spy(ax):
        real(ax)
        ticks.append([t for t in ax.get_yticks() if t != int(t)])

    monkeypatch.setattr(report_plots, "_integer_counts", spy)
    rows = [
        {"step": 0, "time": 100.0 + 30 * i, "progress/elapsed_s": 30.0 * i, "progress/groups": 0.0} for i in (1, 2, 3)
    ]
    rows[-1]["progress/verdict/compile"] = 1.0
    path, _ = report_plots.plot_progress(rows, tmp_path)
    assert path.is_file() and said == ["no group completed yet"]
    assert ticks == [[], []]  # the groups and attempts axes: no tick between whole numbers


def test_kiln_sft_one_step_loss_plot_says_it_has_one_point(tmp_path, said):
    from launch.stages.sft.report import _plot

    assert _plot(tmp_path, [(1, 2.75)], []).is_file()
    assert said == ["one step only (step 1): no trend to draw yet"]


def test_kiln_eval_chart_of_zeros_says_no_attempt_passed(tmp_path, said, monkeypatch):
    from launch.stages.eval import table

    summary = {"rows": [{"label": "L1"}, {"label": "Overall"}], "n": 1, "fast_threshold": 1.1}
    monkeypatch.setattr(table, "columns", lambda s: [("Pass@1", "Pass@1", None), ("Avg@1", "Avg@1", None)])
    monkeypatch.setattr(
        table, "row_values", lambda s: {(m, lb): 0.0 for m in ("Pass@1", "Avg@1") for lb in ("L1", "Overall")}
    )
    table.bar_chart(summary, "zeros", tmp_path / "chart.png")
    assert said == ["every value is 0%: no attempt passed"] and (tmp_path / "chart.png").is_file()
