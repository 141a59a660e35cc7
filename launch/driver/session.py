"""One training session: the cluster, the actors' lifecycle, and what the driver sees of them.

`Session` is what `launch/driver/train.py` drives. It starts Ray with the plan's placement group
(launch/driver/cluster.py; or runs the actors in-process when `cluster.use_ray` is false), clears the
run's address registry and registers its own metrics socket there, launches the actors through the
`Supervisor`, reads the actors' health and hands the readings to the `RunRecorder`
(launch/observe/recorder.py: metrics rows, the live view, episode dumps, progress rows and the
no-progress warning), asks a rollout actor for evaluations (launch/stages/eval/validation.py), and at
the end exports the model, writes the summary (launch/observe/summary.py) and the report, and stops
everything in order (rollouts, learner, verifiers, replay).

The driver decides when things happen, never how the algorithm runs: warm start, restore,
synchronous confirmation, minimum versions and the evaluation's tasks are the actors' business.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Self

from actors.base import Bind
from actors.policy.tokenizer import load_tokenizer
from configs import KilnConfig
from launch.driver import wiring
from launch.driver.checks import StartupError, errors, on_cluster
from launch.driver.cluster import RayCluster
from launch.driver.handles import ActorHandle, LearnerHandle, ReplayHandle, RolloutHandle
from launch.driver.monitor import RunMonitor
from launch.driver.plan import PlacementPlan, plan
from launch.driver.run_dir import RunDirectory
from launch.driver.supervisor import Supervisor
from launch.driver.tiny_checkpoint import resolve_model_path
from launch.observe.id_check import IdCheck, check_ids, read_witnesses
from launch.observe.progress import ReplayCounts, StartReadings
from launch.observe.recorder import ProgressReadings, RunRecorder
from launch.observe.report import write_report
from launch.observe.stall import Readings, StallWatch, diagnose
from launch.observe.summary import RunSummary
from launch.stages.eval.validation import record_validation
from protocols import metric_keys as mk
from protocols.registry import Registry

log = logging.getLogger(__name__)

SUPERVISE_EVERY_S = 1.0  # health checks of every actor (a death is seen at once: Supervisor.end_seen)
HEALTH_S = 10.0  # a progress tick's health calls
STOP_ORDER = ["rollout-", "learner", "verifier-", "replay"]


class Session:
    def __init__(self, cfg: KilnConfig, run: RunDirectory, placement: PlacementPlan | None = None) -> None:
        """`placement`: the plan `kiln train` checked against the cluster; computed here when not given.
        `model.path: kiln:tiny-chat` is resolved (and built on first use) here."""
        cfg = resolve_model_path(cfg)
        self.cfg, self.run = cfg, run
        self.placement = placement if placement is not None else plan(cfg, check_fit=False)
        self.started = time.monotonic()  # the run's wall time (report.md and `kiln train` print it) counts from here
        self.cluster: RayCluster | None = None
        self.supervisor: Supervisor | None = None
        self.monitor: RunMonitor | None = None
        self.recorder: RunRecorder | None = None
        self.rollouts_started: float | None = None
        self.stopped_for_no_progress = False
        self.stall: StallWatch | None = None  # the stall watchdog, once the rollouts started
        self.stalls = 0
        self._batch_waits_at_step = 0  # the learner's batch requests answered "wait", at its last step
        self._last_supervise = 0.0
        self._tokenizer = None

    # ------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Self:
        c = self.cfg.cluster
        self.number = self.run.begin_session()
        registry = Registry(self.run.path)
        registry.clear()  # what an earlier driver's actors registered (a resumed run) is stale
        if c.use_ray:
            self.cluster = RayCluster(c, self.placement).__enter__()
        self.supervisor = Supervisor(
            self.run.path,
            use_ray=c.use_ray,
            placement_group=self.cluster.placement_group if self.cluster is not None else None,
            bind=Bind(host=c.bind_host, transport=c.transport, advertise=c.advertise_host),
            log_level=self.cfg.logging.level,
        )
        self.monitor = RunMonitor(
            self.cfg.algo,
            host=c.bind_host,
            transport=c.transport,
            advertise=c.advertise_host,
            recent_groups=self.cfg.logging.no_progress_groups,
        )
        registry.register("driver", "driver", {"metrics": self.monitor.address})
        self.recorder = RunRecorder(self.cfg, self.run.path, self.monitor, started=self.started, now=time.monotonic())
        return self

    def __exit__(self, *exc) -> None:
        if self.supervisor is not None:
            # A stopped engine is forgotten by the learner at once: a weight push in flight to it (a
            # run ended mid-step) fails now instead of at the push timeout.
            self.supervisor.stop_all(STOP_ORDER, on_stopped=lambda name: self._forget_engine(name, stopped=True))
        try:  # the spans the actors pushed as they stopped
            self.monitor.poll(timeout_s=0.5)
            self.recorder.timeline.write(self.monitor.take_spans())
        except Exception:
            log.exception("saving the last timeline spans")
        for close in (self.recorder.close, self.monitor.close):
            try:
                close()
            except Exception:
                log.exception("closing the session")
        Registry(self.run.path).unregister("driver")
        if self.cluster is not None:
            self.cluster.__exit__(*exc)

    # ------------------------------------------------------------------------------- starting

    def check_components(self) -> None:
        """On a Ray cluster (`cluster.address`), each component's start-up checks on the node Ray places
        it on; raises StartupError with every finding when one is an error. A local run's components
        were checked on this machine before the session (`kiln train`)."""
        if not (self.cfg.cluster.use_ray and self.cfg.cluster.address):
            return
        findings = on_cluster(self.cfg, self.placement, self.supervisor.ray_options)
        for finding in findings:
            (log.error if finding.level == "error" else log.warning if finding.level == "warning" else log.info)(
                "%s", finding.text
            )
        if errors(findings):
            raise StartupError(findings)

    def start_replay_and_verifiers(self) -> None:
        self.supervisor.launch(wiring.replay_spec(self.cfg))
        for spec in wiring.verifier_specs(self.cfg, self.placement):
            self.supervisor.launch(spec)

    def start_offline_replay(self, episodes: Path) -> None:
        self.supervisor.launch(wiring.offline_replay_spec(self.cfg, episodes))

    def start_learner(self) -> None:
        """Build (or restore, or warm-start) the learner; it publishes its version and starts training."""
        self.supervisor.launch_group(wiring.learner_specs(self.cfg, self.placement))
        report = self.learner.health().warm_start
        if report is not None:
            self.recorder.metrics.log(0, report.metrics())

    def start_rollouts(self, *, follow_learner: bool = True, episode_log: bool = False) -> None:
        released = self.replay.release_earlier_session()  # a resumed run: its rollout actors died with the driver
        if released:
            log.info("replay: %d group(s) of the earlier session's rollout actors re-issued", released)
        for spec in wiring.rollout_specs(
            self.cfg, self.placement, follow_learner=follow_learner, episode_log=episode_log
        ):
            self.supervisor.launch(spec)
        self.rollouts_started = time.monotonic()
        self.recorder.rollouts_started(self.rollouts_started)
        lg = self.cfg.logging
        self.stall = StallWatch(lg.stall_factor, lg.stall_first_step_s, since=self.rollouts_started)

    @property
    def replay(self) -> ReplayHandle:
        return self.supervisor["replay"]

    @property
    def learner(self) -> LearnerHandle:
        return self.supervisor["learner"]

    @property
    def rollouts(self) -> list[RolloutHandle]:
        return self.supervisor.role("rollout-")

    @property
    def last_step(self) -> int:
        return self.recorder.last_step

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.model)
        return self._tokenizer

    # -------------------------------------------------------------------------------- running

    def learner_finished(self) -> bool:
        try:
            return self.learner.health().finished
        except Exception:  # noqa: BLE001 - dead or busy: supervise() decides
            return False

    def rollouts_done(self, groups: int) -> bool:
        return self.replay.health().groups.settled >= groups

    def supervise(self) -> list[str]:
        now = time.monotonic()
        if now - self._last_supervise < SUPERVISE_EVERY_S and not self.supervisor.end_seen():
            return []
        self._last_supervise = now
        restarted = self.supervisor.check(on_death=self._on_death)
        if restarted:
            self.recorder.metrics.log(self.last_step, {mk.RUN_RESTARTS: float(len(self.supervisor.restarts))})
        return restarted

    def _on_death(self, name: str) -> None:
        # Before the replacement starts (seconds, for a rollout actor that loads a model): the dead
        # actor's groups go to the live rollout actors now, and the learner stops pushing to it.
        self._release_groups(name)
        self._forget_engine(name)

    def _forget_engine(self, name: str, *, stopped: bool = False) -> None:
        """The learner stops pushing to a dead (or, at the run's end, `stopped`) rollout actor's engine
        at once: a dead NCCL peer would stall its broadcast (and so the learner) until the push timeout."""
        if not name.startswith("rollout-") or "learner" not in self.supervisor.handles:
            return
        try:
            self.learner.drop_engine(name, stopped=stopped)
        except Exception:
            log.exception("telling the learner that %s %s failed", name, "stopped" if stopped else "died")

    def _release_groups(self, name: str) -> None:
        """A dead rollout actor's in-flight groups are re-issued at once, not at their timeout."""
        if not name.startswith("rollout-") or "replay" not in self.supervisor.handles:
            return
        try:
            released = self.replay.release_actor(name)
            log.info("%s restarted: %d in-flight group(s) re-issued", name, released)
        except Exception:
            log.exception("releasing the groups of %s failed (they re-issue when they expire)", name)

    def record_step(self, step: int, values: dict[str, float]) -> None:
        replay = self._health(self.replay)  # None while replay restarts: the row goes without its figures
        handles = self.supervisor.handles.values()
        self.recorder.step(step, values, replay, handles, time.monotonic(), tokenizer=lambda: self.tokenizer)
        if self.stall is not None:
            self.stall.step(time.monotonic())
            learner = self._health(self.learner)
            self._batch_waits_at_step = learner.batch_waits if learner is not None else self._batch_waits_at_step

    def watch_stall(self) -> str | None:
        """The stall watchdog (launch/observe/stall.py): once per stall, the line that names who waits
        for what, logged and kept for the report, and every actor's state in RUN_DIR/logs/stall-NNN.json."""
        now = time.monotonic()
        if self.stall is None or not self.stall.due(now):
            return None
        learner = self._health(self.learner) if "learner" in self.supervisor.handles else None
        readings = Readings(
            learner=learner,
            replay=self._health(self.replay),
            rollouts={h.name: self._health(h) for h in self.rollouts},
            verifiers={h.name: self._health(h) for h in self.supervisor.role("verifier-")},
            batch_groups=self.cfg.algo.batch_groups,
            learner_asking=learner is not None and learner.batch_waits > self._batch_waits_at_step,
        )
        since = self.stall.steps[-1] if self.stall.steps else self.stall.since
        line = diagnose(readings, now - since)
        self.stalls += 1
        dump = self.run.path / "logs" / f"stall-{self.stalls:03d}.json"
        dump.parent.mkdir(parents=True, exist_ok=True)
        dump.write_text(json.dumps({"diagnosis": line, **dataclasses.asdict(readings)}, indent=1, default=str))
        log.error("stall: %s (every actor's state: %s)", line, dump)
        self.recorder.warnings.seen.append(f"stall: {line}")
        return line

    # ------------------------------------------------------------------------ rollout progress

    def watch_progress(self) -> None:
        """Every `logging.rollout_every_s`: a rollout-side progress row, with what the run waits for
        until its first group completes, and the no-progress warning while it holds."""
        now = time.monotonic()
        if self.recorder.progress_due(now):
            self.recorder.progress_row(now, self._progress_readings())

    def _progress_readings(self) -> ProgressReadings:
        replay = self._health(self.replay)  # None while replay restarts: the row goes without it
        counts = ReplayCounts.of(replay) if replay is not None else None
        rollouts = {h.name: self._health(h) for h in self.rollouts}
        rollouts = {name: health for name, health in rollouts.items() if health is not None}
        start = None
        if counts is None or counts.groups == 0:  # before the first group: what the run waits for
            verifiers = [v for v in map(self._health, self.supervisor.role("verifier-")) if v is not None]
            start = StartReadings(
                engines=len(rollouts),
                engines_serving=sum(h.engine_alive for h in rollouts.values()),
                in_flight=sum(h.inflight for h in rollouts.values()),
                at_verifier=sum(max(v.received - v.replied, 0) for v in verifiers),
                verified=sum(v.replied for v in verifiers),
                verifiers=len(verifiers),
                warming=sum(v.warming for v in verifiers),
            )
        decoded = {name: health.decoded_tokens for name, health in rollouts.items()}
        return ProgressReadings(counts=counts, decoded=decoded, start=start)

    @staticmethod
    def _health(handle: ActorHandle):
        """The actor's health record, or None when it does not answer (the supervisor deals with it)."""
        try:
            return handle.health(timeout_s=HEALTH_S)
        except Exception:  # noqa: BLE001 - no answer, for whatever reason: the supervisor deals with it
            return None

    def no_progress_stop(self) -> bool:
        """True once `algo.stop_after_no_progress_s` passed without a learner step (since the rollouts
        started, or the last step): the run ends cleanly."""
        limit = self.cfg.algo.stop_after_no_progress_s
        if limit is None or self.rollouts_started is None:
            return False
        since = max(self.rollouts_started, self.monitor.last_step_at or 0.0)
        if time.monotonic() - since < limit:
            return False
        log.warning(
            "no learner step for %.0f s (algo.stop_after_no_progress_s): ending the run; the report follows", limit
        )
        self.stopped_for_no_progress = True
        return True

    def drain_metrics(self, seconds: float = 2.0) -> None:
        for step, values in self.monitor.poll(timeout_s=seconds):
            self.record_step(step, values)

    def checkpoint(self) -> None:
        try:
            self.learner.checkpoint()
        except Exception:
            log.exception("checkpoint on interrupt failed")

    # ------------------------------------------------------------------------ eval and report

    def evaluation_due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return bool(every) and step % every == 0

    def evaluate(self, step: int, *, final: bool = False) -> dict[str, float]:
        """The validation split through rollout-0 (its engine, the training verifier, the evaluation's
        sampling settings); the rollout actor loads the tasks from replay and returns the verified
        attempts, which `kiln eval`'s code summarizes and writes to RUN_DIR/eval/step-NNNNNN/."""
        attempts = self.rollouts[0].evaluate() if self.rollouts else []
        values = record_validation(self.cfg, self.run.path, step, attempts, final=final)
        if values:
            self.recorder.metrics.log(step, values)
        return values

    def export_final(self) -> Path:
        """RUN_DIR/final/ as an HF checkpoint (a resumed run's earlier one replaced once it is complete)."""
        return self.run.replace_final(lambda fresh: self.learner.export_hf(str(fresh)))

    def write_summary(self) -> dict:
        """RUN_DIR/summary.json: replay's ledger (the episode-id invariant), versions, restarts, and every
        session of the run (RUN_DIR/sessions.jsonl: this one's end is recorded here)."""
        learner = self.learner.health()
        self.run.end_session(
            self.number,
            {
                "wall_s": round(time.monotonic() - self.started, 1),
                "step": learner.step,
                "version": learner.version,
                "restored_from": learner.restored_from,
                "rolled_back": learner.rolled_back,
            },
        )
        ids = self.check_ids()
        return RunSummary(
            replay=self.replay.health(),
            learner=learner,
            id_check=ids,
            sessions=tuple(self.run.sessions()),
            restarts=tuple(self.supervisor.restarts),
            wall_s=time.monotonic() - self.started,
            stopped_for_no_progress=self.stopped_for_no_progress,
            warnings=tuple(self.recorder.warnings.seen),
        ).write(self.run.path)

    def check_ids(self) -> IdCheck:
        """The no-loss check over the whole run (every session): what the rollout actors say replay
        acknowledged, what replay stored and did, and what the learner says it trained."""
        acked, trained = read_witnesses(self.run.path)
        result = check_ids(acked, trained, self.replay.ledger_ids())
        (log.info if result.ok else log.error)("%s", result.line())
        return result

    def write_report(self) -> Path:
        """report.md (and report.html) of the run; its wall time is this session's, the one `kiln train`
        prints (summary.json's `wall_s`)."""
        return write_report(self.run.path, html=self.cfg.logging.html_report)
