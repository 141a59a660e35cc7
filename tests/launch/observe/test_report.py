"""The end-of-run report (launch/observe/report.py and its plots): a full run, titles, units and fixed
outcome colours, missing keys named, an empty run, the timeline and per-step plots."""

from __future__ import annotations

import html
import json
import re

import matplotlib.colors

from configs import LoggingConfig
from launch.observe.metrics import MetricsLog, read_metrics
from launch.observe.report import write_report
from tests.launch.observe.episodes import _dumper, _episode, _failed, _result, _turn


def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _full_run(run_dir, steps=4):
    with MetricsLog(run_dir, LoggingConfig(tensorboard=False)) as metrics:
        for step in range(1, steps + 1):
            metrics.log(
                step,
                {
                    "train/loss": 1.0 / step,
                    "train/kept_fraction": 0.9,
                    "train/clip_low_fraction": 0.05,
                    "train/clip_high_fraction": 0.1,
                    "train/is_truncated_fraction": 0.01,
                    "train/grad_norm": 0.5,
                    "train/grad_norm_max": 0.7,
                    "train/entropy": 2.0 - 0.1 * step,
                    "train/response_length": 40.0 + step,
                    "train/tokens_per_s": 900.0,
                    "train/step_s": 2.0,
                    "weights/version": step,
                    "rollout/samples_per_s": 2.0 * step,
                    "rollout/tokens_per_s": 500.0 * step,
                    "reward/mean": -1 + 0.25 * step,
                    "reward/pass_rate": 0.1 * step,
                    "verifier/compile": 4 - step,
                    "verifier/done": step,
                    "verifier/error/compile": 4 - step,
                    "verifier/error/timeout": 1,
                    "staleness/mean": 0.5,
                    "staleness/max": 1,
                    "staleness/lag_0": 3,
                    "staleness/lag_1": 1,
                    "replay/bdr_share": 0.25,
                    "train/mirrorpop_dropped": 1,
                    "train/off_policy_kept": 2,
                    "train/clipped": 5,
                    "rollout/repair_passes": step % 2,
                    "replay/retry_admitted": step,
                    "replay/retry_served": step - 1,
                    "replay/retry_trained": 0,
                    "replay/filtered_groups/tied": step,
                    "run/distinct_sources": 10 * step,
                    "run/untied_groups": step,
                    "busy/learner": 0.5,
                    "busy/rollout-0": 0.9,
                },
            )
            metrics.log(
                step,
                {
                    "progress/elapsed_s": 30.0 * step,
                    "progress/groups": 3.0 * step,
                    "progress/trainable": 2.0 * step,
                    "progress/filtered/tied": float(step),
                    "progress/pass_rate": 0.25,
                    "progress/verdict/passed": 1.0,
                    "progress/verdict/compile": 3.0,
                    "progress/decoded_tokens_per_s": 50.0,
                    "progress/retry_buffer": 1.0,
                },
                tb_step=30 * step,
            )
        metrics.log(2, {"eval/pass@4": 0.2, "eval/avg@4": 0.1, "eval/faster_eager": 0.05, "eval/tasks": 3})
        metrics.log(
            4,
            {
                "eval/pass@4": 0.5,
                "eval/avg@4": 0.3,
                "eval/faster_eager": 0.2,
                "eval/faster_compile": 0.1,
                "eval/tasks": 3,
            },
        )


def test_report_from_a_full_run(tmp_path):
    _full_run(tmp_path)
    (tmp_path / "config.yaml").write_text("algo: {}\n")
    (tmp_path / "summary.json").write_text(json.dumps({"wall_s": 123.4, "warnings": ["no progress: tied"]}))
    dumper = _dumper(tmp_path)
    dumper.add(
        [
            _episode("e1", [-1.0], [_turn("p", "r", _failed())], group="g1"),
            _episode("e2", [1.0], [_turn("p", "r", _result(True))], group="g1"),
        ]
    )
    dumper.dump(4)
    path = write_report(tmp_path)
    text = path.read_text()
    assert path == tmp_path / "report.md"
    assert "[the resolved config](config.yaml)" in text and "[step-000004.txt](episodes/step-000004.txt)" in text
    for expected in (
        "| learner steps | 4 (steps 1..4) |",
        "| wall time (this session, as `kiln train` printed it) | 123 s |",
        "| weight versions | 4 |",
        "| groups completed | 12 |",
        "| distinct compiled sources | 40 |",
        "| untied groups (rewards not all equal) | 4 |",
        "| final pass rate | 0.4 |",
        "## Warnings",
        "* no progress: tied",
        "| step | pass@4 | avg@4 | faster eager | faster compile | tasks |",
        "| 2 | 0.2 | 0.1 | 0.05 | - | 3 |",
        "| 4 (final) | **0.5** | **0.3** | **0.2** | **0.1** | **3** |",
        # the mechanisms: run totals from the last row, per-step counts summed
        "| Buffered Dynamic Retry: an all-failed group enters the retry buffer | 4 groups | no dump",
        "| Buffered Dynamic Retry: a repair task from the buffer is served | 3 groups | no dump",
        "| Buffered Dynamic Retry: a repair group is trained | 0 | - |",
        "| MirrorPop drops a sequence (mean \\|log π_prox - log μ\\| > δ) | 4 sequences | no dump",
        "| verdict: compile error | 6 attempts | [step-000004.txt](episodes/step-000004.txt) `e1` |",
        "| verdict: timeout | 4 attempts | no dump",
        "| PPO clip: a token's ratio is clipped | 20 token-updates | - |",
        "| a repair turn passes (after a failed turn) | 2 episodes |",
    ):
        assert expected in text, expected
    for name in (
        "reward",
        "verifier",
        "progress",
        "throughput",
        "timeline",
        "staleness",
        "training",
        "policy",
        "corrections",
    ):
        assert f"(plots/{name}.png)" in text and _is_png(tmp_path / "plots" / f"{name}.png"), name
    assert "Not recorded" not in text
    # report.html: the same sections and tables, the plots embedded
    page = (tmp_path / "report.html").read_text()
    for heading in re.findall(r"^## (.+)$", text, re.MULTILINE):
        assert f"<h2>{html.escape(heading)}</h2>" in page, heading
    assert page.count("<img ") == text.count("![") == 9 and "data:image/png;base64," in page
    assert '<a href="episodes/step-000004.txt">step-000004.txt</a> <code>e1</code>' in page
    assert "<td>4 (steps 1..4)</td>" in page and "mean |log π_prox - log μ| &gt; δ" in page


def test_plots_have_titles_units_integer_steps_and_fixed_outcome_colours(tmp_path, monkeypatch):
    from launch.observe import report_plots
    from launch.observe.outcomes import COLOURS

    figures = {}

    def keep(plt, fig, path):
        figures[path.name] = fig
        fig.canvas.draw()
        return path

    monkeypatch.setattr(report_plots, "_save", keep)
    _full_run(tmp_path, steps=3)
    rows = read_metrics(tmp_path)
    series = report_plots.step_series(rows)
    for _, draw in report_plots.PLOTS:
        draw(series, rows, tmp_path, tmp_path)
    assert set(figures) == {
        "reward.png",
        "verifier.png",
        "progress.png",
        "throughput.png",
        "timeline.png",
        "staleness.png",
        "training.png",
        "policy.png",
        "corrections.png",
    }
    for name, fig in figures.items():
        assert fig._suptitle is not None and fig._suptitle.get_text(), name
        for ax in fig.axes:
            if ax.get_label() == "<colorbar>":
                continue
            assert ax.get_ylabel() or ax.get_yticklabels(), (name, "no y unit")
    for name in ("reward.png", "verifier.png", "throughput.png", "training.png", "policy.png", "corrections.png"):
        ticks = [t for t in figures[name].axes[-1].get_xticks() if 0.5 <= t <= 3.5]
        assert ticks == [1.0, 2.0, 3.0], (name, ticks)  # three steps: ticks 1, 2, 3, never 1.5
    for name in ("verifier.png", "progress.png"):  # one colour per outcome, whatever the panel
        for ax in figures[name].axes:
            for container in ax.containers:
                label = container.get_label()
                colour = matplotlib.colors.to_hex(container.patches[0].get_facecolor())
                assert colour == COLOURS[label], (name, label, colour)


def test_report_with_few_keys_says_what_is_missing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "time": 1.0, "reward/mean": 0.5}\n{"step": 2, "time": 3.0, "re'
    )
    text = write_report(tmp_path, html=False).read_text()
    assert "| learner steps | none |" in text and "| final loss | not recorded |" in text
    assert "| wall time (this session, as `kiln train` printed it) | 0 s (first to last metrics row) |" in text
    assert "No validation run was recorded" in text
    assert "(plots/reward.png)" in text and "(plots/verifier.png)" not in text
    missing = text.split("## Not recorded in this run")[1]
    for key in (
        "`reward/pass_rate`",
        "`verifier/done`",
        "`rollout/samples_per_s`",
        "`staleness/lag_<k>`",
        "`train/loss`",
        "`progress/*`",
        "`train/entropy`",
        "`train/clip_low_fraction`",
    ):
        assert key in missing, key
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["reward.png"]
    assert not (tmp_path / "report.html").exists()


def test_report_of_an_empty_run(tmp_path):
    text = write_report(tmp_path).read_text()
    assert "No metrics were recorded" in text
    assert list((tmp_path / "plots").iterdir()) == []


def test_the_timeline_draws_recorded_spans_when_the_run_has_them(tmp_path, monkeypatch):
    from launch.observe import report_plots

    _full_run(tmp_path, steps=2)
    rows = read_metrics(tmp_path)
    coarse = report_plots.timeline_spans(tmp_path, rows)  # from metrics.jsonl: steps and busy shares
    assert {(s.actor, s.activity) for s in coarse} == {("learner", "training"), ("rollout-0", "busy")}
    spans = [
        {"actor": "rollout-0", "activity": "generating", "start": 10.0, "end": 14.5, "units": 1},
        {"actor": "verifier-0", "activity": "verifying", "start": 12.0, "end": 13.0, "units": 2},
        {"actor": "learner", "activity": "training", "start": 14.5, "end": 16.0, "units": 1},
    ]
    (tmp_path / "timeline.jsonl").write_text("\n".join(json.dumps(s) for s in spans) + '\n{"actor": "learn')
    exact = report_plots.timeline_spans(tmp_path, rows)  # the torn last line is skipped
    assert [(s.actor, s.activity, s.start, s.end, s.share) for s in exact] == [
        ("rollout-0", "generating", 10.0, 14.5, 1.0),
        ("verifier-0", "verifying", 12.0, 13.0, 1.0),
        ("learner", "training", 14.5, 16.0, 1.0),
    ]
    figures = {}
    monkeypatch.setattr(report_plots, "_save", lambda plt, fig, path: figures.setdefault(path.name, fig) and path)
    report_plots.plot_timeline(tmp_path, rows, tmp_path)
    ax = figures["timeline.png"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["learner", "rollout-0", "verifier-0"]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["generating", "training", "verifying"]


def test_per_step_plots_span_every_learner_step_also_one_without_rollout_figures(tmp_path, monkeypatch):
    from launch.observe import report_plots

    _full_run(tmp_path, steps=2)
    with MetricsLog(tmp_path, LoggingConfig(tensorboard=False)) as metrics:  # a last step with no group finished
        metrics.log(3, {"train/loss": 0.1, "weights/version": 3, "train/grad_norm": 0.5})
    rows = read_metrics(tmp_path)
    figures = {}
    monkeypatch.setattr(report_plots, "_save", lambda plt, fig, path: figures.setdefault(path.name, fig) and path)
    series = report_plots.step_series(rows)
    report_plots.plot_reward(series, tmp_path)
    report_plots.plot_verifier(series, tmp_path)
    for name in ("reward.png", "verifier.png"):
        ax = figures[name].axes[-1]
        assert list(ax.get_xticks()) == [1, 2, 3] and ax.get_xlim()[1] > 3, name
