"""A run that cannot learn says so (launch/observe/progress.py, the driver's progress rows and warning):
rollout-side progress rows come with or without learner steps, a warning names why no group is
trainable and what helps, and `algo.stop_after_no_progress_s` ends such a run with its report."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import ClassVar

from launch.driver.monitor import GroupOutcome, Window
from launch.observe.progress import (
    NoProgressCheck,
    ProgressRows,
    ReplayCounts,
    StartReadings,
    Warnings,
    outcome_story,
    waiting_story,
)

ROOT = Path(__file__).resolve().parents[3]


def _counts(trainable=0, held_back=False, **filtered):
    return ReplayCounts(
        groups=trainable + sum(filtered.values()),
        episodes=4 * (trainable + sum(filtered.values())),
        trainable=trainable,
        filtered=filtered,
        retry_buffer=2,
        held_back=held_back,
    )


def _tied(outcome="extract", stage="extract", reward=-1.0, attempts=8):
    return GroupOutcome(tied=True, reward=reward, outcomes={outcome: attempts}, stages={stage: attempts})


def test_a_progress_row_holds_replay_totals_the_windows_verdicts_and_decoded_rate():
    rows = ProgressRows(every_s=30.0, started=100.0)
    assert not rows.due(129.0) and rows.due(130.0)
    window = Window()
    window.stages.update({"done": 1, "extract": 3})
    window.errors.update({"extract": 3})
    first = rows.row(130.0, _counts(trainable=1, tied=5, stale=1), window, decoded_tokens=600)
    assert first == {
        "progress/elapsed_s": 30.0,
        "progress/groups": 7.0,
        "progress/episodes": 28.0,
        "progress/trainable": 1.0,
        "progress/retry_buffer": 2.0,
        "progress/filtered/tied": 5.0,
        "progress/filtered/stale": 1.0,
        "progress/pass_rate": 0.25,
        "progress/verdict/passed": 1.0,
        "progress/verdict/extract": 3.0,
    }  # the first reading of the decoded tokens sets the baseline
    second = rows.row(160.0, None, Window(), decoded_tokens=1500)  # replay did not answer; nothing verified
    assert second == {"progress/elapsed_s": 60.0, "progress/decoded_tokens_per_s": 30.0}
    forced = ProgressRows(every_s=30.0, started=0.0)  # forced answers are scored, never decoded
    assert [forced.row(t, None, Window(), decoded_tokens=0) for t in (30.0, 60.0)] == [
        {"progress/elapsed_s": 30.0},
        {"progress/elapsed_s": 60.0},
    ]  # no rate rather than a rate of 0


def test_the_warning_comes_when_the_last_k_groups_all_tied_and_names_the_stage():
    check = NoProgressCheck(groups=4, stall_s=600.0, started=0.0)
    recent = [_tied()] * 3
    assert check.check(10.0, recent, _counts(tied=3), None) is None  # 3 of 4
    recent.append(_tied())
    line = check.check(11.0, recent, _counts(tied=4), None)
    assert line.startswith("no progress: the last 4 groups all tied at reward -1.00, so dynamic sampling filters")
    assert "every attempt fails at extract: the model never writes a fenced code block with a ModelNew class" in line
    for remedy in ("warm_start.steps", "kiln tasks synth", "rollout.forced_fraction", "rollout.max_turns"):
        assert remedy in line, remedy
    untied = GroupOutcome(tied=False, reward=None, outcomes={"passed": 1, "compile": 7}, stages={})
    assert check.check(12.0, recent + [untied], _counts(trainable=1, tied=4), None) is None


def test_the_warning_comes_when_nothing_became_trainable_for_no_progress_s():
    check = NoProgressCheck(groups=32, stall_s=60.0, started=0.0)
    mixed = [GroupOutcome(tied=False, reward=None, outcomes={"compile": 3, "passed": 1}, stages={"compile": 3})]
    assert check.check(30.0, mixed, _counts(trainable=0, stale=2), None) is None
    line = check.check(61.0, mixed, _counts(trainable=0, stale=3), None)
    assert line.startswith("no progress: no group became trainable for 61 s (groups filtered so far: 3 stale)")
    assert "the attempts end: compile 75%, passed 25%" in line
    # a group became trainable: the clock starts again; a learner step or a full admission bound too
    assert check.check(70.0, mixed, _counts(trainable=1), None) is None
    assert check.check(125.0, mixed, _counts(trainable=1), last_step_at=100.0) is None
    assert check.check(200.0, mixed, _counts(trainable=1, held_back=True), None) is None  # the learner is the limit
    assert check.check(259.0, mixed, _counts(trainable=1), None) is None
    assert check.check(261.0, mixed, _counts(trainable=1), None) is not None


def test_the_story_of_how_attempts_end():
    assert (
        outcome_story([_tied("timeout", "run")])
        == "every attempt fails at run: every attempt runs past verifier.run_timeout_s"
    )
    assert outcome_story([_tied("passed", "done", reward=1.2)]).startswith("every attempt passes with the same score")
    assert outcome_story([GroupOutcome(tied=True, reward=-1.0, outcomes={}, stages={})]) == "no attempt was verified"


def test_before_the_first_group_the_progress_line_says_what_the_run_waits_for():
    cold = StartReadings(engines=1, engines_serving=1, in_flight=6, at_verifier=4, verified=0, verifiers=1, warming=1)
    story = waiting_story(_counts(), cold)  # no group yet
    assert story.startswith("waiting for the verifier's one-off warm-up: precompiled headers")
    assert "4 attempts at the verifier; no verdict yet" in story and "2 attempts generating" in story
    loading = StartReadings(engines=2, engines_serving=1, in_flight=0, at_verifier=0, verified=0)
    assert waiting_story(None, loading) == "waiting for the engines to load the model (1 of 2 serving)"
    warm = StartReadings(engines=1, engines_serving=1, in_flight=1, at_verifier=1, verified=3, verifiers=2, warming=0)
    assert waiting_story(_counts(), warm) == "waiting for 1 attempt at the verifier"
    idle = StartReadings(engines=1, engines_serving=1, in_flight=0, at_verifier=0, verified=5)
    assert waiting_story(_counts(), idle) == "waiting for the first complete group (5 attempts verified so far)"
    assert waiting_story(_counts(trainable=1), cold) is None  # a group completed: the row's figures speak
    assert waiting_story(_counts(), None) is None  # nothing answered: nothing to say


def test_the_progress_line_carries_the_waiting_story_until_it_is_gone():
    from launch.observe.live import LiveView

    out = io.StringIO()
    with LiveView(False, total_steps=2, stream=out, started=0.0, clock=lambda: 30.0) as view:
        view.progress({"progress/groups": 0.0, "progress/episodes": 0.0}, None, waiting="waiting for the engines")
        view.progress({"progress/groups": 1.0, "progress/episodes": 4.0}, None, waiting=None)
    first, second = out.getvalue().splitlines()
    assert first.endswith("| groups 0 | episodes 0 | waiting for the engines")
    assert "waiting" not in second


def test_a_warning_is_logged_when_it_starts_changes_or_has_lasted_repeat_s():
    w = Warnings(repeat_s=60.0)
    assert w.update("no progress: A; detail 1", now=0.0)
    assert not w.update("no progress: A; detail 2", now=30.0)  # the same warning, new detail: not again yet
    assert w.update("no progress: A; detail 3", now=60.0)  # lasted repeat_s: again
    assert w.update("no progress: B", now=61.0)  # another warning: at once
    assert not w.update(None, now=62.0) and w.current is None
    assert w.seen == ["no progress: A; detail 1", "no progress: A; detail 3", "no progress: B"]


class _QuietMonitor:
    """The RunMonitor readings a progress row takes: nothing verified, no group, no step yet."""

    recent: ClassVar[list] = []
    last_step_at = None

    def take_progress(self):
        return Window()

    def take_spans(self):
        return []


def test_the_recorder_writes_a_progress_row_and_shows_the_waiting_story(tmp_path, capsys):
    from configs import load_config
    from launch.observe.metrics import read_metrics
    from launch.observe.recorder import ProgressReadings, RunRecorder

    cfg = load_config(ROOT / "configs" / "default.yaml", ["logging.live=false", "logging.rollout_every_s=5"])
    recorder = RunRecorder(cfg, tmp_path, _QuietMonitor(), started=0.0, now=0.0)
    try:
        recorder.rollouts_started(0.0)
        assert not recorder.progress_due(4.0) and recorder.progress_due(5.0)
        start = StartReadings(engines=1, engines_serving=1, in_flight=2, at_verifier=2, verified=0)
        recorder.progress_row(5.0, ProgressReadings(counts=_counts(), decoded={"rollout-0": 100}, start=start))
        recorder.progress_row(10.0, ProgressReadings(counts=_counts(), decoded={"rollout-0": 40}, start=start))
    finally:
        recorder.close()
    rows = read_metrics(tmp_path)
    assert [r["progress/groups"] for r in rows] == [0.0, 0.0]
    assert rows[1]["progress/decoded_tokens_per_s"] == 8.0  # a restarted engine's counter (40 < 100) counts from 0
    assert "waiting for 2 attempts at the verifier; no verdict yet" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ end to end


def test_a_run_that_cannot_learn_reports_progress_warns_and_stops_with_a_report(
    tmp_path, tiny_chat_model, verifier_cache_dir, caplog, capsys, monkeypatch
):
    """The probe of a new user whose model never passes, CI-sized: `kiln train --config configs/default.yaml
    rollout.forced_candidates=null algo.total_steps=4` on the test-sized chat model, with short answers."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from configs import load_config
    from launch.driver.run_dir import RunDirectory
    from launch.driver.train import train
    from launch.observe.metrics import read_metrics

    monkeypatch.chdir(ROOT)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config(
        ROOT / "configs" / "default.yaml",
        [
            "rollout.forced_candidates=null",
            "rollout.max_new_tokens=48",
            "algo.total_steps=4",
            f"logging.root={tmp_path}",
            "logging.run_name=stuck",
            "logging.live=false",
            "cluster.use_ray=false",
            f"model.path={tiny_chat_model}",
            "model.max_seq_len=4096",
            f"verifier.cache_dir={verifier_cache_dir}",
            "logging.rollout_every_s=2",
            "logging.no_progress_groups=4",
            "logging.no_progress_s=600",
            "algo.stop_after_no_progress_s=20",
        ],
    )
    run = RunDirectory.create(cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="launch.observe.recorder"):
            report = train(cfg, run)
    finally:
        torch.set_num_threads(threads)

    rows = read_metrics(run.path)
    progress = [r for r in rows if "progress/elapsed_s" in r]
    assert not any("train/loss" in r for r in rows)  # no learner step: the progress rows came without one
    assert len(progress) >= 5 and progress[-1]["progress/groups"] >= 4
    last = progress[-1]
    assert last["progress/filtered/tied"] == last["progress/groups"]  # every group tied and was filtered
    assert last["progress/trainable"] == 0 and any(r.get("progress/verdict/extract", 0) > 0 for r in progress)
    assert any(r.get("progress/decoded_tokens_per_s", 0) > 0 for r in progress)  # the engine sampled
    tb = EventAccumulator(str(run.path / "tb"))
    tb.Reload()
    assert {"progress/groups", "progress/filtered/tied"} <= set(tb.Tags()["scalars"])

    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no progress:")]
    assert warnings, [r.getMessage() for r in caplog.records]
    assert "every attempt fails at extract: the model never writes a fenced code block" in warnings[0]
    assert "WARNING no progress: the last 4 groups all tied at reward -1.00" in capsys.readouterr().out  # live view

    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["stopped"] == "no progress (algo.stop_after_no_progress_s)" and summary["warnings"]
    assert summary["learner"]["step"] == 0 and summary["episodes"]["invariant_ok"]
    text = report.read_text()
    assert "| stopped early | no progress (algo.stop_after_no_progress_s) |" in text
    assert "## Warnings" in text and "(plots/progress.png)" in text and "| learner steps | none |" in text
    assert (run.path / "report.html").is_file() and (run.path / "final" / "config.json").is_file()
