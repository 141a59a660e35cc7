"""The replay actor's health record: the episode ledger, group and admission counters, staleness of
what was trained, the retry buffer, the task feed and the durable store, as typed fields.

The driver reads it for the metrics rows (`trained_lag`, `turn_credited_turns`), the run's end
(`groups`), the summary and the episode-id invariant (emitted = trained + filtered + pending); tests
and benchmarks read the rest.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actors.base import ActorHealth

if TYPE_CHECKING:
    from actors.buffer.state import ReplayState
    from actors.buffer.storage import ReplayStore


@dataclass(frozen=True)
class GroupCounts:
    issued: int = 0  # handed out by the task feed
    running: int = 0  # handed out, not complete
    ready: int = 0  # complete and trainable, waiting for a batch
    trained: int = 0
    retry_trained: int = 0  # Buffered-Dynamic-Retry (repair task) groups among `trained`
    filtered: dict[str, int] = field(default_factory=dict)  # reason -> groups

    @property
    def settled(self) -> int:
        """Groups that reached an end: trained, ready to train, or filtered."""
        return self.trained + self.ready + sum(self.filtered.values())


@dataclass(frozen=True)
class Admission:
    admitted: int = 0  # accepted + running, in groups
    limit: int = 0  # the admission bound at the current learner version
    waits: int = 0  # task requests told to wait by the bound
    running: int = 0  # groups running now
    window: int = 0  # groups that may be running at once now: the bound's free places over keep_rate
    keep_rate: float = 1.0  # the share of recent complete groups kept by their verdicts, as admission assumes it

    @property
    def full(self) -> bool:
        """No new group may start: as many run as the window allows."""
        return self.running >= self.window and self.limit > 0


@dataclass(frozen=True)
class TrainedLag:
    """Staleness of the trained samples: learner version minus the oldest token version."""

    max: int | None = None
    histogram: dict[int, int] = field(default_factory=dict)  # lag -> samples trained


@dataclass(frozen=True)
class RetryHealth:
    """Buffered Dynamic Retry: the buffer's size and its lifetime counters."""

    size: int = 0
    in_flight: int = 0
    capacity: int = 0
    admitted: int = 0
    served: int = 0
    resolved: int = 0
    successes: int = 0
    exhausted: int = 0
    evicted: int = 0
    skipped_duplicate: int = 0
    dropped: int = 0  # entries whose task left the feed
    retry_share: float = 0.0  # served / groups handed out
    retry_success_rate: float = 0.0  # successes / resolved


@dataclass(frozen=True)
class FeedHealth:
    train_tasks: int = 0
    val_tasks: int = 0
    epoch: int = 0
    index: int = 0
    reissue_queue: int = 0
    served: dict[str, int] = field(default_factory=dict)  # source ("fresh", "retry", "reissue") -> tasks
    val_served: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason ("unservable", "infra") -> tasks out of the feed


@dataclass(frozen=True)
class StorageHealth:
    appended: int = 0
    commits: int = 0
    snapshots: int = 0
    truncated_bytes: int = 0
    last_snapshot_s: float = 0.0
    last_snapshot_bytes: int = 0
    generation: int = 0
    since_snapshot: int = 0
    failure: str = ""  # set once the disk failed: replay then refuses all work


@dataclass(frozen=True)
class Latency:
    n: int = 0
    p50: float | None = None  # milliseconds
    p99: float | None = None


@dataclass(frozen=True, kw_only=True)
class ReplayHealth(ActorHealth):
    address: str = ""
    # the episode ledger: every emitted episode is trained, filtered or pending
    emitted: int = 0
    trained: int = 0
    filtered: dict[str, int] = field(default_factory=dict)  # reason -> episodes
    filtered_total: int = 0
    pending: int = 0
    invariant_ok: bool = True
    learner_version: int = 0
    highest_version_seen: int = 0
    groups: GroupCounts = field(default_factory=GroupCounts)
    admission: Admission = field(default_factory=Admission)
    batches: int = 0
    batch_waits: int = 0
    trained_lag: TrainedLag = field(default_factory=TrainedLag)
    # trained turns after the first that carried their own per-turn advantage (algo.turn_credit=per_turn
    # with train_turns=all); 0 when every turn trains with its episode's advantage or only turn 1 trains
    turn_credited_turns: int = 0
    duplicates: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    retry: RetryHealth = field(default_factory=RetryHealth)
    feed: FeedHealth = field(default_factory=FeedHealth)
    storage: StorageHealth = field(default_factory=StorageHealth)
    ack_latency_ms: Latency = field(default_factory=Latency)
    handler_errors: int = 0
    recovered: dict[str, float] = field(default_factory=dict)  # what the last start recovered (seconds, entries)


def replay_health(state: ReplayState, store: ReplayStore, **actor) -> ReplayHealth:
    """The record for a live replay: `state` and `store` as they are now, plus the actor's own fields
    (role, alive, address, ack_latency_ms, handler_errors, recovered, storage failure)."""
    c, ledger = state.counters, state.ledger.summary()
    lags = c.trained_lag
    failure = actor.pop("failure", "")
    return ReplayHealth(
        **actor,
        **ledger,
        learner_version=state.learner_version,
        highest_version_seen=state.highest_version_seen,
        groups=GroupCounts(
            issued=c.groups_issued,
            running=len(state.running),
            ready=len(state.ready),
            trained=c.groups_trained,
            retry_trained=c.retry_groups_trained,
            filtered=dict(c.groups_filtered),
        ),
        admission=Admission(
            admitted=state.admitted,
            limit=state.admission_bound,
            waits=c.admission_waits,
            running=len(state.running),
            window=state.running_window,
            keep_rate=state.keep_rate,
        ),
        batches=c.batches,
        batch_waits=c.batch_waits,
        trained_lag=TrainedLag(max=max(lags) if lags else None, histogram=dict(sorted(lags.items()))),
        turn_credited_turns=c.turn_credited_turns,
        duplicates=c.duplicates,
        rejected=sum(c.rejected.values()),
        rejected_by_reason=dict(c.rejected),
        retry=RetryHealth(**state.retry.metrics(groups_served=c.groups_issued)),
        feed=FeedHealth(
            train_tasks=len(state.feed.train),
            val_tasks=len(state.feed.val),
            epoch=state.feed.epoch,
            index=state.feed.index,
            reissue_queue=len(state.feed.reissued),
            served=dict(state.feed.served),
            val_served=c.val_served,
            dropped=dict(collections.Counter(state.feed.dropped.values())),
        ),
        storage=StorageHealth(
            **dataclasses.asdict(store.stats),
            generation=store.generation,
            since_snapshot=store.since_snapshot,
            failure=failure,
        ),
    )


@dataclass(frozen=True)
class LedgerIds:
    """Replay's account: ids by status, and the rolled-back version ranges (lo, hi), exclusive."""

    trained: frozenset[str]
    filtered: dict[str, frozenset[str]]  # reason -> ids
    pending: frozenset[str]
    rolled_back: tuple[tuple[int, int], ...] = ()
    # counted trained, in the batch last served, whose step may not have finished (a run stopped, or
    # ended by its driver, while the learner held it)
    in_step: frozenset[str] = frozenset()

    @property
    def stored(self) -> frozenset[str]:
        return self.trained | self.pending | frozenset().union(*self.filtered.values())
