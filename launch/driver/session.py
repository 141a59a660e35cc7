"""One training session: the cluster, the actors' lifecycle, and what the driver sees of them.

`Session` is what `launch/driver/train.py` drives. It starts Ray (or runs the actors in-process when
`cluster.use_ray` is false) with one placement group whose bundles are the placement plan's GPU
slots, clears the run's address registry and registers its own metrics socket there, launches the
actors through the `Supervisor`, turns what the actors push into metrics rows, the live view and
episode dumps, writes rollout-side progress rows every `logging.rollout_every_s` and warns when the
run makes no progress (launch/observe/progress.py), asks a rollout actor for evaluations, and at the end
exports the model, writes the summary and the report and stops everything in order (rollouts,
learner, verifiers, replay).

The driver decides when things happen, never how the algorithm runs: warm start, restore,
synchronous confirmation, minimum versions and the evaluation's tasks are the actors' business.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

from actors.base import Bind
from actors.policy.tokenizer import load_tokenizer
from configs import KilnConfig
from launch.driver import wiring
from launch.driver.checks import StartupError, errors, on_cluster
from launch.driver.handles import LearnerHandle, ReplayHandle, RolloutHandle
from launch.driver.monitor import RunMonitor, busy_shares
from launch.driver.plan import PlacementPlan, bundles, plan
from launch.driver.run_dir import RunDirectory
from launch.driver.supervisor import Supervisor
from launch.driver.tiny_checkpoint import resolve_model_path
from launch.observe.episode_dump import EpisodeDumper
from launch.observe.live import LiveView
from launch.observe.metrics import MetricsLog
from launch.observe.progress import NoProgressCheck, ProgressRows, ReplayCounts
from launch.observe.report import write_report
from launch.observe.timeline import TimelineLog
from launch.stages.eval.validation import record_validation
from protocols import metric_keys as mk
from protocols.registry import Registry

log = logging.getLogger(__name__)

SUPERVISE_EVERY_S = 1.0  # health checks of every actor (a death is seen at once: Supervisor.end_seen)
PLACEMENT_TIMEOUT_S = 300.0
STOP_ORDER = ["rollout-", "learner", "verifier-", "replay"]


class Session:
    def __init__(self, cfg: KilnConfig, run: RunDirectory, placement: PlacementPlan | None = None) -> None:
        """`placement`: the plan `kiln train` checked against the cluster; computed here when not given.
        `model.path: kiln:tiny-chat` is resolved (and built on first use) here."""
        cfg = resolve_model_path(cfg)
        self.cfg, self.run = cfg, run
        self.placement = placement if placement is not None else plan(cfg, check_fit=False)
        self._ray_started = False
        self._placement_group = None
        self.supervisor: Supervisor | None = None
        self.monitor: RunMonitor | None = None
        self.metrics: MetricsLog | None = None
        self.view: LiveView | None = None
        self.timeline: TimelineLog | None = None
        self.last_step = 0
        self.started = time.monotonic()  # the run's wall time (report.md and `kiln train` print it) counts from here
        self.rollouts_started: float | None = None
        self.progress: ProgressRows | None = None
        self.no_progress: NoProgressCheck | None = None
        self.warning: str | None = None  # the current no-progress warning
        self.warnings: list[str] = []  # every distinct one, for the summary and the report
        self._warned_at = 0.0
        self.stopped_for_no_progress = False
        self.dumper: EpisodeDumper | None = None
        self._decoded: dict[str, tuple[int, int]] = {}  # rollout actor -> (last reading, running total)
        self._last_supervise = 0.0
        self._busy: dict[str, float] = {}
        self._busy_at = time.monotonic()
        self._lag_seen: dict[int, int] = {}
        self._tokenizer = None

    # ------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Session":
        c = self.cfg.cluster
        registry = Registry(self.run.path)
        registry.clear()  # what an earlier driver's actors registered (a resumed run) is stale
        if c.use_ray:
            self._start_ray()
            self._placement_group = reserve_bundles(self.placement)
        self.supervisor = Supervisor(
            self.run.path,
            use_ray=c.use_ray,
            placement_group=self._placement_group,
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
        self.metrics = MetricsLog(self.run.path, self.cfg.logging)
        self.timeline = TimelineLog(self.run.path)
        self.view = LiveView(
            self.cfg.logging.live,
            self.cfg.algo.total_steps,
            refresh_s=self.cfg.logging.live_refresh_s,
            started=self.started,
        ).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.supervisor is not None:
            # A stopped engine is forgotten by the learner at once: a weight push in flight to it (a
            # run ended mid-step) fails now instead of at the push timeout.
            self.supervisor.stop_all(STOP_ORDER, on_stopped=self._forget_engine)
        try:  # the spans the actors pushed as they stopped
            self.monitor.poll(timeout_s=0.5)
            self.timeline.write(self.monitor.take_spans())
        except Exception:
            log.exception("saving the last timeline spans")
        for close in (
            lambda: self.view.__exit__(None, None, None),
            self.metrics.close,
            self.timeline.close,
            self.monitor.close,
        ):
            try:
                close()
            except Exception:
                log.exception("closing the session")
        Registry(self.run.path).unregister("driver")
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
        if self._ray_started:
            import ray

            ray.shutdown()

    def _start_ray(self) -> None:
        import ray

        c = self.cfg.cluster
        if ray.is_initialized():
            return
        if c.address:
            ray.init(address=c.address, log_to_driver=True)
        else:
            ray.init(num_cpus=c.num_cpus, num_gpus=c.num_gpus, include_dashboard=False, log_to_driver=True)
        self._ray_started = True

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
            self.metrics.log(0, report.metrics())

    def start_rollouts(self, *, follow_learner: bool = True, episode_log: bool = False) -> None:
        for spec in wiring.rollout_specs(
            self.cfg, self.placement, follow_learner=follow_learner, episode_log=episode_log
        ):
            self.supervisor.launch(spec)
        now = time.monotonic()
        self.rollouts_started = now
        self.progress = ProgressRows(self.cfg.logging.rollout_every_s, started=self.started)
        self.no_progress = NoProgressCheck(
            self.cfg.logging.no_progress_groups, self.cfg.logging.no_progress_s, started=now
        )

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
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.model)
        return self._tokenizer

    # -------------------------------------------------------------------------------- running

    def learner_finished(self) -> bool:
        try:
            return self.learner.health().finished
        except Exception:
            return False  # dead or busy: supervise() decides

    def rollouts_done(self, groups: int) -> bool:
        return self.replay.health().groups.settled >= groups

    def supervise(self) -> list[str]:
        now = time.monotonic()
        if now - self._last_supervise < SUPERVISE_EVERY_S and not self.supervisor.end_seen():
            return []
        self._last_supervise = now
        restarted = self.supervisor.check(on_death=self._on_death)
        if restarted:
            self.metrics.log(self.last_step, {mk.RUN_RESTARTS: float(len(self.supervisor.restarts))})
        return restarted

    def _on_death(self, name: str) -> None:
        # Before the replacement starts (seconds, for a rollout actor that loads a model): the dead
        # actor's groups go to the live rollout actors now, and the learner stops pushing to it.
        self._release_groups(name)
        self._forget_engine(name)

    def _forget_engine(self, name: str) -> None:
        """The learner stops pushing to a dead rollout actor's engine at once: a dead NCCL peer would
        stall its broadcast (and so the learner) until the push timeout."""
        if not name.startswith("rollout-") or "learner" not in self.supervisor.handles:
            return
        try:
            self.learner.drop_engine(name)
        except Exception:
            log.exception("telling the learner that %s died failed", name)

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
        self.last_step = step
        values.update(self._replay_values())
        now = time.monotonic()
        busy = busy_shares(self.supervisor.handles.values(), self._busy, now - self._busy_at)
        if not values.get(mk.ROLLOUT_GROUPS):  # no group finished in this window: no rollout share to show
            busy = {k: v for k, v in busy.items() if not k.startswith("busy/rollout-")}
        values.update(busy)
        self._busy_at = now
        self.metrics.log(step, values)
        self.view.update(step, values)
        self.timeline.write(self.monitor.take_spans())
        self._dump_episodes(step, values)

    def _dump_episodes(self, step: int, values: dict[str, float]) -> None:
        if not self.cfg.logging.episodes_per_step:
            return
        if self.dumper is None:
            self.dumper = EpisodeDumper(
                self.run.path,
                self.cfg.algo,
                self.tokenizer.decode,
                decode_prompt=self.tokenizer.decode_prompt,
                per_step=self.cfg.logging.episodes_per_step,
            )
        episodes, named = self.monitor.take_episodes()
        self.dumper.add(episodes)
        version = values.get(mk.WEIGHTS_VERSION)  # the version the step made; it trained for the one before
        self.dumper.learner_step(step, int(version) - 1 if version is not None else None, named)
        self.dumper.dump(step)

    def _replay_values(self) -> dict[str, float]:
        """Staleness of the samples trained since the last row, the episode-id invariant, and replay's
        run totals of the retry buffer and of filtered groups."""
        try:
            health = self.replay.health()
        except Exception:
            return {}
        hist = health.trained_lag.histogram
        new = {lag: n - self._lag_seen.get(lag, 0) for lag, n in hist.items() if n > self._lag_seen.get(lag, 0)}
        self._lag_seen = dict(hist)
        out = {mk.staleness_lag(lag): float(n) for lag, n in new.items()}
        if new:
            total = sum(new.values())
            out[mk.STALENESS_MEAN] = sum(lag * n for lag, n in new.items()) / total
            out[mk.STALENESS_MAX] = float(max(new))
        out.update(
            {
                mk.REPLAY_EMITTED: float(health.emitted),
                mk.REPLAY_TRAINED: float(health.trained),
                mk.REPLAY_FILTERED: float(health.filtered_total),
                mk.REPLAY_PENDING: float(health.pending),
                mk.REPLAY_INVARIANT_OK: float(health.invariant_ok),
                mk.REPLAY_RETRY_BUFFER: float(health.retry.size),
                mk.REPLAY_RETRY_ADMITTED: float(health.retry.admitted),
                mk.REPLAY_RETRY_SERVED: float(health.retry.served),
                mk.REPLAY_RETRY_TRAINED: float(health.groups.retry_trained),
            }
        )
        out.update({mk.replay_filtered_groups(reason): float(n) for reason, n in health.groups.filtered.items()})
        return out

    # ------------------------------------------------------------------------ rollout progress

    def watch_progress(self) -> None:
        """Every `logging.rollout_every_s`: a rollout-side progress row (metrics.jsonl, TensorBoard, the
        live view); and the no-progress warning, in the log and the live view, while it holds."""
        if self.progress is None:
            return
        now = time.monotonic()
        if not self.progress.due(now):
            return
        try:
            counts = ReplayCounts.of(self.replay.health())
        except Exception:  # replay restarting: the supervisor deals with it; the row goes without it
            counts = None
        values = self.progress.row(now, counts, self.monitor.take_progress(), self._decoded_tokens())
        self.metrics.log(self.last_step, values, tb_step=int(values[mk.PROGRESS_ELAPSED_S]))
        warning = self.no_progress.check(now, self.monitor.recent, counts, self.monitor.last_step_at)
        self._warn(warning, now)
        self.view.progress(values, warning)

    def _warn(self, warning: str | None, now: float) -> None:
        """Log a warning when it starts, and again every logging.no_progress_s while it lasts."""
        if warning is not None and (
            warning.split(";")[0] != (self.warning or "").split(";")[0]
            or now - self._warned_at >= self.cfg.logging.no_progress_s
        ):
            log.warning("%s", warning)
            self._warned_at = now
            if warning not in self.warnings:
                self.warnings.append(warning)
        self.warning = warning

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

    def _decoded_tokens(self) -> int | None:
        """Tokens the engines decoded so far, over every rollout actor (a restarted engine's counter
        starts again at 0); None when no rollout actor answered."""
        answered = False
        for handle in self.rollouts:
            try:
                now = handle.health(timeout_s=10.0).decoded_tokens
            except Exception:
                continue
            answered = True
            last, total = self._decoded.get(handle.name, (0, 0))
            self._decoded[handle.name] = (now, total + (now - last if now >= last else now))
        return sum(total for _, total in self._decoded.values()) if answered else None

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
        if not self.rollouts:
            return {}
        attempts = self.rollouts[0].evaluate()
        if not attempts:
            return {}
        values = record_validation(self.cfg, self.run.path, step, attempts)
        values[mk.EVAL_FINAL] = float(final)
        self.metrics.log(step, values)
        log.info("evaluation at step %d: %s", step, {k: round(v, 3) for k, v in values.items()})
        return values

    def export_final(self) -> Path:
        """RUN_DIR/final/ as an HF checkpoint; a resumed run replaces the earlier export only once the
        new one is complete."""
        final = self.run.final_model
        fresh = final.with_name(f"{final.name}.new-{int(time.time())}")
        self.learner.export_hf(str(fresh))
        if final.exists():
            old = final.with_name(f"{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            fresh.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            fresh.rename(final)
        return final

    def write_summary(self) -> dict:
        """RUN_DIR/summary.json: replay's ledger (the episode-id invariant), versions, restarts."""
        replay, learner = self.replay.health(), self.learner.health()
        summary = {
            "episodes": {
                "emitted": replay.emitted,
                "trained": replay.trained,
                "filtered": replay.filtered,
                "filtered_total": replay.filtered_total,
                "pending": replay.pending,
                "invariant_ok": replay.invariant_ok,
            },
            "groups": dataclasses.asdict(replay.groups),
            "highest_version_seen": replay.highest_version_seen,
            "learner": {"version": learner.version, "step": learner.step, "restored_from": learner.restored_from},
            "restarts": [dataclasses.asdict(r) for r in self.supervisor.restarts],
            "retry": dataclasses.asdict(replay.retry),
            "wall_s": round(time.monotonic() - self.started, 1),
            "stopped": "no progress (algo.stop_after_no_progress_s)" if self.stopped_for_no_progress else None,
            "warnings": self.warnings,
        }
        (self.run.path / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def write_report(self) -> Path:
        """report.md (and report.html) of the run; its wall time is this session's, the one `kiln train`
        prints (summary.json's `wall_s`)."""
        return write_report(self.run.path, html=self.cfg.logging.html_report)


def reserve_bundles(placement: PlacementPlan, timeout_s: float = PLACEMENT_TIMEOUT_S):
    """The run's Ray placement group: one bundle per GPU slot of the plan (None when the plan has no
    GPU). Waits until Ray has reserved every bundle; a cluster that cannot hold them fails here."""
    gpu_bundles = bundles(placement)
    if not gpu_bundles:
        return None
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([b.resources for b in gpu_bundles], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except Exception:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not reserve the plan's {len(gpu_bundles)} GPU bundles within {timeout_s:g} s "
            f"({sum(len(b.gpus) for b in gpu_bundles)} GPUs): is the cluster smaller than "
            "cluster.num_gpus?"
        ) from None
    return group
