"""The task feed's choice of the next task (docs/architecture.md, docs/replay.md). Admission control is not here: the
replay state asks the feed for a task only once a new group may start.

Order of precedence for a training task:
1. a re-issued task (its group was filtered as stale, infra-failed or expired): front of the feed, so
   long episodes are not biased out of training;
2. with probability p (seeded), a feedback-conditioned repair task from the retry buffer;
3. the next fresh training task: every epoch visits each task once, in a seeded shuffled order.
Validation tasks are served only on request, in a fixed cycle, outside admission control.

A task can leave the feed for good (`drop`): one whose prompt the rollouts cannot pose (it does not fit
model.max_seq_len even alone), or one whose groups failed through the system's fault
`replay.infra_retries` times in a row (a broken reference, say). Re-issuing those would hand them
out forever. Each is counted by reason and reported once.
"""

from __future__ import annotations

import collections
import random
from typing import Literal

import protocols
from actors.buffer.retry_buffer import RetryBuffer
from actors.buffer.task_source import TaskSet
from protocols import Task

Source = Literal["fresh", "retry", "reissue"]


class TaskFeed:
    def __init__(self, tasks: TaskSet, retry: RetryBuffer, probability: float, seed: int) -> None:
        self.train = tasks.train
        self.val = tasks.val
        self.retry = retry
        self.probability = probability
        self.seed = seed
        self.epoch = 0
        self.index = 0  # position in this epoch's order
        self.val_index = 0
        self.reissued: collections.deque[Task] = collections.deque()
        self.rng = random.Random(seed)  # the p draw; its state is persisted so a restart continues it
        self.served: collections.Counter[str] = collections.Counter()
        self.dropped: dict[str, str] = {}  # task id -> why it left the feed
        self._order = self._epoch_order(0)

    def next_train(self) -> tuple[Task, Source] | None:
        """The next training task and where it came from; None once every training task left the feed."""
        if self.reissued:
            return self._count(self.reissued.popleft(), "reissue")
        # draw only when there is something to retry, so an empty buffer leaves the sequence alone
        if len(self.retry) and self.rng.random() < self.probability:
            return self._count(self.retry.take(), "retry")
        if len(self.dropped) >= len(self.train) and all(t.task_id in self.dropped for t in self.train):
            return None
        while True:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._epoch_order(self.epoch)
            task = self.train[self._order[self.index]]
            self.index += 1
            if task.task_id not in self.dropped:
                return self._count(task, "fresh")

    def drop(self, task_id: str, reason: str) -> bool:
        """Take a task out of the feed for good (re-issues of it included); False if it was out already."""
        if task_id in self.dropped:
            return False
        self.dropped[task_id] = reason
        self.reissued = collections.deque(t for t in self.reissued if t.task_id != task_id)
        return True

    def reissue(self, task: Task) -> None:
        """Put a task at the front of the feed: a fresh group of it is the next one handed out."""
        if task.task_id not in self.dropped:
            self.reissued.appendleft(task)

    def next_val(self) -> Task | None:
        if not self.val:
            return None
        task = self.val[self.val_index % len(self.val)]
        self.val_index += 1
        return task

    def _count(self, task: Task, source: Source) -> tuple[Task, Source]:
        self.served[source] += 1
        return task, source

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def dump(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {
            "epoch": self.epoch,
            "index": self.index,
            "val_index": self.val_index,
            "reissued": [protocols.encode(t) for t in self.reissued],
            "rng": [version, list(internal), gauss],
            "served": dict(self.served),
            "dropped": dict(self.dropped),
        }

    def load(self, data: dict) -> None:
        self.epoch, self.index, self.val_index = data["epoch"], data["index"], data["val_index"]
        self._order = self._epoch_order(self.epoch)
        self.reissued = collections.deque(protocols.decode(b) for b in data["reissued"])
        version, internal, gauss = data["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.served = collections.Counter(data["served"])
        self.dropped = dict(data["dropped"])
