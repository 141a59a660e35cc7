"""What the driver writes as a run goes: `RunRecorder` owns the metrics log (metrics.jsonl, TensorBoard),
the timeline, the live view, the episode dumps and the rollout-side progress rows with their
no-progress warning. The session hands it readings (a learner step's row, replay's health, the
rollouts' and verifiers' health); it never calls an actor itself, so what it writes is a function of
what it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from actors.buffer.health import ReplayHealth
from configs import KilnConfig
from launch.driver.monitor import RunMonitor
from launch.observe.episode_dump import EpisodeDumper
from launch.observe.live import LiveView
from launch.observe.metrics import MetricsLog
from launch.observe.progress import (
    NoProgressCheck,
    ProgressRows,
    ReplayCounts,
    StartReadings,
    Warnings,
    waiting_story,
)
from launch.observe.step_rows import StepRows
from launch.observe.timeline import TimelineLog
from protocols import metric_keys as mk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProgressReadings:
    """One progress tick's readings: replay's counts (None: it did not answer), each answering rollout
    actor's decoded-token counter, and, before the first group, what the rollouts and verifiers do."""

    counts: ReplayCounts | None
    decoded: dict[str, int]
    start: StartReadings | None


class DecodedTokens:
    """Tokens the engines decoded so far, over every rollout actor; a restarted engine's counter
    starts again at 0, so each actor's readings are summed as a running total."""

    def __init__(self) -> None:
        self._by_actor: dict[str, tuple[int, int]] = {}  # actor -> (last reading, running total)

    def add(self, actor: str, reading: int) -> None:
        last, total = self._by_actor.get(actor, (0, 0))
        self._by_actor[actor] = (reading, total + (reading - last if reading >= last else reading))

    @property
    def total(self) -> int:
        return sum(total for _, total in self._by_actor.values())


class RunRecorder:
    def __init__(self, cfg: KilnConfig, run_dir: Path, monitor: RunMonitor, *, started: float, now: float) -> None:
        self.cfg, self.run_dir, self.monitor = cfg, run_dir, monitor
        self.metrics = MetricsLog(run_dir, cfg.logging)
        self.timeline = TimelineLog(run_dir)
        self.view = LiveView(
            cfg.logging.live, cfg.algo.total_steps, refresh_s=cfg.logging.live_refresh_s, started=started
        ).__enter__()
        self.rows = StepRows(now)
        self.warnings = Warnings(cfg.logging.no_progress_s)
        self.decoded = DecodedTokens()
        self.started = started
        self.progress: ProgressRows | None = None  # from the rollouts' start on
        self.no_progress: NoProgressCheck | None = None
        self._dumper: EpisodeDumper | None = None
        self.last_step = 0

    def rollouts_started(self, now: float) -> None:
        self.progress = ProgressRows(self.cfg.logging.rollout_every_s, started=self.started)
        self.no_progress = NoProgressCheck(
            self.cfg.logging.no_progress_groups, self.cfg.logging.no_progress_s, started=now
        )

    def step(
        self,
        step: int,
        values: dict[str, float],
        replay: ReplayHealth | None,
        handles: Iterable,
        now: float,
        tokenizer: Callable[[], object],
    ) -> None:
        """A learner step's row, completed (StepRows), into the metrics log and the live view; the
        actors' spans into the timeline; the step's episodes into the dumps. `tokenizer` is called
        only when episodes are dumped (loading one takes seconds)."""
        self.last_step = step
        values = self.rows.complete(values, replay, handles, now)
        self.metrics.log(step, values)
        self.view.update(step, values)
        self.timeline.write(self.monitor.take_spans())
        if self.cfg.logging.episodes_per_step:
            self._dump_episodes(step, values, tokenizer)

    def _dump_episodes(self, step: int, values: dict[str, float], tokenizer: Callable[[], object]) -> None:
        if self._dumper is None:
            tok = tokenizer()
            self._dumper = EpisodeDumper(
                self.run_dir,
                self.cfg.algo,
                tok.decode,
                decode_prompt=tok.decode_prompt,
                per_step=self.cfg.logging.episodes_per_step,
            )
        episodes, named = self.monitor.take_episodes()
        self._dumper.add(episodes)
        version = values.get(mk.WEIGHTS_VERSION)  # the version the step made; it trained for the one before
        self._dumper.learner_step(step, int(version) - 1 if version is not None else None, named)
        self._dumper.dump(step)

    def progress_due(self, now: float) -> bool:
        return self.progress is not None and self.progress.due(now)

    def progress_row(self, now: float, r: ProgressReadings) -> None:
        """A rollout-side progress row (metrics.jsonl, TensorBoard, the live view) with what the run
        waits for before its first group; and the no-progress warning, in the log and the live view,
        while it holds."""
        for actor, reading in r.decoded.items():
            self.decoded.add(actor, reading)
        decoded = self.decoded.total if r.decoded else None  # None: no rollout actor answered
        values = self.progress.row(now, r.counts, self.monitor.take_progress(), decoded)
        self.metrics.log(self.last_step, values, tb_step=int(values[mk.PROGRESS_ELAPSED_S]))
        warning = self.no_progress.check(now, self.monitor.recent, r.counts, self.monitor.last_step_at)
        if self.warnings.update(warning, now):
            log.warning("%s", warning)
        self.view.progress(values, warning, waiting=waiting_story(r.counts, r.start))

    def close(self) -> None:
        """Close the records; first, dump the first episode of any mechanism that arrived after the
        last step's dump (the session polled the actors' last messages before this)."""
        if self._dumper is not None:
            try:
                self._dumper.add(self.monitor.take_episodes()[0])
                self._dumper.dump_unshown(self.last_step)
            except Exception:
                log.exception("dumping the session's last episodes")
        for close in (lambda: self.view.__exit__(None, None, None), self.metrics.close, self.timeline.close):
            try:
                close()
            except Exception:
                log.exception("closing the run's records")
