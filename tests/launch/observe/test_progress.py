"""A run that cannot learn says so (launch/observe/progress.py, the driver's progress rows and warning):
rollout-side progress rows come with or without learner steps, a warning names why no group is
trainable and what helps, and `algo.stop_after_no_progress_s` ends such a run with its report."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from launch.driver.monitor import GroupOutcome, Window
from launch.observe.progress import NoProgressCheck, ProgressRows, ReplayCounts, outcome_story

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


# ------------------------------------------------------------------------------------ end to end


def test_a_run_that_cannot_learn_reports_progress_warns_and_stops_with_a_report(
    tmp_path, tiny_chat_model, verifier_cache_dir, caplog, capsys, monkeypatch
):
    """The probe of a new user whose model never passes, CI-sized: `kiln train --config configs/default.yaml
    rollout.forced_candidates=null algo.total_steps=4` on the test-sized chat model, with short answers."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from configs import load_config
    from launch.observe.metrics import read_metrics
    from launch.driver.run_dir import RunDirectory
    from launch.driver.train import train

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
        with caplog.at_level(logging.WARNING, logger="launch.driver.session"):
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
