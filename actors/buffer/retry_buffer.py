"""Buffered Dynamic Retry (docs/replay.md): a bounded FIFO of tasks whose whole group failed.

An entry holds the task, the group's best failed attempt (the highest-scoring failed turn) and the
verifier's feedback on it. The task feed takes an entry with probability p and serves it as a
feedback-conditioned repair task (`Task.repair`); the entry is in flight until that retry group's
fate is final (trained, or filtered without re-issue; a group filtered as infra, stale, made by
discarded weights or expired is re-issued with the same repair context and keeps the entry in flight),
so the same entry is never served twice at once. When the retry group is resolved:
* any sample passed -> the entry leaves (a retry success);
* all failed and the entry has been served `max_retries` times -> the entry leaves (exhausted);
* otherwise it goes back to the end of the FIFO with the newest failed attempt and feedback.
A full buffer evicts its oldest waiting entry. One entry per task id: a task already waiting or in
flight is not admitted twice.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

import protocols
from protocols import RepairContext, Task


@dataclass
class FailedAttempt:
    """The best failed turn of a group: its response text and the verifier feedback on it."""

    code: str
    feedback: str
    score: float


@dataclass
class RetryEntry:
    task: Task  # the original task (repair is None)
    attempt: FailedAttempt
    origin_group: str
    served: int = 0  # retry groups served from this entry so far


@dataclass
class RetryStats:
    admitted: int = 0
    served: int = 0  # repair tasks handed out
    resolved: int = 0  # retry groups whose fate is final (success or not): trained, or filtered for good
    successes: int = 0
    exhausted: int = 0  # entries that left after max_retries unsuccessful retries
    evicted: int = 0  # entries pushed out by a full buffer
    skipped_duplicate: int = 0  # admissions refused because the task already had an entry
    dropped: int = 0  # entries removed because their task left the feed


class RetryBuffer:
    def __init__(self, capacity: int, max_retries: int) -> None:
        self.capacity = capacity
        self.max_retries = max_retries
        self.waiting: collections.OrderedDict[str, RetryEntry] = collections.OrderedDict()  # FIFO by task id
        self.in_flight: dict[str, RetryEntry] = {}
        self.stats = RetryStats()

    def __len__(self) -> int:
        return len(self.waiting)

    def holds(self, task_id: str) -> bool:
        return task_id in self.in_flight or task_id in self.waiting

    def admit(self, task: Task, attempt: FailedAttempt, origin_group: str) -> bool:
        """Buffer an all-failed group's task. Returns False when it was not admitted."""
        if self.capacity == 0:
            return False
        if self.holds(task.task_id):
            self.stats.skipped_duplicate += 1
            return False
        self._append(
            RetryEntry(task=dataclasses.replace(task, repair=None), attempt=attempt, origin_group=origin_group)
        )
        self.stats.admitted += 1
        return True

    def take(self) -> Task:
        """Serve the oldest entry as a repair task; the entry is in flight until `resolve`."""
        _, entry = self.waiting.popitem(last=False)
        entry.served += 1
        self.in_flight[entry.task.task_id] = entry
        self.stats.served += 1
        return repair_task(entry)

    def resolve(self, task_id: str, success: bool, attempt: FailedAttempt | None) -> None:
        """A retry group of `task_id` reached its final fate (trained, or filtered without re-issue).
        `attempt` is its best failed turn when all failed."""
        entry = self.in_flight.pop(task_id, None)
        if entry is None:  # defensive: its entry was already resolved; nothing to account
            return
        self.stats.resolved += 1
        if success:
            self.stats.successes += 1
        elif entry.served >= self.max_retries:
            self.stats.exhausted += 1
        else:
            if attempt is not None:
                entry.attempt = attempt
            self._append(entry)

    def forget(self, task_id: str) -> bool:
        """Remove the task's entry, waiting or in flight (its task left the feed); False if it had none."""
        entry = self.waiting.pop(task_id, None) or self.in_flight.pop(task_id, None)
        if entry is not None:
            self.stats.dropped += 1
        return entry is not None

    def _append(self, entry: RetryEntry) -> None:
        if len(self.waiting) >= self.capacity:
            self.waiting.popitem(last=False)
            self.stats.evicted += 1
        self.waiting[entry.task.task_id] = entry

    def dump(self) -> dict:
        """Plain data for the replay snapshot (tasks as encoded records)."""
        return {
            "waiting": [_dump_entry(e) for e in self.waiting.values()],
            "in_flight": [_dump_entry(e) for e in self.in_flight.values()],
            "stats": dataclasses.asdict(self.stats),
        }

    def load(self, data: dict) -> None:
        self.waiting = collections.OrderedDict((e.task.task_id, e) for e in map(_load_entry, data["waiting"]))
        self.in_flight = {e.task.task_id: e for e in map(_load_entry, data["in_flight"])}
        self.stats = RetryStats(**data["stats"])

    def metrics(self, groups_served: int) -> dict:
        s = self.stats
        return {
            "size": len(self.waiting),
            "in_flight": len(self.in_flight),
            "capacity": self.capacity,
            **dataclasses.asdict(s),
            "retry_share": s.served / groups_served if groups_served else 0.0,
            "retry_success_rate": s.successes / s.resolved if s.resolved else 0.0,
        }


def repair_task(entry: RetryEntry) -> Task:
    """The feedback-conditioned repair task: the original task plus the failed code and feedback."""
    ctx = RepairContext(
        failed_code=entry.attempt.code,
        feedback=entry.attempt.feedback,
        attempt=entry.served,
        origin_group=entry.origin_group,
    )
    return dataclasses.replace(entry.task, repair=ctx)


def _dump_entry(e: RetryEntry) -> dict:
    return {
        "task": protocols.encode(e.task),
        "attempt": dataclasses.asdict(e.attempt),
        "origin_group": e.origin_group,
        "served": e.served,
    }


def _load_entry(d: dict) -> RetryEntry:
    return RetryEntry(
        task=protocols.decode(d["task"]),
        attempt=FailedAttempt(**d["attempt"]),
        origin_group=d["origin_group"],
        served=d["served"],
    )
