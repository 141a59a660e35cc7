"""The replay's state machine: task feed with admission control, episode intake and grouping,
group verdicts, staleness filtering and batch assembly (docs/replay.md). No sockets, files or clocks:
the caller passes `now` and makes every change durable (actors/buffer/actor.py). The decisions
themselves (admission, a group's fate) are pure functions in actors/decisions.py; this module keeps
the books and carries them out.

Determinism is what makes recovery exact. Every state change comes from a request (TaskRequest that
opened a group, Episode stored, BatchRequest that moved the version, filtered or served a batch) or
from an expiry decision, and each handler is a pure function of the state and its input. The actor
logs those inputs before it replies, and a restart re-applies them to the last snapshot through
these same handlers. Answers that change nothing (waits, duplicates, rejections) are not logged;
their diagnostic counters are restored as of the last snapshot.

Units: the books count groups. accepted + running = groups handed out and not filtered (running,
complete and waiting, or trained). A batch is B complete, non-filtered groups. The admission decision
counts attempts (G per group), the unit it shares with the rollout actor's engine budget.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from actors import decisions
from actors.buffer import intake
from actors.buffer.groups import Group, judge, turns_with_own_credit
from actors.buffer.health import LedgerIds
from actors.buffer.ledger import FILTERED, PENDING, TRAINED, EpisodeLedger
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

SNAPSHOT_FORMAT = 3  # 3: a group's advantages are per gradient-carrying turn (2: one per episode)


@dataclass
class Counters:
    groups_issued: int = 0
    groups_trained: int = 0
    retry_groups_trained: int = 0  # Buffered-Dynamic-Retry groups among groups_trained
    turn_credited_turns: int = 0  # trained turns after the first that carry their own per-turn advantage
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
        self.learner_step = 0  # RL steps in that version's history (below it after a rollback)
        self.highest_version_seen = 0  # over learner requests and episode tokens; a restored learner starts above it
        # Version ranges (lo, hi), exclusive, whose weights a learner restore threw away: never trained on.
        self.discarded: list[tuple[int, int]] = []
        self.infra_streak: dict[str, int] = {}  # task id -> its groups filtered as infra in a row
        # Whether each of the last replay.keep_rate_window complete groups was kept by its verdict (the
        # admission bound counts a running group as the share kept); filters at batch time do not count.
        self.kept_recently: collections.deque[bool] = collections.deque(maxlen=replay.keep_rate_window or 1)

    # ------------------------------------------------------------------------------- task feed

    @property
    def consumed_groups(self) -> int:
        """Groups in the learner's weights (B per step of their history) and in the batch it was
        served and has not finished: what counts against the admission bound. Batches trained in
        steps a rollback lost count no longer, so the run still makes all its total_steps."""
        return (self.learner_step + (self.served is not None)) * self.algo.batch_groups

    @property
    def admitted(self) -> int:
        """accepted + running, in groups: handed out and not filtered."""
        return len(self.running) + len(self.ready) + self.consumed_groups

    @property
    def keep_rate(self) -> float:
        """The share of recent complete groups that their verdicts kept, as admission assumes it (1 with
        `replay.keep_rate_window` 0, and under whole-run admission)."""
        if not self.replay.keep_rate_window or self.replay.admission == "whole_run":
            return 1.0
        return decisions.keep_rate(self.kept_recently, self.replay.min_keep_rate)

    @property
    def admission_bound(self) -> int:
        """Groups that may be accepted or running now: (η + v + 1)·B, or the whole run's total_steps·B
        with `replay.admission=whole_run` (rollout-only runs: no learner advances v)."""
        return decisions.staleness_bound(
            self.algo.max_staleness,
            self.learner_step,
            self.algo.batch_groups,
            self.algo.total_steps,
            whole_run=self.replay.admission == "whole_run",
        )

    @property
    def running_window(self) -> int:
        """Groups that may be running at once now: the admission bound less the complete ones, over the
        keep rate (`decisions.running_window`)."""
        return decisions.running_window(self.admission_bound, len(self.ready) + self.consumed_groups, self.keep_rate)

    def running_by_actor(self) -> collections.Counter[str]:
        return collections.Counter(g.actor_id for g in self.running.values())

    def on_task_request(
        self, req: TaskRequest, now: float, actor_room: Callable[[], int] | None = None
    ) -> tuple[Record, bool]:
        """`actor_room`: the caller's last word before a group opens for a live request, the attempts its
        actor may still start (its share of the window, actors/buffer/shares.py); a re-applied request,
        which opened its group, passes none."""
        if req.split == "val":
            return self._val_task(), False
        if self.learner_step >= self.algo.total_steps:
            return TaskReply(status="stop"), False
        capacity = decisions.admission_capacity(
            decisions.staleness_room(len(self.running), self.running_window, self.algo.group_size)
        )
        if not decisions.may_start_group(capacity):
            self.counters.admission_waits += 1
            return TaskReply(status="wait", retry_after_s=self.replay.retry_after_s), False
        if actor_room is not None and not decisions.may_start_group(
            decisions.admission_capacity(capacity, actor_room())
        ):
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

    def ledger_ids(self) -> LedgerIds:
        """Every stored episode id by what became of it, and the rolled-back version ranges: replay's
        side of the no-loss check (launch/observe/id_check.py)."""
        ids = self.ledger.ids()
        return LedgerIds(
            trained=frozenset(ids.get(TRAINED, ())),
            filtered={
                status.removeprefix(FILTERED): frozenset(found)
                for status, found in ids.items()
                if status.startswith(FILTERED)
            },
            pending=frozenset(ids.get(PENDING, ())),
            rolled_back=tuple(self.discarded),
            in_step=frozenset(
                ep.episode_id for g in (self.served.groups if self.served else []) for ep in g.episodes.values()
            ),
        )

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
        """All G samples are in: judge the group, decide its fate (actors/decisions.py), carry it out."""
        del self.running[group.group_id]
        verdict = judge(group, self.algo)
        task_id = group.task.task_id
        fate = decisions.fate_of_complete_group(
            verdict.outcome(group.is_retry),
            infra_streak=self.infra_streak.get(task_id, 0),
            infra_retries=self.replay.infra_retries,
            drop_tied=self.algo.drop_tied_groups,
            task_in_feed=task_id not in self.feed.dropped,
        )
        if fate.infra_streak:
            self.infra_streak[task_id] = fate.infra_streak
        else:
            self.infra_streak.pop(task_id, None)
        if fate.retry == "resolve" and not fate.trained:
            self.retry.resolve(task_id, verdict.any_passed, verdict.best_failed)
        elif fate.retry == "admit" and verdict.best_failed is not None:
            self.retry.admit(group.task, verdict.best_failed, group.group_id)
        elif fate.retry == "forget":
            self.retry.forget(task_id)
        if not fate.leave_feed:  # a task that cannot be posed says nothing of how groups fare
            self.kept_recently.append(fate.trained)
        if fate.trained:
            # A kept repair group resolves its entry when it is trained (`_resolve_trained_repairs`): until
            # then it may be filtered at batch time and re-issued with its repair context, and its entry
            # stays in flight so BDR never serves a second repair group of the task beside it.
            group.advantages = verdict.advantages
            self.ready[group.group_id] = group
            return
        self._filter(group, fate)
        if fate.leave_feed and self.feed.drop(task_id, fate.filtered):
            log.warning("replay: task %s leaves the task feed: %s (%s)", task_id, fate.why, self._dropped_story())

    def _dropped_story(self) -> str:
        counts = collections.Counter(self.feed.dropped.values())
        return f"{len(self.feed.dropped)} of {len(self.feed.train)} training tasks out of the feed: " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(counts.items())
        )

    def _filter(self, group: Group, fate: decisions.Fate) -> None:
        for ep in group.episodes.values():
            self.ledger.mark_filtered(ep.episode_id, fate.filtered)
        self.counters.groups_filtered[fate.filtered] += 1
        # a fresh group of the same task (repair context included) goes first; a re-issued repair
        # group's entry is still in flight for it: it resolves only once trained or filtered for good
        if fate.reissue:
            self.feed.reissue(group.task)

    # ---------------------------------------------------------------------------------- expiry

    def overdue(self, now: float, timeout_s: float) -> list[str]:
        """Running groups with no sign of life for `timeout_s` (a rollout died or lost its task)."""
        return [gid for gid, g in self.running.items() if decisions.is_overdue(g.last_activity, now, timeout_s)]

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
            self._filter(group, decisions.EXPIRED)

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
        rollback = req.discarded_above >= 0 and (req.discarded_above, v) not in self.discarded
        if rollback:
            self.discarded.append((req.discarded_above, v))
            changed = True
        if changed:
            if self.served is not None:
                self._settle_served(v, rollback)
            self.learner_version = v
            self.learner_step = req.steps_taken
            self.highest_version_seen = max(self.highest_version_seen, v)
        if req.steps_taken >= self.algo.total_steps:
            return BatchReply(status="stop"), changed
        if self.served is not None:  # a repeated request for the version already served
            return BatchReply(status="batch", batch=self._pack(self.served.groups, v)), changed
        changed |= self._filter_at_batch(v)
        if len(self.ready) < self.algo.batch_groups:
            self.counters.batch_waits += 1
            return BatchReply(status="wait", retry_after_s=self.replay.retry_after_s), changed
        groups = [self.ready.pop(gid) for gid in list(self.ready)[: self.algo.batch_groups]]
        self._count_served(groups, v, +1)
        self.served = ServedBatch(version=v, groups=groups)
        return BatchReply(status="batch", batch=self._pack(groups, v)), True

    def _count_served(self, groups: list[Group], version: int, sign: int) -> None:
        """A batch's groups go to the learner (`sign` +1: their episodes count as trained) or come back
        from a step a rollback lost before it finished (-1: pending again, every count undone)."""
        for group in groups:
            for ep in group.episodes.values():
                if sign > 0:
                    self.ledger.mark_trained(ep.episode_id)
                else:
                    self.ledger.add_pending(ep.episode_id)
                lag = episode_lag(ep, version, self.algo.train_turns)
                self.counters.trained_lag[0 if lag is None else lag] += sign
                self.counters.turn_credited_turns += sign * turns_with_own_credit(ep, self.algo)
        self.counters.groups_trained += sign * len(groups)
        self.counters.retry_groups_trained += sign * sum(g.is_retry for g in groups)
        self.counters.batches += sign

    def _settle_served(self, version: int, rollback: bool) -> None:
        """The learner asks at a newer `version`: the batch it was served last is settled. One whose step
        a rollback lost unfinished (`decisions.served_batch_finished`) comes back as waiting groups
        (judged again at this batch: most were made by rolled-back weights or now lag too far); a
        finished one resolves its repair groups."""
        served, self.served = self.served, None
        if not decisions.served_batch_finished(served.version, version, rollback=rollback):
            self._count_served(served.groups, served.version, -1)
            self.ready = {**{g.group_id: g for g in served.groups}, **self.ready}
            return
        self._resolve_trained_repairs(served.groups)

    def _resolve_trained_repairs(self, groups: list[Group]) -> None:
        """Resolve the retry entry of each repair group once its step finished. Resolving waits for this
        moment because a waiting group can still be filtered (stale, rolled-back weights) and its task
        re-issued with the same repair context, and a served batch can come back from a step a rollback
        lost; had its entry been resolved earlier, it would be back in the FIFO and a second repair
        group of the task could run beside the re-issue (docs/replay.md, "Buffered Dynamic Retry").
        The outcome is judged again from the group's own episodes."""
        for group in groups:
            if group.is_retry:
                verdict = judge(group, self.algo)
                self.retry.resolve(group.task.task_id, verdict.any_passed, verdict.best_failed)

    def _filter_at_batch(self, version: int) -> bool:
        """Decide the fate of every waiting group at the batch's `version` (stale, or made by discarded
        weights: filtered and re-issued); True when any was filtered."""
        turns = self.algo.train_turns
        filtered = False
        for group in list(self.ready.values()):
            fate = decisions.fate_at_batch(
                [episode_lag(ep, version, turns) for ep in group.episodes.values()],
                self.algo.max_staleness,
                made_by_discarded_weights=any(
                    decisions.made_by_discarded(gradient_versions(ep, turns), self.discarded)
                    for ep in group.episodes.values()
                ),
            )
            if not fate.trained:
                del self.ready[group.group_id]
                self._filter(group, fate)
                filtered = True
        return filtered

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
            "learner_step": self.learner_step,
            "highest_version_seen": self.highest_version_seen,
            "discarded": [list(r) for r in self.discarded],
            "infra_streak": dict(self.infra_streak),
            "kept_recently": list(self.kept_recently),
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
            raise ValueError(
                f"replay snapshot format {data.get('format')!r} is not {SNAPSHOT_FORMAT}, the one this Kiln reads "
                "(format 3 keeps an advantage per gradient-carrying turn); resume the run with the Kiln that wrote "
                "it, or start a new run directory"
            )
        self.group_seq = data["group_seq"]
        self.learner_version = data["learner_version"]
        self.learner_step = data.get("learner_step", self.learner_version)  # written before rollbacks kept steps
        self.highest_version_seen = data["highest_version_seen"]
        self.discarded = [tuple(r) for r in data.get("discarded", [])]
        self.infra_streak = dict(data["infra_streak"])
        self.kept_recently.clear()
        self.kept_recently.extend(data.get("kept_recently", []))  # snapshots before it: the plain bound at first
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
