"""A seeded discrete-event simulation of asynchronous RL around the real `ReplayActor`: fast rollout
workers, a slow learner, and engines that load new weights late. It shows what admission control and
the staleness filter guarantee: no trained sample lags the learner by more than η, and η = 0 is
exactly synchronous on-policy training.

Model (virtual time; the replay itself is real, with its log on disk, driven through `handle()`):
* W rollout workers each run one group at a time: ask the task feed, sample G episodes of random
  (heavy-tailed) length, send each episode when it finishes, then ask again (or wait as told).
* An episode's first half of tokens carries the weight version its engine served when it started,
  the second half the version at its end (weights change mid-generation, as with partial rollouts).
* The learner asks for a batch at its version, trains for a fixed time, then publishes the next
  version; each worker's engine loads it after its own random delay.
* Each task has a hidden pass rate; a failed first turn gets one repair turn.

Run `python -m tests.helpers.simulation` from the repository root for the table in docs/replay.md.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import heapq
import itertools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from actors.base import RunContext
from actors.buffer.actor import ReplayActor
from actors.buffer.health import ReplayHealth
from configs import AlgoConfig, ReplayConfig
from configs.schema import RetryConfig
from protocols import BatchReply, BatchRequest, Task, TaskReply, TaskRequest

from .synthetic import TurnSpec, make_episode

TEXT_TASKS = "actors.buffer.examples.TextMatchTasks"


@dataclass
class SimConfig:
    eta: int
    seed: int = 0
    workers: int = 8
    group_size: int = 4
    batch_groups: int = 4
    steps: int = 30
    train_time: float = 4.0  # learner seconds per step
    sample_time: float = 1.0  # median seconds per episode (lognormal, sigma 0.6)
    sync_delay: tuple[float, float] = (0.2, 2.0)  # an engine loads a new version this long after it is published
    retry_after_s: float = 0.2
    tie_rate: float = 0.0  # share of groups whose every attempt fails alike (score -1): tied, filtered
    keep_rate_window: int = 64  # replay.keep_rate_window (0: a running group counts whole against the bound)


@dataclass
class SimResult:
    eta: int
    steps: int
    end_time: float
    trained_samples: int
    max_lag: int  # measured on the TrainBatches themselves, not taken from replay's counters
    mean_lag: float
    lag_histogram: dict[int, int]
    filtered: dict[str, int]
    admission_waits: int
    learner_wait_time: float
    invariant_ok: bool
    health: ReplayHealth | None = field(repr=False, default=None)

    @property
    def samples_per_time(self) -> float:
        return self.trained_samples / self.end_time

    @property
    def learner_busy(self) -> float:
        return 1.0 - self.learner_wait_time / self.end_time


class Simulation:
    def __init__(self, cfg: SimConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        replay = ReplayConfig(
            task_source=TEXT_TASKS,
            retry_after_s=cfg.retry_after_s,
            keep_rate_window=cfg.keep_rate_window,
            retry=RetryConfig(capacity=16, probability=0.25, max_retries=2),
        )
        algo = AlgoConfig(
            group_size=cfg.group_size,
            batch_groups=cfg.batch_groups,
            total_steps=cfg.steps,
            seed=cfg.seed,
            max_staleness=cfg.eta,
            train_turns="first",  # one trained sequence per episode, as docs/replay.md's table counts them
        )
        self.actor = ReplayActor(replay, algo, RunContext(run_dir=str(run_dir), name="replay"))
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.version = 0
        self.published = [(0.0, 0)]  # (time, version)
        self.load_delay = self.rng.uniform(*cfg.sync_delay, size=(cfg.workers, cfg.steps + 2))
        self.lags: list[int] = []
        self.learner_wait = 0.0
        self.done = False

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self) -> SimResult:
        for w in range(self.cfg.workers):
            self.at(0.0, lambda w=w: self.worker_ask(w))
        self.at(0.0, self.learner_ask)
        while self._events and not self.done:
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        health = self.actor.health()
        self.actor.stop()
        hist = dict(sorted(collections.Counter(self.lags).items()))
        return SimResult(
            eta=self.cfg.eta,
            steps=self.version,
            end_time=self.now,
            trained_samples=len(self.lags),
            max_lag=max(self.lags, default=0),
            mean_lag=float(np.mean(self.lags)) if self.lags else 0.0,
            lag_histogram=hist,
            filtered=health.filtered,
            admission_waits=health.admission.waits,
            learner_wait_time=self.learner_wait,
            invariant_ok=health.invariant_ok,
            health=health,
        )

    # ------------------------------------------------------------------------------- engines

    def engine_version(self, worker: int, t: float) -> int:
        """The newest version this worker's engine has loaded by time t."""
        loaded = 0
        for pub_time, v in self.published:
            if pub_time + (self.load_delay[worker, v] if v else 0.0) <= t:
                loaded = max(loaded, v)
        return loaded

    # ------------------------------------------------------------------------------- rollouts

    def worker_ask(self, w: int) -> None:
        reply = self.actor.handle(TaskRequest(actor_id=f"rollout-{w}"))
        assert isinstance(reply, TaskReply), reply
        if reply.status == "stop":
            return
        if reply.status == "wait":
            self.at(self.now + reply.retry_after_s, lambda: self.worker_ask(w))
            return
        start, start_version = self.now, self.engine_version(w, self.now)
        ends = start + self.rng.lognormal(np.log(self.cfg.sample_time), 0.6, size=reply.group_size)
        tied = self.cfg.tie_rate > 0 and self.rng.random() < self.cfg.tie_rate
        for i, end in enumerate(ends):
            self.at(end, lambda i=i, end=end: self.finish_sample(w, reply, i, start_version, end, tied))
        self.at(float(ends.max()) + 1e-9, lambda: self.worker_ask(w))

    def finish_sample(
        self, w: int, reply: TaskReply, index: int, start_version: int, end: float, tied: bool = False
    ) -> None:
        end_version = self.engine_version(w, end)
        if tied:  # every attempt of the group fails alike: no signal, the group is filtered as tied
            versions = [start_version] * 3 + [end_version] * 3
            turns = [TurnSpec(passed=False, score=-1.0, versions=versions)] * 2
        else:
            turns = self.sample_turns(reply.task, start_version, end_version)
        ack = self.actor.handle(make_episode(reply.task, reply.group_id, index, turns, rng=self.rng))
        assert ack.status == "stored", ack

    def sample_turns(self, task: Task, v0: int, v1: int) -> list[TurnSpec]:
        rate = _pass_rate(task.task_id) * (1.5 if task.repair is not None else 1.0)
        versions = [v0] * 3 + [v1] * 3
        first = self._attempt(rate, versions)
        if first.passed:
            return [first]
        return [first, self._attempt(rate / 2, [v1] * 6)]

    def _attempt(self, rate: float, versions: list[int]) -> TurnSpec:
        if self.rng.random() < rate:
            return TurnSpec(passed=True, score=1.0 + 0.5 * float(self.rng.random()), versions=versions)
        score = -1.0 if self.rng.random() < 0.5 else -0.5 + 0.5 * float(self.rng.random()) * 0.99
        return TurnSpec(passed=False, score=score, versions=versions)

    # -------------------------------------------------------------------------------- learner

    def learner_ask(self) -> None:
        reply = self.actor.handle(BatchRequest(learner_id="learner", version=self.version))
        assert isinstance(reply, BatchReply), reply
        if reply.status == "stop":
            self.done = True
            return
        if reply.status == "wait":
            self.learner_wait += reply.retry_after_s
            self.at(self.now + reply.retry_after_s, self.learner_ask)
            return
        b = reply.batch
        for s in range(len(b.advantages)):
            lo, hi = b.cu_seqlens[s], b.cu_seqlens[s + 1]
            grad = b.versions[lo:hi][b.loss_mask[lo:hi].astype(bool)]
            if grad.size:
                self.lags.append(int(self.version - grad.min()))
        self.at(self.now + self.cfg.train_time, self.learner_publish)

    def learner_publish(self) -> None:
        self.version += 1
        self.published.append((self.now, self.version))
        self.learner_ask()


def _pass_rate(task_id: str) -> float:
    """A task's hidden pass rate, fixed by its id."""
    return int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:4], "big") / 2**32 * 0.6


def simulate(cfg: SimConfig, run_dir: Path | None = None) -> SimResult:
    if run_dir is not None:
        return Simulation(cfg, run_dir).run()
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        return Simulation(cfg, Path(tmp)).run()


def table(results: list[SimResult]) -> str:
    rows = [
        (
            "| η | steps | trained samples | max lag | mean lag | lag histogram | filtered (groups) | "
            "admission waits | samples / time | learner busy |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        hist = ", ".join(f"{k}: {v}" for k, v in r.lag_histogram.items())
        filt = ", ".join(f"{k} {v}" for k, v in sorted(r.health.groups.filtered.items())) or "-"
        rows.append(
            f"| {r.eta} | {r.steps} | {r.trained_samples} | {r.max_lag} | {r.mean_lag:.2f} | {hist} | "
            f"{filt} | {r.admission_waits} | {r.samples_per_time:.2f} | {r.learner_busy:.0%} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--tie-rate", type=float, default=0.0, help="share of groups whose attempts all fail alike")
    p.add_argument("--keep-rate-window", type=int, default=64, help="replay.keep_rate_window (0: the plain bound)")
    args = p.parse_args()
    runs = [
        SimConfig(
            eta=e,
            seed=args.seed,
            steps=args.steps,
            workers=args.workers,
            tie_rate=args.tie_rate,
            keep_rate_window=args.keep_rate_window,
        )
        for e in args.eta
    ]
    print(table([simulate(cfg) for cfg in runs]))


if __name__ == "__main__":
    main()
