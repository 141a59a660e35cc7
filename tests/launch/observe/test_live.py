"""The live view (launch/observe/live.py): one plain line per step with elapsed time and ETA, progress
rows and warnings, and the rich panel on a terminal."""

from __future__ import annotations

import io
import re

from rich.console import Console

from launch.observe.live import LiveView

STEP_VALUES = {
    "weights/version": 3,
    "rollout/samples_per_s": 12.5,
    "rollout/tokens_per_s": 4321.0,
    "reward/mean": 0.375,
    "reward/pass_rate": 0.25,
    "verifier/compile": 2,
    "verifier/done": 1,
    "verifier/error/compile": 2,
    "staleness/mean": 0.5,
    "staleness/max": 1,
    "replay/bdr_share": 0.125,
    "train/kept_fraction": 0.9,
    "busy/rollout-0": 0.5,
    "busy/verifier-0": 0.75,
}


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def test_live_view_prints_one_plain_line_per_step_with_elapsed_time_and_eta():
    out, clock = io.StringIO(), Clock()
    with LiveView(False, total_steps=10, stream=out, started=40.0, clock=clock) as view:
        view.update(3, STEP_VALUES)
        clock.now = 130.0
        view.update(4, {"weights/version": 4})  # other keys keep their last value; no verdicts this step
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        "step 3/10 (elapsed 0:01:00) | weights v 3 | samples/s 12.5 | tokens/s 4,321 | reward 0.375"
    )
    assert "pass rate 0.25" in lines[0] and "BDR share 0.125" in lines[0] and "MirrorPop kept 0.9" in lines[0]
    assert "verdicts passed 1, compile 2" in lines[0]
    assert "busy rollout-0 50% verifier-0 75%" in lines[0]
    # 30 s per step, 6 steps to go
    assert lines[1].startswith("step 4/10 (elapsed 0:01:30, ETA 0:03:00) | weights v 4 | samples/s 12.5")
    assert "verdicts" not in lines[1]  # a step's verifier counts are that step's, never carried over


def test_a_row_without_rates_keeps_the_last_rates_shown():
    # the run's last step: no group finished in its window, so the monitor reports no rate (not 0)
    out = io.StringIO()
    with LiveView(False, total_steps=2, stream=out) as view:
        view.update(1, {"rollout/samples_per_s": 2.5, "busy/rollout-0": 0.8})
        view.update(2, {"train/loss": 0.1})
    assert "samples/s 2.5" in out.getvalue().splitlines()[1] and "rollout-0 80%" in out.getvalue().splitlines()[1]


def test_live_view_without_a_terminal_falls_back_to_plain_lines():
    out = io.StringIO()
    with LiveView(True, total_steps=5, stream=out, clock=Clock()) as view:  # a StringIO is no terminal
        view.update(1, {"reward/mean": 0.5})
    assert out.getvalue() == "step 1/5 (elapsed 0:00:00) | reward 0.5\n"


def test_progress_rows_and_the_warning_in_plain_lines():
    out, clock = io.StringIO(), Clock()
    with LiveView(False, total_steps=4, stream=out, started=0.0, clock=clock) as view:
        view.progress(
            {
                "progress/groups": 12,
                "progress/episodes": 48,
                "progress/filtered/tied": 12,
                "progress/pass_rate": 0.0,
                "progress/verdict/extract": 96,
            },
            "no progress: ...extract...",
        )
        view.progress({"progress/groups": 14}, "no progress: ...extract...")  # the same warning: printed once
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "progress (elapsed 0:01:40) | groups 12 | episodes 48 | pass rate 0 | filtered tied 12 | verdicts extract 96"
    )
    assert lines[1] == "WARNING no progress: ...extract..."
    assert lines[2].startswith("progress (elapsed 0:01:40) | groups 14") and len(lines) == 3


def test_live_view_on_a_terminal_draws_the_rich_panel():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    with LiveView(True, total_steps=10, console=console, clock=Clock()) as view:
        view.update(3, STEP_VALUES)
        view.progress({"progress/groups": 7, "progress/filtered/tied": 2}, "no progress: the last 32 groups tied")
    text = out.getvalue()
    for expected in (
        "kiln train",
        "3/10",
        "elapsed",
        "MirrorPop kept",
        "0.9",
        "verifier outcomes",
        "this step",
        "compile",
        "passed",
        "rollout-0",
        "50%",
        "75%",
        "4,321",
        "BDR share",
        "rollout side",
        "filtered tied",
        "no progress: the last 32 groups tied",
    ):
        assert expected in text, expected
    assert "step 3/10 |" not in text  # not the plain fallback
    # one row per outcome: headers never wider than a narrow terminal's columns
    narrow = io.StringIO()
    with LiveView(
        True,
        total_steps=10,
        console=Console(file=narrow, force_terminal=True, width=60, color_system=None),
        clock=Clock(),
    ) as view:
        view.update(
            3,
            {**STEP_VALUES, "verifier/error/correctness": 3, "verifier/error/cheating": 1, "verifier/error/timeout": 1},
        )
    table = narrow.getvalue()
    for outcome in ("passed", "compile", "timeout", "correctness", "cheating"):
        assert re.search(rf"│\s+{outcome}\s+│\s+\d+\s+│\s+\d+", table), outcome  # the whole name, then its counts
