"""The service's queue: jobs of many clients, served fairly, bounded, each with its deadline. A pure
state machine: no threads, sockets or clocks; the caller passes `now` (the dispatcher, dispatch.py).

Fairness is round robin over clients (a client is a token, auth.py): each client has its own FIFO,
and `take` serves the client after the one it served last, so a client with a thousand jobs queued
delays another's next job by at most one job per other client. The bound is on the whole queue
(`capacity`, answered 429 when full) and on each client's share of it (`per_client`): one client
cannot fill the queue and lock the others out.

A job's life: queued -> running -> done, or -> expired when its deadline passes first (queued:
dropped from its FIFO; running: its work is cancelled by the dispatcher). A running job whose worker
died goes back to the front of its client's FIFO once (`retry`); the second death is final and the
dispatcher answers it as the candidate's (`runtime`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from enum import Enum

from protocols import VerifyRequest, VerifyResult


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    EXPIRED = "expired"


@dataclass
class Job:
    job_id: str
    client: str  # the token's name (auth.py): the unit of fairness
    request: VerifyRequest
    submitted: float  # the caller's clock
    deadline: float  # same clock: past it, the job expires
    state: JobState = JobState.QUEUED
    attempts: int = 0  # times a worker took it
    started: float | None = None
    finished: float | None = None
    result: VerifyResult | None = None
    why: str = ""  # an expired job's one line
    tags: dict = field(default_factory=dict)  # what the endpoint that made it reports back (kernelgym.py)

    @property
    def ended(self) -> bool:
        return self.state in (JobState.DONE, JobState.EXPIRED)


class QueueFull(Exception):
    """The queue (or this client's share of it) is full: the caller answers 429 with Retry-After."""


class FairQueue:
    def __init__(self, capacity: int, per_client: int) -> None:
        self.capacity = capacity
        self.per_client = per_client
        self._fifos: dict[str, collections.deque[Job]] = {}
        self._turn: collections.deque[str] = collections.deque()  # clients with queued jobs, in serving order
        self.jobs: dict[str, Job] = {}  # every job not yet forgotten, by id

    @property
    def depth(self) -> int:
        """Jobs waiting for a worker."""
        return sum(len(f) for f in self._fifos.values())

    def running(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state is JobState.RUNNING]

    def admit(self, job: Job) -> None:
        """Queue `job`, or raise QueueFull."""
        if self.depth >= self.capacity:
            raise QueueFull(f"the queue is full ({self.capacity} jobs waiting)")
        fifo = self._fifos.get(job.client)
        if fifo is not None and len(fifo) >= self.per_client:
            raise QueueFull(f"this client has {self.per_client} jobs waiting, its share of the queue")
        if fifo is None:
            fifo = self._fifos[job.client] = collections.deque()
        if not fifo:
            self._turn.append(job.client)
        fifo.append(job)
        self.jobs[job.job_id] = job

    def take(self, now: float) -> Job | None:
        """The next job to run (round robin over clients), marked running; None if none waits. Jobs
        past their deadline are expired on the way."""
        self.expire(now)
        while self._turn:
            client = self._turn.popleft()
            fifo = self._fifos[client]
            job = fifo.popleft()
            if fifo:
                self._turn.append(client)  # its next job waits for every other client's turn
            else:
                del self._fifos[client]
            job.state, job.started = JobState.RUNNING, now
            job.attempts += 1
            return job
        return None

    def retry(self, job: Job) -> bool:
        """A running job whose worker died: queued again at the front of its client's FIFO, once.
        False when it had its retry already (the dispatcher then answers it)."""
        if job.state is not JobState.RUNNING or job.attempts >= 2:
            return False
        job.state = JobState.QUEUED
        fifo = self._fifos.get(job.client)
        if fifo is None:
            fifo = self._fifos[job.client] = collections.deque()
            self._turn.appendleft(job.client)
        fifo.appendleft(job)
        return True

    def finish(self, job: Job, result: VerifyResult, now: float) -> bool:
        """A worker's answer. False (and ignored) when the job had already expired."""
        if job.state is not JobState.RUNNING:
            return False
        job.state, job.result, job.finished = JobState.DONE, result, now
        return True

    def expire(self, now: float) -> list[Job]:
        """Every job past its deadline, queued or running, marked expired; returns them (the
        dispatcher cancels the running ones' work)."""
        late = [j for j in self.jobs.values() if not j.ended and now >= j.deadline]
        for job in late:
            if job.state is JobState.QUEUED:
                fifo = self._fifos[job.client]
                fifo.remove(job)
                if not fifo:
                    del self._fifos[job.client]
                    self._turn.remove(job.client)
            job.state, job.finished = JobState.EXPIRED, now
            job.why = f"the deadline passed ({job.deadline - job.submitted:.3g} s) before a verdict"
        return late

    def forget(self, now: float, keep_s: float) -> None:
        """Drop ended jobs older than `keep_s` (their results were there to be fetched)."""
        for job_id in [k for k, j in self.jobs.items() if j.ended and now - (j.finished or now) > keep_s]:
            del self.jobs[job_id]
