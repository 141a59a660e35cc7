"""Buffered Dynamic Retry: admission, eviction, the probability p, and the retry life cycle through
the real replay actor (actors/buffer/retry_buffer.py, task_feed.py, state.py)."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from actors.base import RunContext
from actors.buffer import ReplayActor
from actors.buffer.retry_buffer import FailedAttempt, RetryBuffer
from actors.buffer.state import ReplayState
from actors.buffer.task_feed import TaskFeed
from actors.buffer.task_source import TaskSet
from configs import AlgoConfig, ReplayConfig
from configs.schema import RetryConfig
from protocols import BatchRequest, Task, TaskReply, TaskRequest
from tests.helpers.synthetic import TurnSpec, make_episode

TEXT = "actors.buffer.examples.TextMatchTasks"


def task(i: int) -> Task:
    return Task(task_id=f"t{i}", kind="text_match", payload={"prompt": str(i), "answer": str(i)})


def attempt(code: str, score: float = -1.0) -> FailedAttempt:
    return FailedAttempt(code=code, feedback=f"feedback on {code}", score=score)


# ------------------------------------------------------------------------------- the buffer alone


def test_admission_one_entry_per_task_and_fifo_eviction():
    buf = RetryBuffer(capacity=2, max_retries=3)
    assert buf.admit(task(1), attempt("a"), "g1")
    assert not buf.admit(task(1), attempt("b"), "g2")  # already buffered
    assert buf.admit(task(2), attempt("c"), "g3")
    assert buf.admit(task(3), attempt("d"), "g4")  # full: the oldest (t1) is evicted
    assert list(buf.waiting) == ["t2", "t3"]
    assert (buf.stats.admitted, buf.stats.evicted, buf.stats.skipped_duplicate) == (3, 1, 1)
    assert not RetryBuffer(capacity=0, max_retries=1).admit(task(1), attempt("a"), "g")  # capacity 0 = off


def test_repair_task_carries_failed_code_feedback_and_attempt():
    buf = RetryBuffer(capacity=4, max_retries=3)
    buf.admit(task(1), attempt("bad code", -0.6), "g7")
    rt = buf.take()
    assert rt.task_id == "t1" and rt.payload == task(1).payload
    assert (rt.repair.failed_code, rt.repair.feedback, rt.repair.attempt, rt.repair.origin_group) == (
        "bad code",
        "feedback on bad code",
        1,
        "g7",
    )
    assert len(buf) == 0 and "t1" in buf.in_flight and buf.holds("t1")
    assert not buf.admit(task(1), attempt("x"), "g8")  # in flight counts as held


def test_entry_leaves_on_success():
    buf = RetryBuffer(capacity=4, max_retries=3)
    buf.admit(task(1), attempt("a"), "g")
    buf.take()
    buf.resolve("t1", success=True, attempt=None)
    assert len(buf) == 0 and not buf.in_flight
    assert (buf.stats.successes, buf.stats.resolved) == (1, 1)
    assert buf.metrics(groups_served=4)["retry_success_rate"] == 1.0
    assert buf.metrics(groups_served=4)["retry_share"] == 0.25


def test_entry_leaves_after_max_retries_and_returns_with_newest_attempt_before():
    buf = RetryBuffer(capacity=4, max_retries=2)
    buf.admit(task(1), attempt("first"), "g")
    assert buf.take().repair.attempt == 1
    buf.resolve("t1", success=False, attempt=attempt("second"))
    assert len(buf) == 1  # back in the FIFO with the newer failure
    rt = buf.take()
    assert (rt.repair.attempt, rt.repair.failed_code) == (2, "second")
    buf.resolve("t1", success=False, attempt=attempt("third"))
    assert len(buf) == 0 and not buf.in_flight  # served max_retries times: gone
    assert (buf.stats.exhausted, buf.stats.successes, buf.stats.resolved) == (1, 0, 2)


# ------------------------------------------------------------------------------ the probability p


def feed_with_full_buffer(p: float, seed: int, n: int = 4000) -> tuple[TaskFeed, list[str]]:
    buf = RetryBuffer(capacity=n, max_retries=1)
    for i in range(n):
        buf.admit(task(1000 + i), attempt("x"), f"g{i}")
    feed = TaskFeed(TaskSet(train=[task(i) for i in range(10)], val=[]), buf, probability=p, seed=seed)
    return feed, [feed.next_train()[1] for _ in range(2000)]


@pytest.mark.parametrize("p", [0.0, 0.25, 1.0])
def test_feed_serves_a_repair_task_with_probability_p(p):
    _, sources = feed_with_full_buffer(p, seed=3)
    share = sources.count("retry") / len(sources)
    assert share == pytest.approx(p, abs=0.035)  # 2000 draws: 3.5 points is > 3 standard deviations
    assert set(sources) <= {"retry", "fresh"}


def test_p_draw_is_seeded_and_skipped_when_buffer_empty():
    assert feed_with_full_buffer(0.3, seed=5)[1] == feed_with_full_buffer(0.3, seed=5)[1]
    assert feed_with_full_buffer(0.3, seed=5)[1] != feed_with_full_buffer(0.3, seed=6)[1]
    feed = TaskFeed(TaskSet(train=[task(i) for i in range(3)], val=[]), RetryBuffer(4, 1), probability=1.0, seed=0)
    state = feed.rng.getstate()
    assert [feed.next_train()[1] for _ in range(5)] == ["fresh"] * 5
    assert feed.rng.getstate() == state


def test_fresh_tasks_visit_every_task_once_per_epoch_in_seeded_order():
    feed = TaskFeed(TaskSet(train=[task(i) for i in range(5)], val=[]), RetryBuffer(0, 1), 0.0, seed=1)
    epoch0 = [feed.next_train()[0].task_id for _ in range(5)]
    epoch1 = [feed.next_train()[0].task_id for _ in range(5)]
    assert sorted(epoch0) == sorted(epoch1) == [f"t{i}" for i in range(5)]
    assert epoch0 != epoch1  # reshuffled each epoch (for this seed)
    feed.reissue(task(9))
    assert feed.next_train() == (task(9), "reissue")  # re-issued tasks come first


# ------------------------------------------------------------------------- through the replay actor


@pytest.fixture
def actor(tmp_path):
    replay = ReplayConfig(
        task_source=TEXT,
        val_fraction=0.0,
        retry=RetryConfig(capacity=8, probability=1.0, max_retries=2),
    )
    algo = AlgoConfig(group_size=2, batch_groups=1, total_steps=50, max_staleness=4)
    a = ReplayActor(replay, algo, RunContext(run_dir=str(tmp_path)))
    yield a
    a.stop()


def run_group(actor, turns_per_sample):
    reply = actor.handle(TaskRequest(actor_id="r"))
    assert reply.status == "task"
    for i, turns in enumerate(turns_per_sample):
        assert actor.handle(make_episode(reply.task, reply.group_id, i, turns)).status == "stored"
    return reply


def test_all_failed_group_is_retried_with_its_best_attempt_until_success(actor):
    fail = [[TurnSpec(score=-1.0, text="worse")], [TurnSpec(score=-0.7, text="best", feedback="shape mismatch")]]
    fresh = run_group(actor, fail)
    assert fresh.task.repair is None
    assert actor.health().retry.size == 1
    retry = run_group(actor, [[TurnSpec(score=-1.0)], [TurnSpec(score=-1.0)]])  # p = 1: served from the buffer
    assert retry.task.task_id == fresh.task.task_id
    assert (retry.task.repair.failed_code, retry.task.repair.feedback) == ("best", "shape mismatch")
    assert retry.task.repair.attempt == 1 and retry.task.repair.origin_group == fresh.group_id
    # all tied at -1: not trained, but still a failed retry -> back in the buffer, attempt 2 next
    h = actor.health()
    assert h.retry.size == 1 and h.filtered == {"tied": 2}
    again = run_group(actor, [[TurnSpec(passed=True, score=1.0)], [TurnSpec(score=-1.0)]])
    assert again.task.repair.attempt == 2
    h = actor.health()
    # kept, it waits for a batch: its entry stays in flight until it is trained (it could still be
    # filtered as stale and re-issued with this repair context)
    assert (h.retry.size, h.retry.in_flight, h.retry.successes, h.retry.resolved) == (0, 1, 0, 1)
    assert h.retry.retry_share == pytest.approx(2 / 3)
    assert h.groups.ready == 2  # the first (fresh, untied) group and the successful retry
    batch = actor.handle(BatchRequest(learner_id="l", version=0)).batch
    assert len(batch.episode_ids) == 2
    assert actor.health().groups.trained == 1 and actor.health().groups.retry_trained == 0  # the fresh group
    assert actor.handle(BatchRequest(learner_id="l", version=1)).status == "batch"
    h = actor.health()
    assert h.groups.retry_trained == 1  # served; its entry resolves once the step on it finished
    assert (h.retry.in_flight, h.retry.resolved) == (1, 1)
    actor.handle(BatchRequest(learner_id="l", version=2))  # the learner moved on: that step finished
    h = actor.health()
    assert (h.retry.size, h.retry.in_flight, h.retry.successes, h.retry.resolved) == (0, 0, 1, 2)
    assert h.retry.retry_success_rate == 0.5


def test_retry_mismatched_episode_is_rejected(actor):
    fresh = run_group(actor, [[TurnSpec(score=-1.0)], [TurnSpec(score=-0.6)]])
    retry = actor.handle(TaskRequest(actor_id="r"))
    assert retry.task.repair is not None
    plain = dataclasses.replace(retry.task, repair=None)  # a rollout that dropped the repair context
    ack = actor.handle(make_episode(plain, retry.group_id, 0, [TurnSpec()]))
    assert ack.status == "rejected" and "repair" in ack.reason
    assert actor.health().rejected_by_reason == {"retry_mismatch": 1}
    assert fresh.group_id != retry.group_id


# ---------------------------------------------------- one repair group per entry, through ReplayState


def bdr_state(*, max_staleness: int = 1) -> ReplayState:
    """A replay state that serves a repair task whenever the buffer holds one (p = 1), B = 1."""
    replay = ReplayConfig(val_fraction=0.0, retry=RetryConfig(capacity=8, probability=1.0, max_retries=3))
    algo = AlgoConfig(group_size=2, batch_groups=1, total_steps=50, max_staleness=max_staleness)
    return ReplayState(replay, algo, TaskSet(train=[task(i) for i in range(4)], val=[]))


def open_group(state: ReplayState) -> TaskReply:
    reply, opened = state.on_task_request(TaskRequest(actor_id="r"), now=0.0)
    assert opened and reply.status == "task"
    return reply


def deliver(state: ReplayState, reply: TaskReply, scores: list[float], *, version: int = 0) -> None:
    for i, score in enumerate(scores):
        spec = TurnSpec(passed=score >= 1.0, score=score, version=version, text=f"code {score:g}")
        ack, _ = state.on_episode(make_episode(reply.task, reply.group_id, i, [spec]), now=0.0)
        assert ack.status == "stored"


def repair_groups_out(state: ReplayState) -> collections.Counter[str]:
    """Repair groups of each task that are outstanding: running, waiting for a batch, or queued to be
    re-issued (a queued re-issue is a repair group already decided on)."""
    groups = [g.task for g in (*state.running.values(), *state.ready.values())]
    return collections.Counter(t.task_id for t in [*groups, *state.feed.reissued] if t.repair is not None)


def test_a_stale_repair_group_is_never_served_beside_its_entry():
    """A repair group that completed (failed, untied: it waits for a batch) and is then filtered as stale
    is re-issued with its repair context. Its entry must not be served again meanwhile: one task, one
    repair group at a time (docs/replay.md, "never served twice at once")."""
    state = bdr_state(max_staleness=1)
    fresh = open_group(state)
    deliver(state, fresh, [-1.0, -0.7])  # all failed, untied: trained, and its task enters the buffer
    repair = open_group(state)  # p = 1: the repair task
    assert repair.task.task_id == fresh.task.task_id and repair.task.repair is not None
    deliver(state, repair, [-1.0, -0.8])  # the repair fails again, untied: it waits for a batch
    assert state.on_batch_request(BatchRequest(learner_id="l", version=0))[0].status == "batch"  # the fresh group
    # version 3 after one step (a rollback skipped versions 1 and 2): the repair group lags 3 > η = 1
    reply, _ = state.on_batch_request(BatchRequest(learner_id="l", version=3, step=1))
    assert reply.status == "wait" and state.counters.groups_filtered == {"stale": 1}
    assert repair_groups_out(state) == {repair.task.task_id: 1}
    again = open_group(state)
    assert again.task == repair.task  # the re-issue: the same repair context, its entry still in flight
    # the window's other group (η = 1: two may run): the entry is not served beside the re-issue
    assert open_group(state).task.repair is None
    assert repair_groups_out(state) == {repair.task.task_id: 1}
    deliver(state, again, [1.0, -1.0], version=3)  # the re-issued repair passes and is trained
    assert state.on_batch_request(BatchRequest(learner_id="l", version=3, step=1))[0].status == "batch"
    state.on_batch_request(BatchRequest(learner_id="l", version=4, step=2))  # that step finished
    stats = state.retry.stats  # one entry, served once, resolved once: by the group that was trained
    assert (stats.served, stats.resolved, stats.successes) == (1, 1, 1) and not state.retry.holds(repair.task.task_id)
    assert state.feed.served == {"fresh": 2, "retry": 1, "reissue": 1}
