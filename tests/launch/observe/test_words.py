"""Plots that cannot show a shape say so in words (launch/observe/words.py): one step only, or
every value 0, in the training report's per-step panels and progress plot, `kiln sft`'s loss plot
and `kiln eval`'s chart; count axes tick on whole numbers."""

from __future__ import annotations

import json

import pytest

from launch.observe import report_plots
from launch.observe.words import thin_data_note


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


def test_the_report_explains_each_term_once_where_it_first_appears_and_counts_in_the_singular(tmp_path):
    from launch.observe.mechanisms import GLOSSARY
    from launch.observe.report import write_report

    rows = [
        {"step": s, "time": float(s), "reward/mean": 0.1 * s, "train/loss": 1.0 / s, "weights/version": float(s)}
        for s in (1, 2, 3)
    ]
    rows[-1].update({"replay/retry_admitted": 1.0, "train/clip_low_fraction": 0.1, "train/kept_fraction": 0.9})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path, html=False).read_text()
    for term, sentence in GLOSSARY.items():
        assert text.count(sentence) == 1, term  # explained once
        first_plot = text.index("![")
        assert text.index(sentence) < first_plot, term  # before any plot shows it
    # PrimeEcho is named in the summary table, and explained right after it, before the mechanisms
    assert text.index("final reward mean (PrimeEcho)") < text.index(GLOSSARY["PrimeEcho"]) < text.index("## Mechanisms")
    assert "| Buffered Dynamic Retry: an all-failed group enters the retry buffer | 1 group |" in text


def test_counts_read_in_the_singular_and_the_plural_in_kiln_evals_caption():
    from launch.observe.words import plural
    from launch.stages.eval.table import caption

    assert [plural(n, "group") for n in (0, 1, 2)] == ["0 groups", "1 group", "2 groups"]
    assert plural(3, "child", "children") == "3 children"
    one = {"n": 1, "fast_threshold": 1.1, "failed_loads": [{"path": "x", "reason": "y"}]}
    one["rows"] = [{"attempts": 1, "tasks": 1, "infra": 1, "short_of_k": {}}]
    text = caption(one)
    assert "1 attempt on 1 task; 1 infra verdict excluded" in text and "1 task file failed to load." in text
