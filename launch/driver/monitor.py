"""The driver's view of a run: one PULL socket that every actor pushes to (docs/architecture.md, "metrics
PUSH to the driver"), turned into one row of metrics per learner step; and each actor's share of
time spent working, from the busy counters in their health records (`busy_shares`).

Actors push `Metrics` (the learner, once per step, with the ids of the episodes it trained and those
MirrorPop dropped), `GroupReport` (a rollout actor, once per task group), the groups' `Episode`
records (for the readable dumps) and `Timeline` records (each actor's spans of work, about once a
second; the session keeps them in RUN_DIR/timeline.jsonl). Between two learner steps the monitor
adds up the groups that finished; when the learner's step arrives it closes the step's row: the learner's values, the
rollout side's rates, rewards and verifier outcomes, and run-wide counts (distinct compiled
sources, groups whose rewards are not all tied). A step in whose window no group finished (the end
of a run, where every group is admitted already) reports no rollout rates rather than zeros.

The same group reports also fill a second window that the driver empties every
`logging.rollout_every_s` for its rollout-side progress rows (launch/observe/progress.py), and a short
history of the last K groups' outcomes, which tells whether every recent group tied.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from actors.buffer.formulas import prime_echo, rewards_tie
from configs import AlgoConfig
from protocols import Episode, GroupReport, Metrics, Record, Span, Timeline
from protocols import metric_keys as mk
from protocols.channels import PullChannel

log = logging.getLogger(__name__)

EPISODES_KEPT = 1024  # episodes held between two takes at most
QUEUED_MAX = 10_000  # records a step takes along from the queue behind it (a stream never holds the driver)
LOOK_EVERY_S = 0.05  # how often poll() asks its `until` (a cheap local look) while records arrive


@dataclass
class TurnCounts:
    """The turns of a window's episodes by kind and outcome: a turn after a failed turn is a repair
    turn, one after a passed turn a performance turn (a pass ends an attempt unless it was slow)."""

    first_passed: int = 0
    repair: int = 0
    repair_passed: int = 0
    optimize: int = 0
    anchored: int = 0  # episodes whose first turn scored below their best while α > 0

    def add(self, g: GroupReport, alpha: float) -> None:
        for scores, passed in zip(g.turn_scores, g.turn_passed, strict=True):
            if not passed:
                continue
            self.first_passed += passed[0]
            after = list(itertools.pairwise(passed))  # (previous turn passed, this one passed)
            self.repair += sum(not prev for prev, _ in after)
            self.repair_passed += sum(not prev and now for prev, now in after)
            self.optimize += sum(prev for prev, _ in after)
            self.anchored += alpha > 0 and len(scores) > 1 and scores[0] < max(scores)

    def values(self) -> dict[str, float]:
        return {
            mk.ROLLOUT_FIRST_TURN_PASSES: float(self.first_passed),
            mk.ROLLOUT_REPAIR_TURNS: float(self.repair),
            mk.ROLLOUT_REPAIR_TURN_PASSES: float(self.repair_passed),
            mk.ROLLOUT_OPTIMIZE_TURNS: float(self.optimize),
            mk.ROLLOUT_ANCHORED_EPISODES: float(self.anchored),
        }


@dataclass
class Window:
    """What the rollout side did since the window opened (the last learner step, or the last progress row)."""

    start: float = field(default_factory=time.monotonic)
    samples: int = 0
    tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    passed: int = 0
    repair_passes: int = 0  # episodes whose repair turn passed after a failed turn
    turns: TurnCounts = field(default_factory=TurnCounts)
    retry_groups: int = 0
    groups: int = 0
    tied_groups: int = 0
    stages: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)

    def outcomes(self) -> dict[str, int]:
        """Verified attempts by outcome: 'passed' (stage done) or the error class of the failure."""
        return {"passed": self.stages.get("done", 0), **self.errors}


@dataclass(frozen=True)
class GroupOutcome:
    """One finished group as the no-progress check sees it."""

    tied: bool
    reward: float | None  # the shared reward of a tied group
    outcomes: dict[str, int]  # its verified attempts by outcome (passed, or the error class)
    stages: dict[str, int]  # its verified attempts by the furthest stage reached


class RunMonitor:
    def __init__(
        self,
        algo: AlgoConfig,
        *,
        host: str = "127.0.0.1",
        transport: str = "tcp",
        advertise: str | None = None,
        recent_groups: int = 32,
    ) -> None:
        self.algo = algo
        self.channel = PullChannel(host, transport, advertise)
        self.address = self.channel.address
        self.window = Window()
        self.progress = Window()
        self.recent: collections.deque[GroupOutcome] = collections.deque(maxlen=recent_groups)
        self.sources: set[str] = set()
        self.untied_groups = 0
        self.total_groups = 0
        # received since the last take, for the dumps (the newest, when nobody takes them: rollout-only runs)
        self.episodes: collections.deque[Episode] = collections.deque(maxlen=EPISODES_KEPT)
        self.learner_episodes: dict[str, list[str]] = collections.defaultdict(list)  # what the steps did to them
        self.spans: list[tuple[str, Span]] = []  # (actor, span) received since the last take_spans()
        self.last_step = 0
        self.last_step_at: float | None = None  # monotonic time of the last learner step
        self.last_values: dict[str, float] = {}
        self.step_times: dict[int, float] = {}  # step -> when the learner finished it and sent it (its wall clock)

    def close(self) -> None:
        self.channel.close()

    def poll(
        self, timeout_s: float, until: Callable[[], bool] | None = None, to_step: bool = False
    ) -> list[tuple[int, dict[str, float]]]:
        """Take every record that arrives within `timeout_s`, or until `until()` holds (looked at every
        `LOOK_EVERY_S`: the driver's prompt notice of a dead actor), or with `to_step` until a learner
        step arrives (and the records already queued behind it): the driver acts on each step as it
        comes, so a fault injected after a step lands right after it. Returns the learner steps
        completed."""
        rows = []
        deadline = time.monotonic() + timeout_s
        look_at = time.monotonic() + LOOK_EVERY_S
        while True:
            now = time.monotonic()
            if until is not None and now >= look_at:
                if until():
                    return rows
                look_at = now + LOOK_EVERY_S
            if now >= deadline:
                return rows
            rec = self.channel.recv(max(0.0, min(deadline, look_at) - now))
            if rec is None:
                continue
            row = self.ingest(rec)
            if row is not None:
                rows.append(row)
                if to_step:
                    return rows + self._take_queued()

    def _take_queued(self) -> list[tuple[int, dict[str, float]]]:
        """Ingest the records that have arrived already, without waiting; the steps among them."""
        rows = []
        for _ in range(QUEUED_MAX):
            rec = self.channel.recv(0.0)
            if rec is None:
                break
            row = self.ingest(rec)
            if row is not None:
                rows.append(row)
        return rows

    def ingest(self, rec: Record) -> tuple[int, dict[str, float]] | None:
        if isinstance(rec, GroupReport):
            self._add_group(rec)
        elif isinstance(rec, Episode):
            self.episodes.append(rec)
        elif isinstance(rec, Timeline):
            self.spans += [(rec.actor_id, span) for span in rec.spans]
        elif isinstance(rec, Metrics):
            if rec.step < 0:  # a warm-start step: the learner's warm-start report sums them up
                return None
            return self._close_step(rec)
        return None

    def take_episodes(self) -> tuple[list[Episode], dict[str, list[str]]]:
        """The episodes received since the last take, and the ids the learner's steps since then
        named by what they did ("trained", "mirrorpop_dropped")."""
        episodes, self.episodes = list(self.episodes), collections.deque(maxlen=EPISODES_KEPT)
        named, self.learner_episodes = dict(self.learner_episodes), collections.defaultdict(list)
        return episodes, named

    def take_progress(self) -> Window:
        """The rollout side's window since the last progress row; a new one opens."""
        window, self.progress = self.progress, Window()
        return window

    def take_spans(self) -> list[tuple[str, Span]]:
        spans, self.spans = self.spans, []
        return spans

    # ---------------------------------------------------------------------------------- rows

    def _add_group(self, g: GroupReport) -> None:
        rewards = [
            prime_echo(
                s,
                p,
                alpha=self.algo.alpha,
                bonus_turn1=self.algo.early_bonus_turn1,
                bonus_turn2=self.algo.early_bonus_turn2,
            )
            for s, p in zip(g.turn_scores, g.turn_passed, strict=True)
            if s
        ]
        tied = len(rewards) > 1 and rewards_tie(rewards)
        for w in (self.window, self.progress):
            w.groups += 1
            w.retry_groups += g.is_retry
            w.tied_groups += tied
            w.samples += len(g.turn_scores)
            w.tokens += g.generated_tokens
            w.rewards += rewards
            w.passed += sum(any(p) for p in g.turn_passed)
            w.repair_passes += sum(_repair_passed(p) for p in g.turn_passed)
            w.turns.add(g, self.algo.alpha)
            w.stages.update(g.stages)
            w.errors.update(g.error_classes)
        self.sources.update(h for h in g.source_hashes if h)
        self.total_groups += 1
        if len(rewards) > 1 and not tied:
            self.untied_groups += 1
        errors = collections.Counter(g.error_classes)
        self.recent.append(
            GroupOutcome(
                tied=tied,
                reward=rewards[0] if tied else None,
                outcomes={"passed": g.stages.count("done"), **errors},
                stages=dict(collections.Counter(g.stages)),
            )
        )

    def _close_step(self, m: Metrics) -> tuple[int, dict[str, float]]:
        self.step_times[m.step] = m.ts
        w, now = self.window, time.monotonic()
        seconds = max(now - w.start, 1e-9)
        values = dict(m.values)
        values.update(
            {
                mk.ROLLOUT_SAMPLES: float(w.samples),
                mk.ROLLOUT_GROUPS: float(w.groups),
                mk.ROLLOUT_REPAIR_PASSES: float(w.repair_passes),
                **w.turns.values(),
                mk.RUN_DISTINCT_SOURCES: float(len(self.sources)),
                mk.RUN_UNTIED_GROUPS: float(self.untied_groups),
                mk.RUN_GROUPS: float(self.total_groups),
            }
        )
        if w.groups:  # a window without a finished group has no rate to report (not a rate of 0)
            values.update(
                {
                    mk.ROLLOUT_SAMPLES_PER_S: w.samples / seconds,
                    mk.ROLLOUT_TOKENS_PER_S: w.tokens / seconds,
                    mk.REPLAY_BDR_SHARE: w.retry_groups / w.groups,
                }
            )
        if w.rewards:
            values[mk.REWARD_MEAN] = sum(w.rewards) / len(w.rewards)
        if w.samples:
            values[mk.REWARD_PASS_RATE] = w.passed / w.samples
        for stage, n in w.stages.items():
            values[mk.verifier_stage(stage)] = float(n)
        for cls, n in w.errors.items():
            values[mk.verifier_error(cls)] = float(n)
        for kind, ids in m.episodes.items():
            self.learner_episodes[kind].extend(ids)
        self.window = Window(start=now)
        self.last_step, self.last_values, self.last_step_at = m.step, values, now
        return m.step, values


def _repair_passed(passed: list[bool]) -> bool:
    """A repair turn passed: a turn after the first passed, and the turn before it had failed (a pass
    after a pass is a performance turn's)."""
    return any(passed[k] and not passed[k - 1] for k in range(1, len(passed)))


def busy_shares(handles: Iterable, previous: dict[str, float], seconds: float) -> dict[str, float]:
    """Per-actor share of the last `seconds` spent working, from the `busy_s` of the actors' health
    records (handles: anything with `.name` and `.health(timeout_s)`). `previous` holds the last
    reading per actor and is updated."""
    out = {}
    for handle in handles:
        try:
            busy = handle.health(timeout_s=10.0).busy_s
        except Exception as err:  # noqa: BLE001 - a dead actor: the supervisor deals with it
            log.debug("%s: no health for its busy share: %s", handle.name, err)
            continue
        if busy is None:  # an actor that does not count its busy time
            continue
        name = handle.name
        if name in previous and seconds > 0:
            # A counter that went down belongs to a restarted actor: all of it is since the last reading.
            worked = busy - previous[name] if busy >= previous[name] else busy
            out[mk.busy(name)] = min(1.0, worked / seconds)
        previous[name] = busy
    return out
