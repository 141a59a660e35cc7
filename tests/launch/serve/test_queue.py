"""The service's fair queue and dispatcher (launch/serve/queue.py, dispatch.py): round robin between
clients, the bounds, deadlines, and a verifier's death retried once then charged to the candidate."""

from __future__ import annotations

import threading
import time

import pytest

from launch.serve.dispatch import Dispatcher, WorkerDied
from launch.serve.queue import FairQueue, Job, JobState, QueueFull
from protocols import Task, VerifyRequest, VerifyResult


def job(job_id: str, client: str, now: float = 0.0, deadline: float = 100.0) -> Job:
    task = Task(task_id="t", kind="text", payload={})
    return Job(job_id, client, VerifyRequest(request_id=job_id, task=task, candidate=job_id), now, deadline)


def test_clients_are_served_in_turn_whatever_each_has_queued():
    # Mutation: serve the FIFO of the first client until empty (no rotation) -> a's 5 come first.
    q = FairQueue(capacity=20, per_client=10)
    for i in range(5):
        q.admit(job(f"a{i}", "a"))
    q.admit(job("b0", "b"))
    q.admit(job("c0", "c"))
    q.admit(job("b1", "b"))
    order = [q.take(0.0).job_id for _ in range(8)]
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]
    assert q.take(0.0) is None and q.depth == 0


def test_the_queue_and_each_clients_share_are_bounded():
    q = FairQueue(capacity=3, per_client=2)
    q.admit(job("a0", "a"))
    q.admit(job("a1", "a"))
    with pytest.raises(QueueFull, match="its share"):
        q.admit(job("a2", "a"))
    q.admit(job("b0", "b"))
    with pytest.raises(QueueFull, match="queue is full"):
        q.admit(job("c0", "c"))
    q.take(0.0)  # a running job no longer counts as waiting
    q.admit(job("c0", "c"))


def test_a_job_past_its_deadline_expires_queued_or_running():
    q = FairQueue(capacity=5, per_client=5)
    q.admit(job("run", "a", deadline=10.0))
    q.admit(job("wait", "b", deadline=5.0))
    running = q.take(1.0)
    assert running.job_id == "run"
    assert [j.job_id for j in q.expire(6.0)] == ["wait"] and q.depth == 0 and q.take(6.0) is None
    assert [j.job_id for j in q.expire(10.0)] == ["run"] and running.state is JobState.EXPIRED
    assert "deadline passed (10 s)" in running.why
    late = VerifyResult(request_id="run", task_id="t", passed=True, stage="done", error_class=None, q=1.0, score=1.0)
    assert not q.finish(running, late, 11.0)  # a verdict after the deadline is not the answer
    q.forget(now=100.0, keep_s=50.0)
    assert not q.jobs


def test_a_job_whose_verifier_died_goes_first_in_its_clients_turn_once():
    q = FairQueue(capacity=5, per_client=5)
    q.admit(job("a0", "a"))
    q.admit(job("a1", "a"))
    q.admit(job("b0", "b"))
    died = q.take(0.0)
    assert q.retry(died) and died.state is JobState.QUEUED
    assert q.take(0.0) is not None  # b0: the rotation went on to the next client
    again = q.take(0.0)
    assert again is died and again.attempts == 2
    assert not q.retry(again)  # the second death is final: the dispatcher answers it


class DyingVerifiers:
    """A pool whose verifier dies under every job of the candidate 'kills', and answers the others."""

    workers = 2

    def __init__(self) -> None:
        self.calls: list[str] = []

    def verify(self, request: VerifyRequest, timeout_s: float) -> VerifyResult:
        self.calls.append(request.candidate)
        if request.candidate == "kills":
            raise WorkerDied("the actor's process ended")
        return VerifyResult(
            request_id=request.request_id, task_id="t", passed=True, stage="done", error_class=None, q=1.0, score=1.0
        )

    def live(self) -> int:
        return 2

    def close(self) -> None:
        pass


def test_a_verifier_death_is_retried_once_then_charged_to_the_candidate():
    # Mutation: answer a second death `infra` (score 0) -> a candidate that kills verifiers buys 0, not -1.
    pool = DyingVerifiers()
    dispatcher = Dispatcher(FairQueue(10, 10), pool)
    try:
        killer, honest = (
            job("kills", "a", time.monotonic(), time.monotonic() + 30),
            job("ok", "b", time.monotonic(), time.monotonic() + 30),
        )
        dispatcher.submit(killer)
        dispatcher.submit(honest)
        assert dispatcher.wait(killer, 10) and dispatcher.wait(honest, 10)
        assert pool.calls.count("kills") == 2  # tried twice, never a third time
        r = killer.result
        assert (r.passed, r.error_class, r.score, r.stage) == (False, "runtime", -1.0, "run")
        assert "died twice" in r.feedback
        assert honest.result.passed
        snap = dispatcher.snapshot()
        assert snap["retried"] == 1 and snap["verdicts"] == {"runtime": 1, "pass": 1}
    finally:
        dispatcher.close()


def test_the_deadline_is_answered_while_the_verifier_still_works():
    release = threading.Event()

    class Slow(DyingVerifiers):
        def verify(self, request, timeout_s):
            release.wait(10)
            return super().verify(request, timeout_s)

    dispatcher = Dispatcher(FairQueue(10, 10), Slow())
    try:
        now = time.monotonic()
        late = job("slow", "a", now, now + 0.3)
        dispatcher.submit(late)
        started = time.monotonic()
        assert dispatcher.wait(late, 5)
        assert late.state is JobState.EXPIRED and time.monotonic() - started < 2.0
        release.set()
        time.sleep(0.2)
        assert late.state is JobState.EXPIRED and late.result is None  # the late verdict did not replace it
        assert dispatcher.snapshot()["verdicts"] == {"timeout": 1}
    finally:
        release.set()
        dispatcher.close()
