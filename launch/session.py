"""One training session: the cluster, the actors, and what the driver sees of them.

`Session` is what `launch/train.py` drives: it starts Ray (or runs the actors in-process when
`cluster.use_ray` is false), launches the actors through the `Supervisor`, turns what the actors
push into metrics rows, the live view, episode dumps and evaluations, and at the end exports the
model, writes the report and stops everything in order (rollouts, learner, verifiers, replay).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from actors.buffer.task_source import load_task_set
from actors.learner.warm_start import sft_batches, solution_pairs
from actors.policy.tokenizer import load_tokenizer
from configs import KilnConfig
from launch import wiring
from launch.episode_dump import dump_episodes
from launch.evaluation import eval_metrics
from launch.live import LiveView
from launch.metrics import MetricsLog
from launch.monitor import RunMonitor
from launch.report import write_report
from launch.run_dir import RunDirectory
from launch.supervisor import ActorSpec, Supervisor

log = logging.getLogger(__name__)

SUPERVISE_EVERY_S = 5.0
STOP_ORDER = ["rollout-", "learner", "verifier-", "replay"]


class Session:
    def __init__(self, cfg: KilnConfig, run: RunDirectory) -> None:
        self.cfg, self.run = cfg, run
        self._ray_started = False
        self.supervisor = Supervisor(use_ray=cfg.cluster.use_ray)
        self.monitor: RunMonitor | None = None
        self.metrics: MetricsLog | None = None
        self.view: LiveView | None = None
        self.last_step = 0
        self._last_supervise = 0.0
        self._busy: dict[str, float] = {}
        self._busy_at = time.monotonic()
        self._lag_seen: dict[int, int] = {}
        self._tokenizer = None

    # ------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Session":
        c = self.cfg.cluster
        if c.use_ray:
            self._start_ray()
        self.monitor = RunMonitor(self.cfg.algo, host=c.bind_host, transport=c.transport, advertise=c.advertise_host)
        self.metrics = MetricsLog(self.run.path, self.cfg.logging)
        self.view = LiveView(self.cfg.logging.live, self.cfg.algo.total_steps,
                             refresh_s=self.cfg.logging.live_refresh_s).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.supervisor.stop_all(STOP_ORDER)
        for close in (lambda: self.view.__exit__(None, None, None), self.metrics.close, self.monitor.close):
            try:
                close()
            except Exception:
                log.exception("closing the session")
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

    def _launch(self, spec: ActorSpec):
        return self.supervisor.launch(spec)

    def start_replay_and_verifiers(self, *, admit_everything: bool = False) -> None:
        # Rollout-only runs have no learner to advance the admission bound: admit the whole run.
        eta = self.cfg.algo.total_steps if admit_everything else None
        self._launch(wiring.replay_spec(self.cfg, self.run.path, max_staleness=eta))
        for spec in wiring.verifier_specs(self.cfg):
            self._launch(spec)

    def start_offline_replay(self, episodes: Path) -> None:
        from actors.buffer.offline import OfflineReplayActor

        c = self.cfg.cluster
        self._launch(ActorSpec(name="replay", cls=OfflineReplayActor, num_cpus=0, kwargs=lambda: dict(
            episodes=str(episodes), algo=self.cfg.algo, run_dir=str(self.run.path), host=c.bind_host,
            transport=c.transport, advertise=c.advertise_host)))

    def start_learner(self, *, resume: bool, warm_start: bool = False) -> None:
        """Build (or restore) the learner and serve its weights; its loop starts with run_learner().
        With `warm_start`, version 0 is published by warm_start(), which must come next."""
        self.supervisor.launch_group(wiring.learner_specs(self.cfg, self.run.path, self.supervisor,
                                                          self.monitor.address, resume=resume,
                                                          warm_start=warm_start))

    def run_learner(self) -> None:
        learner = self.supervisor["learner"]
        learner.call("run")
        learner.spec.after_start = lambda h: h.call("run")  # a restarted learner trains at once

    def warm_start(self) -> None:
        """`algo.sft_warmup_steps` cross-entropy steps on the shipped solutions; the learner publishes
        the result as version 0 (or its initial weights, when no solution fits) before engines join."""
        a = self.cfg.algo
        if not a.sft_warmup_steps:
            return
        tasks = load_task_set(self.cfg.replay, self.cfg.verifier.backend).train
        solutions = a.sft_solutions or str(Path(self.cfg.replay.tasks) / "solutions" / self.cfg.verifier.backend)
        pairs = solution_pairs(tasks, solutions)
        batches = sft_batches(pairs, self.tokenizer, max_seq_len=self.cfg.model.max_seq_len,
                              batch_tokens=a.sft_batch_tokens)
        if not batches:
            log.warning("warm start: no solution in %s fits a training task and model.max_seq_len; skipped",
                        solutions)
        started = time.monotonic()
        losses = self.supervisor["learner"].call("warm_start", batches, a.sft_warmup_steps, a.sft_lr)
        if not losses:
            return
        log.info("warm start: %d steps on %d solutions in %.0f s, loss %.3f -> %.3f", len(losses), len(pairs),
                 time.monotonic() - started, losses[0], losses[-1])
        self.metrics.log(0, {"sft/first_loss": losses[0], "sft/final_loss": losses[-1],
                             "sft/steps": float(len(losses)), "sft/seconds": time.monotonic() - started})

    def start_rollouts(self, *, with_learner: bool = True, episode_log: Path | None = None) -> None:
        if episode_log is not None:
            episode_log.mkdir(parents=True, exist_ok=True)
        for spec in wiring.rollout_specs(self.cfg, self.run.path, self.supervisor, self.monitor.address,
                                         with_learner=with_learner, episode_log=episode_log):
            self._launch(spec)
        wiring.write_endpoints(self.run.path, self.supervisor.handles)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.model)
        return self._tokenizer

    # -------------------------------------------------------------------------------- running

    def learner_finished(self) -> bool:
        try:
            return bool(self.supervisor["learner"].call("health", timeout_s=30.0).get("finished"))
        except Exception:
            return False  # dead or busy: supervise() decides

    def rollouts_done(self, groups: int) -> bool:
        health = self.supervisor["replay"].call("health")
        g = health["groups"]
        return g["trained"] + g["ready"] + sum(g["filtered"].values()) >= groups

    def supervise(self) -> list[str]:
        now = time.monotonic()
        if now - self._last_supervise < SUPERVISE_EVERY_S:
            return []
        self._last_supervise = now
        restarted = self.supervisor.check(on_restart=self._release_groups, on_death=self._forget_engine)
        if any(name.startswith("verifier-") for name in restarted):  # new addresses: re-point rollouts
            pool = ",".join(h.endpoints["verifier"] for h in self.supervisor.role("verifier-"))
            for rollout in self.supervisor.role("rollout-"):
                rollout.call("rewire_verifier", pool)
        if restarted:
            wiring.write_endpoints(self.run.path, self.supervisor.handles)
            self.metrics.log(self.last_step, {"run/restarts": float(len(self.supervisor.restarts))})
        return restarted

    def _forget_engine(self, name: str) -> None:
        """The learner stops pushing to a dead rollout actor's engine at once: a dead NCCL peer would
        stall its broadcast (and so the learner) until the push timeout."""
        if not name.startswith("rollout-") or "learner" not in self.supervisor.handles:
            return
        try:
            self.supervisor["learner"].call("drop_engine", name, timeout_s=30.0)
        except Exception:
            log.exception("telling the learner that %s died failed", name)

    def _release_groups(self, name: str) -> None:
        """A restarted rollout actor's in-flight groups are re-issued at once, not at their timeout."""
        if not name.startswith("rollout-") or "replay" not in self.supervisor.handles:
            return
        try:
            released = self.supervisor["replay"].call("release_actor", name, timeout_s=30.0)
            log.info("%s restarted: %d in-flight group(s) re-issued", name, released)
        except Exception:
            log.exception("releasing the groups of %s failed (they re-issue when they expire)", name)

    def record_step(self, step: int, values: dict[str, float]) -> None:
        self.last_step = step
        values.update(self._replay_values())
        now = time.monotonic()
        values.update(wiring.busy_fractions(self.supervisor, self._busy, now - self._busy_at))
        self._busy_at = now
        self.metrics.log(step, values)
        self.view.update(step, values)
        episodes = self.monitor.take_episodes()
        if episodes and self.cfg.logging.episodes_per_step:
            dump_episodes(self.run.path, step, episodes, self.tokenizer.decode, self.cfg.logging.episodes_per_step)

    def _replay_values(self) -> dict[str, float]:
        """Staleness of the samples trained since the last row, and the episode-id invariant."""
        try:
            health = self.supervisor["replay"].call("health", timeout_s=30.0)
        except Exception:
            return {}
        hist = {int(k): int(v) for k, v in health["trained_lag"]["histogram"].items()}
        new = {lag: n - self._lag_seen.get(lag, 0) for lag, n in hist.items() if n > self._lag_seen.get(lag, 0)}
        self._lag_seen = hist
        out = {f"staleness/lag_{lag}": float(n) for lag, n in new.items()}
        if new:
            total = sum(new.values())
            out["staleness/mean"] = sum(lag * n for lag, n in new.items()) / total
            out["staleness/max"] = float(max(new))
        out.update({"replay/emitted": float(health["emitted"]), "replay/trained": float(health["trained"]),
                    "replay/filtered": float(health["filtered_total"]), "replay/pending": float(health["pending"]),
                    "replay/invariant_ok": float(health["invariant_ok"])})
        return out

    def drain_metrics(self, seconds: float = 2.0) -> None:
        for step, values in self.monitor.poll(timeout_s=seconds):
            self.record_step(step, values)

    def checkpoint(self) -> None:
        try:
            self.supervisor["learner"].call("checkpoint", timeout_s=300.0)
        except Exception:
            log.exception("checkpoint on interrupt failed")

    # ------------------------------------------------------------------------ eval and report

    def evaluation_due(self, step: int) -> bool:
        every = self.cfg.logging.eval_every
        return bool(every) and step % every == 0

    def evaluate(self, step: int, *, final: bool = False) -> dict[str, float]:
        """The validation split, k samples per task, first turn only, through rollout-0's engine and
        the same verifier as training."""
        tasks = load_task_set(self.cfg.replay, self.cfg.verifier.backend).val
        rollouts = self.supervisor.role("rollout-")
        if not tasks or not rollouts:
            return {}
        n, k = self.cfg.algo.eval_samples, self.cfg.logging.eval_k
        started = time.monotonic()
        results = rollouts[0].call("evaluate", tasks, n)
        values = eval_metrics(results, k)
        values.update({"eval/val_tasks": float(len(tasks)), "eval/seconds": time.monotonic() - started,
                       "eval/final": float(final)})
        self.metrics.log(step, values)
        log.info("evaluation at step %d: %s", step, {k: round(v, 3) for k, v in values.items()})
        return values

    def export_final(self) -> Path:
        """RUN_DIR/final/ as an HF checkpoint; a resumed run replaces the earlier export only once the
        new one is complete."""
        final = self.run.final_model
        fresh = final.with_name(f"{final.name}.new-{int(time.time())}")
        self.supervisor["learner"].call("export_hf", str(fresh))
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
        replay = self.supervisor["replay"].call("health")
        learner = self.supervisor["learner"].call("health")
        summary = {
            "episodes": {k: replay[k] for k in ("emitted", "trained", "filtered", "filtered_total", "pending",
                                                "invariant_ok")},
            "groups": replay["groups"],
            "highest_version_seen": replay["highest_version_seen"],
            "learner": {"version": learner["version"], "step": learner["step"],
                        "restored_from": learner["restored_from"]},
            "restarts": [{"time": t, "actor": name} for t, name in self.supervisor.restarts],
        }
        (self.run.path / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def write_report(self) -> Path:
        return write_report(self.run.path)
