"""A learner restore that rolled versions back, as replay's books see it: samples of the lost versions are
filtered `rolled_back`, the batch whose step the rollback lost comes back and is judged again, the
admission window and the run's end count the steps in the weights' history, not version numbers."""

from __future__ import annotations

from actors.buffer.state import ReplayState
from actors.buffer.task_source import TaskSet
from configs import AlgoConfig, ReplayConfig
from protocols import BatchRequest
from tests.buffer.test_retry import deliver, open_group, task


def state(total_steps: int = 10) -> ReplayState:
    """B = 1, G = 2, η = 1, no retries: one group per batch."""
    replay = ReplayConfig(val_fraction=0.0)
    replay.retry.probability = 0.0
    algo = AlgoConfig(group_size=2, batch_groups=1, total_steps=total_steps, max_staleness=1)
    return ReplayState(replay, algo, TaskSet(train=[task(i) for i in range(4)], val=[]))


def batch(s: ReplayState, version: int, *, step: int = -1, discarded_above: int = -1):
    reply, _ = s.on_batch_request(
        BatchRequest(learner_id="l", version=version, step=step, discarded_above=discarded_above)
    )
    return reply


def test_the_batch_of_a_step_the_rollback_lost_comes_back_and_what_lost_versions_made_is_filtered():
    s = state()
    first = open_group(s)
    deliver(s, first, [-1.0, 0.0], version=0)
    assert batch(s, 0).status == "batch"  # step 1 on it; the learner announces version 1
    second = open_group(s)
    deliver(s, second, [-1.0, 0.0], version=1)  # made by version 1
    served = batch(s, 1)
    assert served.status == "batch" and s.counters.batches == 2
    # The learner dies mid-step 2 with its last checkpoint at version 0 (step 0); version 1 was announced.
    # Its restore continues at version 2 and rolls (0, 2) back: step 2's batch was served at 2 - 1.
    reply = batch(s, 2, step=0, discarded_above=0)
    assert reply.status == "wait"
    assert s.counters.batches == 1 and s.counters.groups_trained == 1  # step 2's serving undone
    assert s.counters.groups_filtered == {"rolled_back": 1}  # version 1 made it: rolled back
    ids = s.ledger_ids()
    assert len(ids.filtered["rolled_back"]) == 2 and not ids.filtered["rolled_back"] & ids.trained
    assert len(ids.trained) == 2 and not ids.pending  # step 1's group stays trained: that step finished
    assert s.ledger.summary()["invariant_ok"]
    # The window counts the steps in the weights' history (0), not version 2: (η + 0 + 1)·B = 2 groups
    assert s.learner_step == 0 and s.admission_bound == 2


def test_the_run_ends_at_total_steps_of_learning_not_at_a_version_number():
    s = state(total_steps=3)
    assert batch(s, 5, step=2).status == "wait"  # version 5 after a rollback, two steps in its history
    assert batch(s, 6, step=3).status == "stop"


def test_after_the_rollback_the_restored_learner_s_own_steps_are_kept():
    s = state()
    g = open_group(s)
    deliver(s, g, [-1.0, 0.0], version=0)
    assert batch(s, 0).status == "batch"
    batch(s, 2, step=0, discarded_above=0)  # a restore rolled version 1 back (no group of it here)
    fresh = open_group(s)
    deliver(s, fresh, [-1.0, 0.0], version=2)  # made by the restored learner's version 2
    assert batch(s, 2, step=0).status == "batch"  # the learner sends the range once: replay logged it
    assert batch(s, 3, step=1).status == "wait"  # step 1 on it finished: it stays trained
    assert (
        s.discarded == [(0, 2)] and s.counters.groups_trained == 2 and "rolled_back" not in s.counters.groups_filtered
    )
