"""The service's workers: they take jobs from the fair queue (queue.py) and run them on the verifier
pool (`Verifiers`), one job a worker, each within its deadline.

A worker that dies mid-job (`WorkerDied`: a Ray verifier actor killed, an in-process reward actor that
raised out of its guard) loses nothing: the job goes back to the front of its client's queue and is
retried once, elsewhere if the pool has another verifier. A second death is the candidate's: it is
answered `runtime` (score -1), so a candidate cannot take down the fleet, nor buy the neutral score
(`infra`, 0) that way. A job past its deadline is answered with its one line the moment it passes,
whatever its worker is doing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from launch.serve.queue import FairQueue, Job, JobState
from protocols import VerifyRequest, VerifyResult, infra_result

log = logging.getLogger(__name__)

# Latency histogram bounds (seconds) of the service's /metrics.
LATENCY_BOUNDS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class WorkerDied(RuntimeError):
    """The verifier running a job died before answering it."""


class Verifiers(Protocol):
    """The verifier pool behind the service (verifiers.py): in-process or Ray actors."""

    workers: int  # jobs it runs at once

    def verify(self, request: VerifyRequest, timeout_s: float) -> VerifyResult: ...  # WorkerDied
    def cancel(self, request_id: str) -> None: ...  # end that call's work: nobody waits for it any more
    def close(self) -> None: ...


def died_twice(job: Job, why: str) -> VerifyResult:
    """A job whose verifier died on both tries: the candidate's doing, `runtime` at -1."""
    return VerifyResult(
        request_id=job.request.request_id,
        task_id=job.request.task.task_id,
        passed=False,
        stage="run",
        error_class="runtime",
        q=0.0,
        score=-1.0,
        feedback=f"the verifier running this candidate died twice, on two verifiers ({why})",
    )


class Dispatcher:
    def __init__(
        self, queue: FairQueue, verifiers: Verifiers, clock: Callable[[], float] = time.monotonic, keep_s: float = 900.0
    ) -> None:
        self.queue = queue
        self.verifiers = verifiers
        self.clock = clock
        self.keep_s = keep_s  # how long an ended job's result can still be fetched
        self.lock = threading.Condition()
        self.stopping = False
        self.busy = 0
        self.verdicts: dict[str, int] = {}  # answered jobs by verdict class (pass, error classes, timeout)
        self.latency = [0] * (len(LATENCY_BOUNDS) + 1)
        self.latency_sum = 0.0
        self.retried = 0
        self.cancelled = 0  # running jobs whose work was cancelled at their deadline
        self._threads = [
            threading.Thread(target=self._work, name=f"serve-worker{i}", daemon=True) for i in range(verifiers.workers)
        ]
        self._threads.append(threading.Thread(target=self._watch, name="serve-deadlines", daemon=True))
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> None:
        """Queue a job (QueueFull propagates: the caller answers 429)."""
        with self.lock:
            self.queue.admit(job)
            self.lock.notify_all()

    def wait(self, job: Job, timeout_s: float) -> bool:
        """Block until `job` ends or `timeout_s` passes; whether it ended."""
        end = time.monotonic() + timeout_s
        with self.lock:
            while not job.ended:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(min(left, 0.5))
            return True

    def get(self, job_id: str) -> Job | None:
        with self.lock:
            return self.queue.jobs.get(job_id)

    def close(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    def _work(self) -> None:
        while True:
            with self.lock:
                job = None
                while not self.stopping and (job := self.queue.take(self.clock())) is None:
                    self.lock.wait(0.5)
                if self.stopping:
                    return
                self.busy += 1
            try:
                result = self.verifiers.verify(job.request, max(job.deadline - self.clock(), 0.1))
            except WorkerDied as err:
                with self.lock:
                    if self.queue.retry(job):
                        self.busy -= 1
                        self.retried += 1
                        log.warning("serve: the verifier of job %s died (%s); retried once", job.job_id, err)
                        self.lock.notify_all()
                        continue
                result = died_twice(job, str(err))
            except Exception as err:
                log.exception("serve: job %s failed in the verifier pool", job.job_id)
                result = infra_result(job.request, f"the verifier pool failed: {type(err).__name__}: {err}"[:300])
            with self.lock:
                self.busy -= 1
                now = self.clock()
                if self.queue.finish(job, result, now):
                    self._count(job, "pass" if result.passed else str(result.error_class), now)
                self.lock.notify_all()

    def _watch(self) -> None:
        """Deadlines, answered as they pass (a queued job or a running one, whose verifier is then told
        to cancel its work), and old results dropped."""
        while True:
            with self.lock:
                if self.stopping:
                    return
                now = self.clock()
                running = {job.job_id for job in self.queue.running()}
                late = self.queue.expire(now)
                for job in late:
                    self._count(job, "timeout", now)
                self.queue.forget(now, self.keep_s)
                self.lock.notify_all()
            for job in late:  # outside the lock: a Ray actor's call, a sandbox killed
                if job.job_id in running:
                    self._cancel(job)
            with self.lock:
                if not self.stopping:
                    self.lock.wait(0.2)

    def _cancel(self, job: Job) -> None:
        try:
            self.verifiers.cancel(job.request.request_id)
        except Exception:  # a verifier that cannot cancel finishes the work; nobody waits for it
            log.exception("serve: cancelling job %s failed", job.job_id)
            return
        with self.lock:
            self.cancelled += 1

    def _count(self, job: Job, verdict: str, now: float) -> None:
        self.verdicts[verdict] = self.verdicts.get(verdict, 0) + 1
        seconds = now - job.submitted
        self.latency_sum += seconds
        self.latency[next((i for i, b in enumerate(LATENCY_BOUNDS) if seconds <= b), len(LATENCY_BOUNDS))] += 1

    def snapshot(self) -> dict:
        """The figures /metrics and /health report."""
        with self.lock:
            return {
                "queued": self.queue.depth,
                "running": len(self.queue.running()),
                "busy_workers": self.busy,
                "workers": self.verifiers.workers,
                "verdicts": dict(self.verdicts),
                "latency": list(self.latency),
                "latency_sum": self.latency_sum,
                "retried": self.retried,
                "cancelled": self.cancelled,
                "state_counts": {s.value: sum(j.state is s for j in self.queue.jobs.values()) for s in JobState},
            }
