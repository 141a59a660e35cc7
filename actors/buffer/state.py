"""The replay's state machine: task feed with admission control, episode intake and grouping,
group verdicts, staleness filtering and batch assembly (docs/replay.md). No sockets, files or clocks:
the caller passes `now` and makes every change durable (actors/buffer/actor.py).

Determinism is what makes recovery exact. Every state change comes from a request (TaskRequest that
opened a group, Episode stored, BatchRequest that moved the version, filtered or served a batch) or
from an expiry decision, and each handler is a pure function of the state and its input. The actor
logs those inputs before it replies, and a restart re-applies them to the last snapshot through
these same handlers. Answers that change nothing (waits, duplicates, rejections) are not logged;
their diagnostic counters are restored as of the last snapshot.

Units: the admission counter counts groups. accepted + running = groups handed out and not filtered
(running, complete and waiting, or trained). A batch is B complete, non-filtered groups.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from actors.buffer import intake
from actors.buffer.formulas import admission_limit, is_stale
from actors.buffer.groups import Group, judge
from actors.buffer.ledger import EpisodeLedger
from actors.buffer.packing import episode_lag, gradient_versions, pack_batch
from actors.buffer.retry_buffer import RetryBuffer
from actors.buffer.task_feed import TaskFeed
from actors.buffer.task_source import TaskSet
from configs import AlgoConfig, ReplayConfig
from protocols import (
    BatchReply,
    BatchRequest,
    Episode,
    EpisodeAck,
    ErrorReply,
    Record,
    TaskList,
    TaskListRequest,
    TaskReply,
    TaskRequest,
    VersionsSeen,
)

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 2


@dataclass
class Counters:
    groups_issued: int = 0
    groups_trained: int = 0
    retry_groups_trained: int = 0  # Buffered-Dynamic-Retry groups among groups_trained
    batches: int = 0
    groups_filtered: collections.Counter = field(default_factory=collections.Counter)
    trained_lag: collections.Counter = field(default_factory=collections.Counter)  # lag -> samples
    duplicates: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)
    admission_waits: int = 0
    batch_waits: int = 0
    val_served: int = 0

    def dump(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["groups_filtered"] = dict(self.groups_filtered)
        d["rejected"] = dict(self.rejected)
        d["trained_lag"] = {str(k): v for k, v in self.trained_lag.items()}
        return d

    @classmethod
    def load(cls, d: dict) -> Counters:
        c = cls(**{k: v for k, v in d.items() if not isinstance(v, dict)})
        c.groups_filtered = collections.Counter(d["groups_filtered"])
        c.trained_lag = collections.Counter({int(k): v for k, v in d["trained_lag"].items()})
        c.rejected = collections.Counter(d["rejected"])
        return c


@dataclass
class ServedBatch:
    """The last batch handed out, kept until the learner asks at a newer version, so a resent or
    repeated request for the same version gets the same batch (also after a restart)."""

    version: int
    groups: list[Group]


class ReplayState:
    def __init__(self, replay: ReplayConfig, algo: AlgoConfig, tasks: TaskSet) -> None:
        self.replay = replay
        self.algo = algo
        self.eta = replay.max_staleness
        self.retry = RetryBuffer(replay.retry.capacity, replay.retry.max_retries)
        self.feed = TaskFeed(tasks, self.retry, replay.retry.probability, algo.seed)
        self.ledger = EpisodeLedger()
        self.counters = Counters()
        self.running: dict[str, Group] = {}
        self.ready: dict[str, Group] = {}  # complete, trainable, waiting for a batch; insertion = FIFO
        self.served: ServedBatch | None = None
        self.expired: set[str] = set()
        self.group_seq = 0
        self.learner_version = 0  # newest version a learner asked a batch for
        self.highest_version_seen = 0  # over learner requests and episode tokens; a restored learner starts above it
        # Version ranges (lo, hi), exclusive, whose weights a learner restore threw away: never trained on.
        self.discarded: list[tuple[int, int]] = []
        self.infra_streak: dict[str, int] = {}  # task id -> its groups filtered as infra in a row

    # ------------------------------------------------------------------------------- task feed

    @property
    def admitted(self) -> int:
        """accepted + running, in groups: handed out and not filtered."""
        return len(self.running) + len(self.ready) + self.counters.groups_trained

    @property
    def admission_bound(self) -> int:
        """Groups that may be accepted or running now: (η + v + 1)·B, or the whole run's total_steps·B
        with `replay.admission=whole_run` (rollout-only runs: no learner advances v)."""
        if self.replay.admission == "whole_run":
            return self.algo.total_steps * self.algo.batch_groups
        return admission_limit(self.eta, self.learner_version, self.algo.batch_groups, self.algo.total_steps)

    @property
    def running_window(self) -> int:
        """Groups that may be running at once now: the admission bound less the complete ones."""
        return self.admission_bound - len(self.ready) - self.counters.groups_trained

    def running_by_actor(self) -> collections.Counter[str]:
        return collections.Counter(g.actor_id for g in self.running.values())

    def on_task_request(
        self, req: TaskRequest, now: float, may_open: Callable[[], bool] | None = None
    ) -> tuple[Record, bool]:
        """`may_open`: the caller's last word before a group opens for a live request (its actor's share
        of the window); a re-applied request, which opened its group, passes none."""
        if req.split == "val":
            return self._val_task(), False
        if self.learner_version >= self.algo.total_steps:
            return TaskReply(status="stop"), False
        if self.admitted >= self.admission_bound:
            self.counters.admission_waits += 1
            return TaskReply(status="wait", retry_after_s=self.replay.retry_after_s), False
        if may_open is not None and not may_open():
            return TaskReply(status="wait", retry_after_s=self.replay.retry_after_s), False
        served = self.feed.next_train()
        if served is None:
            return ErrorReply(
                message=f"every training task has left the task feed ({self._dropped_story()}); "
                "see replay's log for why"
            ), False
        task, _source = served
        group = Group(
            group_id=f"g{self.group_seq:07d}",
            task=task,
            size=self.algo.group_size,
            last_activity=now,
            actor_id=req.actor_id,
        )
        self.group_seq += 1
        self.running[group.group_id] = group
        self.counters.groups_issued += 1
        return TaskReply(status="task", task=task, group_id=group.group_id, group_size=group.size), True

    def on_task_list(self, req: TaskListRequest) -> TaskList:
        """A whole split of the task set (for a warm start or an evaluation); changes nothing."""
        return TaskList(split=req.split, tasks=list(self.feed.train if req.split == "train" else self.feed.val))

    def versions_seen(self) -> VersionsSeen:
        return VersionsSeen(highest=self.highest_version_seen)

    def _val_task(self) -> Record:
        task = self.feed.next_val()
        if task is None:
            return ErrorReply(message="no validation tasks: replay.val_fraction left none out")
        self.counters.val_served += 1
        return TaskReply(
            status="task", task=task, group_id=f"val-{self.feed.val_index - 1}", group_size=self.algo.group_size
        )

    # ---------------------------------------------------------------------------------- intake

    def on_episode(self, ep: Episode, now: float) -> tuple[EpisodeAck, bool]:
        if ep.episode_id in self.ledger:
            self.counters.duplicates += 1
            return EpisodeAck(episode_id=ep.episode_id, status="duplicate"), False
        if ep.group_id in self.expired:  # a late sample of an abandoned group: stored, never trained
            problem = intake.content_problem(ep)
        else:
            problem = intake.rejection(ep, self.running.get(ep.group_id))
        if problem is not None:
            key, why = problem
            self.counters.rejected[key] += 1
            log.warning("replay: rejected episode %s: %s", ep.episode_id, why)
            return EpisodeAck(episode_id=ep.episode_id, status="rejected", reason=why), False
        self._see_versions(ep)
        if ep.group_id in self.expired:
            self.ledger.mark_filtered(ep.episode_id, "expired")
        else:
            group = self.running[ep.group_id]
            group.episodes[ep.sample_index] = ep
            group.last_activity = now
            self.ledger.add_pending(ep.episode_id)
            if group.complete:
                self._close(group)
        return EpisodeAck(episode_id=ep.episode_id, status="stored"), True

    def _see_versions(self, ep: Episode) -> None:
        for turn in ep.turns:
            if len(turn.versions):
                self.highest_version_seen = max(self.highest_version_seen, int(max(turn.versions)))

    def _close(self, group: Group) -> None:
        """All G samples are in: decide the group's fate."""
        del self.running[group.group_id]
        verdict = judge(group, self.algo)
        task_id = group.task.task_id
        if verdict.unservable:
            self._leave_feed(group, "unservable", f"the rollouts cannot pose it: {verdict.unservable}")
            return
        if verdict.infra:
            streak = self.infra_streak[task_id] = self.infra_streak.get(task_id, 0) + 1
            if streak >= self.replay.infra_retries:
                self._leave_feed(
                    group,
                    "infra",
                    f"{streak} of its groups in a row failed through the system's "
                    "fault (infra), e.g. a reference that raises",
                )
            else:
                self._filter(group, "infra", reissue=True)
            return
        self.infra_streak.pop(task_id, None)
        if group.is_retry:
            self.retry.resolve(task_id, verdict.any_passed, verdict.best_failed)
        elif task_id in self.feed.dropped:
            pass  # a late group of a task that left the feed: never buffered for retry
        elif not verdict.any_passed and verdict.best_failed is not None:
            self.retry.admit(group.task, verdict.best_failed, group.group_id)
        if verdict.tied and self.algo.drop_tied_groups:  # dynamic sampling: no signal, no slot
            self._filter(group, "tied", reissue=False)
            return
        group.advantages = verdict.advantages
        self.ready[group.group_id] = group

    def _leave_feed(self, group: Group, reason: str, why: str) -> None:
        """Filter the group and take its task out of the feed for good; reported once per task."""
        self._filter(group, reason, reissue=False)
        task_id = group.task.task_id
        self.infra_streak.pop(task_id, None)
        self.retry.forget(task_id)
        if self.feed.drop(task_id, reason):
            log.warning("replay: task %s leaves the task feed: %s (%s)", task_id, why, self._dropped_story())

    def _dropped_story(self) -> str:
        counts = collections.Counter(self.feed.dropped.values())
        return f"{len(self.feed.dropped)} of {len(self.feed.train)} training tasks out of the feed: " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(counts.items())
        )

    def _filter(self, group: Group, reason: str, *, reissue: bool) -> None:
        for ep in group.episodes.values():
            self.ledger.mark_filtered(ep.episode_id, reason)
        self.counters.groups_filtered[reason] += 1
        if reissue:  # a fresh group of the same task (repair context included) goes first
            self.feed.reissue(group.task)

    # ---------------------------------------------------------------------------------- expiry

    def overdue(self, now: float, timeout_s: float) -> list[str]:
        """Running groups with no sign of life for `timeout_s` (a rollout died or lost its task)."""
        return [gid for gid, g in self.running.items() if now - g.last_activity > timeout_s]

    def held_by(self, actor_id: str) -> list[str]:
        """Running groups handed to `actor_id` (a rollout actor that died: release them now)."""
        return [gid for gid, g in self.running.items() if g.actor_id == actor_id]

    def expire(self, group_ids: list[str]) -> None:
        for gid in group_ids:
            group = self.running.pop(gid, None)
            if group is None:
                continue
            self.expired.add(gid)
            log.warning(
                "replay: group %s (task %s) expired with %d/%d samples; task re-issued",
                gid,
                group.task.task_id,
                len(group.episodes),
                group.size,
            )
            self._filter(group, "expired", reissue=True)

    # ----------------------------------------------------------------------------------- batch

    def on_batch_request(self, req: BatchRequest) -> tuple[Record, bool]:
        v = req.version
        if v < self.learner_version:
            return ErrorReply(
                message=(
                    f"batch request at version {v} is below the newest version {self.learner_version} "
                    f"(versions only grow; a restored learner continues above {self.highest_version_seen})"
                )
            ), False
        changed = v > self.learner_version
        if req.discarded_above >= 0 and (req.discarded_above, v) not in self.discarded:
            self.discarded.append((req.discarded_above, v))
            changed = True
        if changed:
            self.learner_version = v
            self.highest_version_seen = max(self.highest_version_seen, v)
            self.served = None  # the learner moved on: the last batch was consumed
        if v >= self.algo.total_steps:
            return BatchReply(status="stop"), changed
        if self.served is not None:  # a repeated request for the version already served
            return BatchReply(status="batch", batch=self._pack(self.served.groups, v)), changed
        changed |= self._filter_stale(v)
        changed |= self._filter_discarded()
        if len(self.ready) < self.algo.batch_groups:
            self.counters.batch_waits += 1
            return BatchReply(status="wait", retry_after_s=self.replay.retry_after_s), changed
        groups = [self.ready.pop(gid) for gid in list(self.ready)[: self.algo.batch_groups]]
        for group in groups:
            for ep in group.episodes.values():
                self.ledger.mark_trained(ep.episode_id)
                lag = episode_lag(ep, v, self.algo.train_turns)
                self.counters.trained_lag[0 if lag is None else lag] += 1
        self.counters.groups_trained += len(groups)
        self.counters.retry_groups_trained += sum(g.is_retry for g in groups)
        self.counters.batches += 1
        self.served = ServedBatch(version=v, groups=groups)
        return BatchReply(status="batch", batch=self._pack(groups, v)), True

    def _filter_stale(self, version: int) -> bool:
        """Filter every waiting group holding a sample that lags `version` by more than η: a group's
        baseline is only meaningful over samples of one policy window, and lag only grows."""
        stale = [
            g
            for g in self.ready.values()
            if any(is_stale(episode_lag(ep, version, self.algo.train_turns), self.eta) for ep in g.episodes.values())
        ]
        for group in stale:
            del self.ready[group.group_id]
            self._filter(group, "stale", reissue=True)
        return bool(stale)

    def _filter_discarded(self) -> bool:
        """Filter every waiting group with a sample made by weights a learner restore discarded."""

        def discarded(ep: Episode) -> bool:
            versions = gradient_versions(ep, self.algo.train_turns)
            return any(bool(np.any((versions > lo) & (versions < hi))) for lo, hi in self.discarded)

        bad = [g for g in self.ready.values() if any(discarded(ep) for ep in g.episodes.values())]
        for group in bad:
            del self.ready[group.group_id]
            self._filter(group, "discarded", reissue=True)
        return bool(bad)

    def _pack(self, groups: list[Group], version: int):
        episodes = [ep for g in groups for ep in g.ordered()]
        advantages = [a for g in groups for a in g.advantages]
        return pack_batch(episodes, advantages, version, self.algo.train_turns)

    # ---------------------------------------------------------------------------------- report

    # -------------------------------------------------------------------------------- snapshot

    def dump(self) -> dict:
        return {
            "format": SNAPSHOT_FORMAT,
            "group_seq": self.group_seq,
            "learner_version": self.learner_version,
            "highest_version_seen": self.highest_version_seen,
            "discarded": [list(r) for r in self.discarded],
            "infra_streak": dict(self.infra_streak),
            "running": [g.dump() for g in self.running.values()],
            "ready": [g.dump() for g in self.ready.values()],
            "served": None
            if self.served is None
            else {"version": self.served.version, "groups": [g.dump() for g in self.served.groups]},
            "expired": sorted(self.expired),
            "ledger": self.ledger.dump(),
            "feed": self.feed.dump(),
            "retry": self.retry.dump(),
            "counters": self.counters.dump(),
        }

    def load(self, data: dict, now: float) -> None:
        if data.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"replay snapshot format {data.get('format')!r} is not {SNAPSHOT_FORMAT}")
        self.group_seq = data["group_seq"]
        self.learner_version = data["learner_version"]
        self.highest_version_seen = data["highest_version_seen"]
        self.discarded = [tuple(r) for r in data.get("discarded", [])]
        self.infra_streak = dict(data["infra_streak"])
        # a restart gives every running group a fresh timeout: nobody could deliver while replay was down
        self.running = {g.group_id: g for g in (Group.load(d, now) for d in data["running"])}
        self.ready = {g.group_id: g for g in (Group.load(d, now) for d in data["ready"])}
        served = data["served"]
        self.served = (
            None
            if served is None
            else ServedBatch(version=served["version"], groups=[Group.load(d, now) for d in served["groups"]])
        )
        self.expired = set(data["expired"])
        self.ledger.load(data["ledger"])
        self.feed.load(data["feed"])
        self.retry.load(data["retry"])
        self.counters = Counters.load(data["counters"])
