"""`LearnerActor` (docs/architecture.md, docs/training.md): asks replay for a batch at its weight version, takes one
off-policy-corrected step on it (its mini-batch updates: actors.learner.algorithm), pushes the new
weights to the engines and announces the version. One batch is one weight version.

Versions only grow. A fresh learner takes its warm-start steps (`warm_start.steps` cross-entropy steps
on reference solutions, built here from the training tasks that replay serves and the solution files)
and serves the result as version 0. A learner whose run already announced a version (a restart, or
`kiln train --resume`) restores its last checkpoint instead. When that checkpoint is as new as every
version announced before (the highest it recorded, and the highest replay has seen: it asks replay),
it continues at the checkpoint's version; otherwise at a version above all of them. It pushes its
weights at once and tells replay which versions the restore discarded, so samples they produced are
dropped, never trained on. With η = 0 (`algo.max_staleness`) it waits for the engines
to confirm each version before asking for the next batch (synchronous mode).

Exports (`export_hf`: RUN_DIR/final/ at the driver's request, RUN_DIR/exports/step-NNNNNN/ every
`learner.export_every` steps) are servable HF directories: the backend's weights and config plus the
tokenizer, chat template and a generation config with the rollout's sampling settings.

Timeline: each step is recorded as "training" and each weight push (with, at η = 0, the wait for the
engines' confirmations) as "syncing" (protocols.timeline), pushed to the driver.

It finds replay and the driver's metrics socket in the run's registry and registers its weight
endpoints there as "learner", where engines look them up. Runs in-process and as a Ray actor.

A learner of several ranks (megatron TP x DP, or torch data parallelism) is one LearnerActor per rank
(`RunContext.rank` of `world_size`); rank 0 is the learner above and the others follow its backend
calls (`actors.learner.ranks`). Rank 0 registers the group's rendezvous address ("ranks") before the
others join it. Several ranks need one process each, hence Ray.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from actors import decisions
from actors.base import Actor, RunContext
from actors.learner.algorithm import StepResult, Trainer
from actors.learner.backends import make_trainer
from actors.learner.checkpoint import CheckpointMeta, read_latest, step_dir_name, write_checkpoint
from actors.learner.health import LearnerHealth, WarmStartReport
from actors.learner.ranks import (
    LeaderBackend,
    RankCall,
    RankSpec,
    SftStep,
    TrainStep,
    follow,
    host_rendezvous,
    join,
)
from actors.learner.warm_start import warm_start_batches
from actors.learner.weight_sync import WeightServer
from actors.policy.export import GenerationSettings, export_servable
from actors.policy.weights import choose_transport
from configs import AlgoConfig, LearnerConfig, ModelConfig, WarmStartConfig
from protocols import (
    BatchReply,
    BatchRequest,
    Metrics,
    TaskList,
    TaskListRequest,
    TrainBatch,
    VersionsSeen,
    VersionsSeenRequest,
)
from protocols import metric_keys as mk
from protocols.channels import ChannelTimeout, NoServer, PushChannel, ReconnectingClient, RemoteError
from protocols.lease import DeviceLease
from protocols.timeline import SpanRecorder
from protocols.witness import TRAINED, WitnessLog

log = logging.getLogger(__name__)

ANNOUNCED_FILE = "announced.json"  # the highest version this run's learners ever announced
EXPORTS = "exports"  # RUN_DIR/exports/step-NNNNNN/: the servable HF exports of `learner.export_every`
CONFIRM_TIMEOUT_S = 300.0
REPLAY_WAIT_S = 300.0  # how long start() waits for replay's answers (versions seen, training tasks)
RANKS_WAIT_S = 300.0  # how long a follower rank waits for its leader's rendezvous address
NAME = "learner"  # the registry name of rank 0, the learner peers talk to


class LearnerActor(Actor):
    role = "learner"

    def __init__(
        self,
        model: ModelConfig,
        learner: LearnerConfig,
        algo: AlgoConfig,
        warm_start: WarmStartConfig,
        ctx: RunContext,
        *,
        temperature: float,
        request_timeout_s: float = 30.0,
        generation: GenerationSettings | None = None,
    ) -> None:
        """`temperature` is the rollout temperature (the behaviour logprobs' convention); `generation` the
        rollout's sampling settings, written into every HF export (default: sampling at `temperature`)."""
        super().__init__(ctx)
        self.model_cfg, self.cfg, self.algo, self.warm_cfg, self.ctx = model, learner, algo, warm_start, ctx
        self.temperature = temperature
        self.generation = generation or GenerationSettings(temperature=temperature)
        self.dir = ctx.path
        (self.dir / "learner").mkdir(parents=True, exist_ok=True)
        self.learner_id = "learner-0" if ctx.rank == 0 else f"learner-0.rank{ctx.rank}"
        self.device = _resolve_device(learner.device)
        self._replay = ReconnectingClient(
            ctx.registry.resolver("replay", "replay"), timeout_s=request_timeout_s, retries=1
        )
        self.busy_s = 0.0
        self.lease = DeviceLease(self.device)
        self.shares_gpu = ctx.slot.colocated  # engines on this GPU: CUDA IPC instead of NCCL, released per step
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.version = 0
        self.step = 0  # RL steps taken (batches, each of several optimizer updates), across restores
        self.discarded_above = -1  # a restore discarded the versions in (discarded_above, version)
        self.backend: Trainer | LeaderBackend | None = None
        self.weights: WeightServer | None = None
        self._metrics: PushChannel | None = None
        self.timeline = SpanRecorder(ctx.name or self.learner_id, None)  # until start() finds the driver
        self._finished = False
        self._told_to_stop = False  # replay answered "stop": the run has its total_steps
        self._witness = WitnessLog(ctx.path, TRAINED, self.learner_id)  # protocols/witness.py
        self.warm_start_report: WarmStartReport | None = None
        self.stats = {
            "steps": 0,
            "batch_waits": 0,
            "replay_timeouts": 0,
            "checkpoints": 0,
            "push_s": 0.0,
            "restored_from": -1,
            "rolled_back": 0,  # versions a restore found lost (announced after the checkpoint it restored)
        }
        # Seconds of each phase of start() (build, restore or warm_start, serve): what a restart costs;
        # "prepare" is the model build a standby did ahead ("build" is then only what was left).
        self.start_phases: dict[str, float] = {}
        self._prepared: Trainer | None = None  # built by prepare(), taken by start()
        self._preparing = threading.Lock()

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        """Build (or restore, or warm-start) the model, serve its weights, register them and start the
        training loop. A follower rank joins its group, follows its leader's calls and serves nothing."""
        clock = time.perf_counter()
        metrics = self.ctx.registry.address("driver", "metrics")
        self.timeline = SpanRecorder(self.ctx.name or self.learner_id, metrics or None)
        channel = None
        if self.world_size > 1:
            spec, store = self._rendezvous()
            channel = join(spec, self.device, store)
        with self._preparing:  # a standby started while still preparing waits for its model
            if self._prepared is None:
                self._prepared = self._build()
            backend, self._prepared = self._prepared, None
        self.start_phases["build"] = time.perf_counter() - clock
        if not self.is_leader:
            self.backend = backend
            self.spawn(lambda: follow(backend, channel, self._count_call), "follow")
            return {}
        self.backend = LeaderBackend(backend, channel) if channel is not None else backend
        if metrics:
            self._metrics = PushChannel(metrics)
        ws = self.cfg.weight_sync
        transport = choose_transport(ws.transport, self.device, self.shares_gpu)
        self.weights = WeightServer(
            self.dir,
            transport,
            ws.bucket_mb,
            host=self.ctx.bind.host,
            timeout_s=ws.process_group.push_timeout_s,
            join_timeout_s=ws.process_group.join_timeout_s,
            keep_disk=ws.disk.keep_versions,
            flat_buckets=ws.process_group.flat_buckets,
        )
        clock = time.perf_counter()
        if self._read_announced() >= 0:  # this run's learner announced before: continue above it
            self._restore()
            self.start_phases["restore"] = time.perf_counter() - clock
        else:
            self._warm_start()
            self.start_phases["warm_start"] = time.perf_counter() - clock
        clock = time.perf_counter()
        endpoints = self.weights.start()
        self._push()  # version 0 (or the restored version) before any engine asks for weights
        self.ctx.registry.register(NAME, self.role, {**self.ctx.registry.endpoints(NAME), **endpoints})
        self.start_phases["serve"] = time.perf_counter() - clock
        log.info(
            "%s: serving version %d; start took %s",
            self.learner_id,
            self.version,
            ", ".join(f"{k} {v:.3f} s" for k, v in self.start_phases.items()),
        )
        self.spawn(self._loop, "train")
        return endpoints

    def prepare(self) -> None:
        """Build the model and its optimizer, and nothing else: no checkpoint is read, nothing is served
        or registered. A warm standby (the supervisor's spare learner) is prepared ahead, so that taking
        over from a dead learner costs only `start()`'s restore and serve (`start_phases`)."""
        clock = time.perf_counter()
        with self._preparing:
            if self._prepared is None:
                self._prepared = self._build()
        self.start_phases["prepare"] = time.perf_counter() - clock

    def _build(self) -> Trainer:
        return make_trainer(self.model_cfg, self.cfg, self.algo, temperature=self.temperature, device=self.device)

    def _rendezvous(self) -> tuple[RankSpec, dist.Store | None]:
        """The rank group's rendezvous: rank 0 opens its store and registers where; the others wait for
        that. (The supervisor unregisters a dead group before restarting it, so no rank finds an old
        address.)"""
        registry, bind = self.ctx.registry, self.ctx.bind
        store = None
        if self.rank == 0:
            store = host_rendezvous(bind.host, self.world_size)
            master = f"{bind.advertise or bind.host}:{store.port}"
            registry.register(NAME, self.role, {"ranks": master})
        else:
            master = registry.wait(NAME, "ranks", RANKS_WAIT_S)
        return RankSpec(self.rank, self.world_size, master), store

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _count_call(self, call: RankCall, seconds: float) -> None:
        if isinstance(call, (TrainStep, SftStep)):
            now = time.time()
            self.timeline.record("training", now - seconds, now)
            self.busy_s += seconds
            self.stats["steps"] += isinstance(call, TrainStep)

    def stop(self) -> None:
        if isinstance(self.backend, LeaderBackend):
            self.backend.stop_followers()
        super().stop()
        self.timeline.close()
        self._witness.close()
        self._replay.close()
        if self.weights is not None:
            self.weights.stop()
        if self._metrics is not None:
            self._metrics.close()

    def health(self) -> LearnerHealth:
        return LearnerHealth(
            role=self.role,
            alive=not self.stopping,
            looping=self.threads_running,
            finished=self._finished,
            busy_s=self.busy_s,
            learner_id=self.learner_id,
            rank=self.ctx.rank,
            version=self.version,
            step=self.step,
            discarded_above=self.discarded_above,
            **self.stats,
            warm_start=self.warm_start_report,
            start_phases=dict(self.start_phases),
            weights=self.weights.health() if self.weights is not None else {},
        )

    # --------------------------------------------------------------------------- warm start

    def _warm_start(self) -> None:
        """Cross-entropy steps on reference solutions before RL; their result becomes version 0 (saved,
        with checkpointing on, so that a restart resumes from it rather than from the initial weights).
        The batches are built here from the training tasks replay serves; without a solution that fits,
        no step is taken and version 0 is the initial weights."""
        w = self.warm_cfg
        if not w.steps:
            return
        started = time.monotonic()
        reply = self._ask_replay(TaskListRequest(split="train"), TaskList)
        batches, pairs = warm_start_batches(reply.tasks, w, self.model_cfg)
        if not batches:
            log.warning(
                "warm start: no solution in %s fits a training task and model.max_seq_len; skipped", w.solutions
            )
            return
        losses = []
        for i in range(w.steps):
            with self.timeline.span("training"):
                result = self.backend.sft_step(batches[i % len(batches)], lr=w.lr)
            losses.append(result.loss)
            self._emit(-1, {mk.SFT_LOSS: result.loss, mk.SFT_STEP_S: result.seconds})
        # Saved whatever learner.checkpoint_every says: a restart must not redo (or silently lose) the
        # warm start, and a restore without a checkpoint can then take the initial weights as version 0.
        self.checkpoint()
        self.warm_start_report = WarmStartReport(
            steps=len(losses),
            solutions=pairs,
            first_loss=losses[0],
            final_loss=losses[-1],
            seconds=time.monotonic() - started,
        )
        log.info(
            "warm start: %d steps on %d solutions in %.0f s, loss %.3f -> %.3f",
            len(losses),
            pairs,
            self.warm_start_report.seconds,
            losses[0],
            losses[-1],
        )

    def _ask_replay(self, rec, answer: type):
        """One request that start() cannot do without: retried until replay answers (or REPLAY_WAIT_S)."""
        deadline = time.monotonic() + REPLAY_WAIT_S
        while True:
            try:
                reply = self._replay.request(rec)
            except (ChannelTimeout, RemoteError) as err:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.learner_id}: replay did not answer {type(rec).__name__}: {err}"
                    ) from None
                time.sleep(0.5)
                continue
            if not isinstance(reply, answer):
                # the peer broke the protocol; not a caller's type error
                raise RuntimeError(f"{self.learner_id}: replay answered {type(reply).__name__} to {type(rec).__name__}")  # noqa: TRY004
            return reply

    # ------------------------------------------------------------------------------- training

    def _loop(self) -> None:
        while not self.stopping and self.step < self.algo.total_steps and not self._told_to_stop:
            batch = self._next_batch()
            if batch is None:
                continue
            t = time.perf_counter()
            with self.timeline.span("training"):
                if self.shares_gpu:  # colocated: the engines give the GPU back for the step
                    self.weights.release_engines()
                # The step holds the shared device lease: a verifier timing a kernel on this device holds
                # it exclusively, and the learner waits (between steps, never inside one) until it is done.
                with self.weights.updating(), self.lease.shared():  # no engine may read a half-stepped model
                    result = self.backend.train_step(batch)
            self.version += 1
            self.step += 1
            self.stats["steps"] += 1
            # The learner's own account of what it trained, before the version is announced: had the
            # step's result been lost unannounced, replay gives its batch back (it was never consumed).
            self._witness.write([f"{self.version} {e}" for e in dict.fromkeys(batch.episode_ids)])
            with self.timeline.span("syncing"):
                push_s = self._push()
                if decisions.waits_for_engines(self.algo.max_staleness):
                    self.weights.wait_confirmed(self.version, None, CONFIRM_TIMEOUT_S)
            self.busy_s += time.perf_counter() - t
            if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                self.checkpoint()
            # Reported once saved: a learner killed right after a step it reported restores that step,
            # at its own version, and the batch being made for the next one stays on-policy.
            self._emit(self.step, self._step_values(result, batch, push_s), _step_episodes(result, batch))
            if self.cfg.export_every and self.step % self.cfg.export_every == 0:
                self.export_hf(self.dir / EXPORTS / step_dir_name(self.step))
        if not self.stopping:
            self.checkpoint()
            self._finished = True

    def _next_batch(self) -> TrainBatch | None:
        """One request to replay: the batch, or None after waiting as told (or on a timeout)."""
        reply = self._request(
            BatchRequest(
                learner_id=self.learner_id, version=self.version, discarded_above=self.discarded_above, step=self.step
            )
        )
        if reply is None:
            self._stop.wait(0.5)
            return None
        # Replay logs a request before it answers: it has the rolled-back range now. Sent again with a
        # later version, the same lower end would roll back this restore's own new versions too.
        self.discarded_above = -1
        if reply.status == "stop":
            self._told_to_stop = True
            return None
        if reply.status == "wait":
            self.stats["batch_waits"] += 1
            self._stop.wait(reply.retry_after_s)
            return None
        return reply.batch

    def _request(self, rec: BatchRequest) -> BatchReply | None:
        try:
            reply = self._replay.request(rec)
        except NoServer:
            return None
        except ChannelTimeout:  # replay may be restarting, on a new address: the client looks it up again
            self.stats["replay_timeouts"] += 1
            return None
        except RemoteError as err:
            log.error("%s: replay refused the batch request: %s", self.learner_id, err)
            self._stop.wait(1.0)
            return None
        if not isinstance(reply, BatchReply):
            log.error("%s: replay answered %s to a batch request", self.learner_id, type(reply).__name__)
            return None
        return reply

    def _step_values(self, result: StepResult, batch: TrainBatch, push_s: float) -> dict[str, float]:
        return {
            mk.TRAIN_LOSS: result.loss,
            mk.TRAIN_GRAD_NORM: result.grad_norm,
            mk.TRAIN_STEP_S: result.seconds,
            mk.TRAIN_TOKENS: float(result.tokens),
            mk.TRAIN_TRAINED_TOKENS: float(result.trained_tokens),
            mk.TRAIN_TOKENS_PER_S: result.tokens / max(result.seconds, 1e-9),
            mk.TRAIN_SEQUENCES: float(len(batch.advantages)),
            mk.TRAIN_OFF_POLICY_KEPT: float(_off_policy_kept(result, batch)),
            mk.WEIGHTS_VERSION: float(self.version),
            mk.WEIGHTS_SYNC_S: push_s,
            **{mk.train(k): float(v) for k, v in result.metrics.items()},
        }

    # ------------------------------------------------------------------------- weights, state

    def _push(self) -> float:
        """Record the version as announced (durably, first), then push and announce it."""
        self._record_announced(self.version)
        t = time.perf_counter()
        self.weights.publish(self.version, self.backend.named_weights)
        seconds = time.perf_counter() - t
        self.stats["push_s"] = seconds
        return seconds

    def drop_engine(self, engine_id: str, stopped: bool = False) -> bool:
        """The driver saw this engine's actor die, or (`stopped`) stopped it at the run's end: stop pushing
        to it (a push blocked on it fails now). An orderly stop is not a failure and is logged as such."""
        if self.weights is None:
            return False
        if stopped:
            return self.weights.drop(engine_id, "the run stopped its actor", expected=True)
        return self.weights.drop(engine_id, "its actor died")

    def wait_confirmed(self, engines: list[str], timeout_s: float) -> bool:
        """True once every named engine confirmed the current version (synchronous mode, tests)."""
        return self.weights.wait_confirmed(self.version, engines, timeout_s)

    def checkpoint(self) -> str:
        latest = read_latest(self.dir)
        if latest is not None and latest[1].step == self.step:
            # These weights are saved already (a periodic save then the final one, or a restore with no
            # step since); a restore's version comes from announced.json, not from the checkpoint.
            return str(latest[0])
        meta = CheckpointMeta(version=self.version, step=self.step, time=time.time())
        path = write_checkpoint(self.dir, self.backend, meta)
        self.stats["checkpoints"] += 1
        log.info("%s: checkpoint at version %d in %s", self.learner_id, self.version, path)
        return str(path)

    def export_hf(self, path: str | Path) -> str:
        """A servable HF directory at `path`: the backend's weights and config, then the tokenizer, chat
        template and generation config (actors.policy.export), renamed into place once complete."""
        path = export_servable(path, self.backend.export_hf, self.model_cfg, self.generation)
        log.info("%s: exported step %d as an HF checkpoint in %s", self.learner_id, self.step, path)
        return str(path)

    def _restore(self) -> None:
        latest = read_latest(self.dir)
        announced = self._read_announced()
        if latest is not None:
            path, meta = latest
            self.backend.load_checkpoint(path)
            kept, self.step = meta.version, meta.step
            self.stats["restored_from"] = meta.version
            log.info("%s: restored %s (version %d, step %d)", self.learner_id, path, meta.version, meta.step)
        else:  # the initial weights are version 0's: a warm start always saves its result
            kept, self.step = 0, 0
        # A checkpoint as new as every version announced and every version replay has seen is the state
        # those versions were made from: continue at its version (the engines hold those weights and
        # the samples made with them stay on-policy). Otherwise the newer versions are rolled back: go
        # above all of them (a version number never names two weights), and replay filters the samples
        # they made as `rolled_back`; the run makes the lost steps again (replay counts steps, not versions).
        seen = self._ask_replay(VersionsSeenRequest(learner_id=self.learner_id), VersionsSeen)
        newest = max(announced, seen.highest)
        if kept >= newest:
            self.version, self.discarded_above = kept, -1
            return
        self.version, self.discarded_above = newest + 1, kept
        self.stats["rolled_back"] = newest - kept
        log.warning(
            "%s: versions %d..%d were rolled back (%s; learner.checkpoint_every=%d): continuing at version %d "
            "with step %d's weights; samples they made are filtered as rolled_back",
            self.learner_id,
            kept + 1,
            newest,
            "no checkpoint" if latest is None else f"the latest checkpoint is version {kept}",
            self.cfg.checkpoint_every,
            self.version,
            self.step,
        )

    def _announced_path(self) -> Path:
        return self.dir / "learner" / ANNOUNCED_FILE

    def _read_announced(self) -> int:
        try:
            return int(json.loads(self._announced_path().read_text())["version"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def _record_announced(self, version: int) -> None:
        _write_json(self._announced_path(), {"version": version})

    def _emit(self, step: int, values: dict[str, float], episodes: dict[str, list[str]] | None = None) -> None:
        if self._metrics is None:
            return
        try:
            self._metrics.send(
                Metrics(source=self.learner_id, step=step, ts=time.time(), values=values, episodes=episodes or {}),
                timeout_s=1.0,
            )
        except Exception as err:  # noqa: BLE001 - metrics are best effort; training goes on
            log.debug("%s: metrics push failed: %s", self.learner_id, err)


def _step_episodes(result: StepResult, batch: TrainBatch) -> dict[str, list[str]]:
    """The step's episodes by what happened to them, for the driver's episode dumps: those with a
    sequence trained on (MirrorPop kept it) and those with a sequence MirrorPop dropped, each named
    once. `episode_ids` names each sequence's episode (one per gradient-carrying turn); a batch that
    does not is not named, and the metrics only count it."""
    if len(batch.episode_ids) != len(batch.advantages):
        return {}
    dropped = set(result.dropped)
    return {
        "trained": list(dict.fromkeys(e for i, e in enumerate(batch.episode_ids) if i not in dropped)),
        "mirrorpop_dropped": list(dict.fromkeys(batch.episode_ids[i] for i in sorted(dropped))),
    }


def _off_policy_kept(result: StepResult, batch: TrainBatch) -> int:
    """Sequences trained on (MirrorPop kept them) whose oldest gradient-carrying token was made by an
    older version than the batch's: the off-policy samples the step learned from."""
    dropped, n = set(result.dropped), 0
    for s, (lo, hi) in enumerate(zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True)):
        versions = np.asarray(batch.versions[lo:hi])[np.asarray(batch.loss_mask[lo:hi], dtype=bool)]
        n += s not in dropped and versions.size > 0 and int(versions.min()) < batch.version
    return n


def _write_json(path: Path, value) -> None:
    """Atomically and durably: a reader sees the old content or the new, never a torn file."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
