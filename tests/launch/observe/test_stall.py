"""The stall watchdog: when it fires (a pure clock rule) and what it says (from health records alone),
including the hang a resumed run once met: replay's admission window full of an earlier session's
groups, no rollout actor with anything in flight. End to end, a run whose learner never gets a batch
names that wait and dumps every actor's state."""

from __future__ import annotations

import dataclasses
import json

from actors.buffer.health import Admission, GroupCounts, ReplayHealth
from actors.buffer.state import ReplayState
from actors.learner.health import LearnerHealth
from actors.rollout.health import RolloutHealth, WeightSyncHealth
from actors.verifier.health import VerifierHealth
from launch.driver.train import train
from launch.observe.stall import MIN_STALL_S, Readings, StallWatch, diagnose
from protocols import BatchReply
from tests.launch.driver.test_train import text_match


def test_it_fires_once_per_stall_after_factor_times_the_median_step_interval():
    watch = StallWatch(factor=5.0, first_step_s=100.0, since=0.0)
    assert not watch.due(99.0) and watch.due(100.0) and not watch.due(500.0)  # before two steps: first_step_s
    for t in (200.0, 210.0, 220.0, 250.0):  # intervals 10, 10, 30: median 10, so a stall is 50 s without a step
        watch.step(t)
    assert watch.limit_s() == 50.0
    assert not watch.due(299.0) and watch.due(300.0) and not watch.due(400.0)
    watch.step(401.0)  # a step re-arms it
    assert watch.due(401.0 + watch.limit_s())
    fast = StallWatch(factor=5.0, first_step_s=100.0, since=0.0, steps=[0.0, 0.2, 0.4])
    assert fast.limit_s() == MIN_STALL_S  # a restart's seconds between sub-second steps are no stall


def readings(
    *, ready=0, running=0, admitted=4, limit=8, window=8, inflight=(0,), at_verifier=0, asking=True, engine_version=3
) -> Readings:
    return Readings(
        learner=LearnerHealth(role="learner", alive=True, version=3, step=3, batch_waits=40),
        replay=ReplayHealth(
            role="replay",
            alive=True,
            learner_version=3,
            groups=GroupCounts(ready=ready, running=running),
            admission=Admission(admitted=admitted, limit=limit, running=running, window=window),
        ),
        rollouts={
            f"rollout-{i}": RolloutHealth(
                role="rollout", alive=True, inflight=n, weights=WeightSyncHealth(version=engine_version)
            )
            for i, n in enumerate(inflight)
        },
        verifiers={"verifier-0": VerifierHealth(role="verifier", alive=True, received=10 + at_verifier, replied=10)},
        batch_groups=2,
        learner_asking=asking,
    )


def test_each_stuck_stage_is_named():
    say = diagnose
    assert "has not asked for a batch since its last step" in say(readings(asking=False), 60)
    # the measured hang: the bound full of groups no live actor works on
    held = say(readings(running=4, admitted=8, limit=8, window=4), 1200)
    assert held.startswith("no learner step for 1200 s: the learner waits for a batch at version 3: replay has 0 of")
    assert "admits no new group (the staleness window is full: 4 of 4 running, 8 groups of the bound's 8" in held
    assert "its 4 running group(s) are held while no rollout actor has an attempt in flight" in held
    assert "wait for verdicts: 5 of their 6 attempts in flight are at the verifiers" in say(
        readings(running=2, inflight=(6,), at_verifier=5), 60
    )
    assert "the engines wait for weights: rollout-0 serves version 1" in say(readings(engine_version=1), 60)
    assert "2 attempt(s) are generating" in say(readings(inflight=(2,)), 60)
    assert "the learner does not answer" in say(dataclasses.replace(readings(), learner=None), 60)


def test_a_run_whose_learner_never_gets_a_batch_names_the_wait_and_dumps_the_states(tmp_path, monkeypatch):
    monkeypatch.setattr(
        ReplayState, "on_batch_request", lambda self, req: (BatchReply(status="wait", retry_after_s=0.2), False)
    )
    cfg, run = text_match(
        tmp_path,
        "stall",
        "cluster.use_ray=false",
        "logging.stall_first_step_s=3",
        "algo.stop_after_no_progress_s=8",
        "algo.total_steps=3",
    )
    train(cfg, run)
    summary = json.loads((run.path / "summary.json").read_text())
    stalls = [w for w in summary["warnings"] if w.startswith("stall: ")]
    assert len(stalls) == 1 and "the learner waits for a batch at version 0: replay has" in stalls[0], stalls
    dump = json.loads((run.path / "logs" / "stall-001.json").read_text())
    assert dump["diagnosis"] in stalls[0] and dump["learner"]["version"] == 0 and "rollout-0" in dump["rollouts"]
