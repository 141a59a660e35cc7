"""The driver's view of a run: one PULL socket that every actor pushes to (DESIGN.md §2, "metrics
PUSH to the driver"), turned into one row of metrics per learner step; and each actor's share of
time spent working, from the busy counters in their health records (`busy_shares`).

Actors push `Metrics` (the learner, once per step), `GroupReport` (a rollout actor, once per task
group) and a few sampled `Episode` records (for the readable dumps). Between two learner steps the
monitor adds up the groups that finished; when the learner's step arrives it closes the step's row:
the learner's values, the rollout side's rates, rewards and verifier outcomes, and run-wide
counts (distinct compiled sources, groups whose rewards are not all tied).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

from actors.buffer.formulas import prime_echo, rewards_tie
from configs import AlgoConfig
from protocols import Episode, GroupReport, Metrics, Record
from protocols.channels import PullChannel

log = logging.getLogger(__name__)


@dataclass
class _Window:
    """What the rollout side did since the last learner step."""

    start: float = field(default_factory=time.monotonic)
    samples: int = 0
    tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    passed: int = 0
    retry_groups: int = 0
    groups: int = 0
    stages: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)


class RunMonitor:
    def __init__(self, algo: AlgoConfig, *, host: str = "127.0.0.1", transport: str = "tcp",
                 advertise: str | None = None) -> None:
        self.algo = algo
        self.channel = PullChannel(host, transport, advertise)
        self.address = self.channel.address
        self.window = _Window()
        self.sources: set[str] = set()
        self.untied_groups = 0
        self.total_groups = 0
        self.episodes: list[Episode] = []  # sampled since the last step, for the dump
        self.last_step = 0
        self.last_values: dict[str, float] = {}
        self.step_times: dict[int, float] = {}  # when the learner finished each step (its wall clock)

    def close(self) -> None:
        self.channel.close()

    def poll(self, timeout_s: float) -> list[tuple[int, dict[str, float]]]:
        """Take every record that arrives within `timeout_s`; returns the learner steps completed."""
        rows = []
        deadline = time.monotonic() + timeout_s
        while True:
            rec = self.channel.recv(max(0.0, deadline - time.monotonic()))
            if rec is None:
                return rows
            row = self.ingest(rec)
            if row is not None:
                rows.append(row)

    def ingest(self, rec: Record) -> tuple[int, dict[str, float]] | None:
        if isinstance(rec, GroupReport):
            self._add_group(rec)
        elif isinstance(rec, Episode):
            self.episodes.append(rec)
        elif isinstance(rec, Metrics):
            if rec.step < 0:  # a warm-start step: the learner's warm-start report sums them up
                return None
            return self._close_step(rec)
        return None

    def take_episodes(self) -> list[Episode]:
        episodes, self.episodes = self.episodes, []
        return episodes

    # ---------------------------------------------------------------------------------- rows

    def _add_group(self, g: GroupReport) -> None:
        w = self.window
        rewards = [prime_echo(s, p, alpha=self.algo.alpha, bonus_turn1=self.algo.early_bonus_turn1,
                              bonus_turn2=self.algo.early_bonus_turn2)
                   for s, p in zip(g.turn_scores, g.turn_passed) if s]
        w.groups += 1
        w.retry_groups += g.is_retry
        w.samples += len(g.turn_scores)
        w.tokens += g.generated_tokens
        w.rewards += rewards
        w.passed += sum(any(p) for p in g.turn_passed)
        w.stages.update(g.stages)
        w.errors.update(g.error_classes)
        self.sources.update(h for h in g.source_hashes if h)
        self.total_groups += 1
        if len(rewards) > 1 and not rewards_tie(rewards):
            self.untied_groups += 1

    def _close_step(self, m: Metrics) -> tuple[int, dict[str, float]]:
        self.step_times[m.step] = m.ts
        w, now = self.window, time.monotonic()
        seconds = max(now - w.start, 1e-9)
        values = dict(m.values)
        values.update({
            "rollout/samples": float(w.samples),
            "rollout/samples_per_s": w.samples / seconds,
            "rollout/tokens_per_s": w.tokens / seconds,
            "rollout/groups": float(w.groups),
            "replay/bdr_share": w.retry_groups / w.groups if w.groups else 0.0,
            "run/distinct_sources": float(len(self.sources)),
            "run/untied_groups": float(self.untied_groups),
            "run/groups": float(self.total_groups),
        })
        if w.rewards:
            values["reward/mean"] = sum(w.rewards) / len(w.rewards)
        if w.samples:
            values["reward/pass_rate"] = w.passed / w.samples
        for stage, n in w.stages.items():
            values[f"verifier/{stage}"] = float(n)
        for cls, n in w.errors.items():
            values[f"verifier/error/{cls}"] = float(n)
        self.window = _Window(start=now)
        self.last_step, self.last_values = m.step, values
        return m.step, values


def busy_shares(handles: Iterable, previous: dict[str, float], seconds: float) -> dict[str, float]:
    """Per-actor share of the last `seconds` spent working, from the `busy_s` of the actors' health
    records (handles: anything with `.name` and `.health(timeout_s)`). `previous` holds the last
    reading per actor and is updated."""
    out = {}
    for handle in handles:
        try:
            busy = handle.health(timeout_s=10.0).busy_s
        except Exception as err:  # a dead actor: the supervisor deals with it
            log.debug("%s: no health for its busy share: %s", handle.name, err)
            continue
        if busy is None:  # an actor that does not count its busy time
            continue
        name = handle.name
        if name in previous and seconds > 0:
            # A counter that went down belongs to a restarted actor: all of it is since the last reading.
            worked = busy - previous[name] if busy >= previous[name] else busy
            out[f"busy/{name}"] = min(1.0, worked / seconds)
        previous[name] = busy
    return out
