"""`LearnerActor` (DESIGN.md §2, §7): asks replay for a batch at its weight version, takes one
off-policy-corrected step on it (its mini-batch updates: actors.learner.algorithm), pushes the new
weights to the engines and announces the version. One batch is one weight version.

Versions only grow. A fresh learner serves version 0 (the initial, or warm-started, weights). A
learner restored from its last checkpoint continues at a version above every version announced
before (the highest it recorded, and the highest replay has seen, which the driver passes as
`min_version`), pushes its weights at once, and tells replay which versions the restore discarded
so samples they produced are dropped, never trained on. Runs in-process and as a Ray actor.

A learner of several ranks (megatron TP x DP, or torch data parallelism) is one LearnerActor per rank
(`rank`, `world_size`, `master`); rank 0 is the learner above and the others follow its backend calls
(`actors.learner.ranks`). Several ranks need one process each, hence Ray.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

from actors.base import Actor
from actors.learner.algorithm import StepResult, Trainer
from actors.learner.backends import make_trainer
from actors.learner.checkpoint import CheckpointMeta, read_latest, write_checkpoint
from actors.learner.ranks import LeaderBackend, RankSpec, follow, join
from actors.learner.weight_sync import WeightServer
from actors.policy.weights import choose_transport
from configs import AlgoConfig, LearnerConfig, ModelConfig
from protocols import BatchReply, BatchRequest, Metrics, TrainBatch
from protocols.channels import ChannelTimeout, PushChannel, RemoteError, RequestClient

log = logging.getLogger(__name__)

ANNOUNCED_FILE = "announced.json"  # the highest version this run's learners ever announced
ENDPOINT_FILE = "endpoint.json"  # where the current learner serves its weights
CONFIRM_TIMEOUT_S = 300.0


class LearnerActor(Actor):
    role = "learner"

    def __init__(self, model: ModelConfig, learner: LearnerConfig, algo: AlgoConfig, *, temperature: float,
                 run_dir: str | Path, replay: str | Callable[[], str], metrics: str | None = None,
                 learner_id: str = "learner-0", device: str = "cpu", host: str = "127.0.0.1",
                 resume: bool = False, min_version: int = 0, confirm_before_next: bool = False,
                 shares_gpu: bool = False, rank: int = 0, world_size: int = 1, master: str = "",
                 warm_start_follows: bool = False, request_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.model_cfg, self.cfg, self.algo = model, learner, algo
        self.temperature = temperature
        self.dir = Path(run_dir)
        (self.dir / "learner").mkdir(parents=True, exist_ok=True)
        self.learner_id, self.device, self.host = learner_id, device, host
        self._replay = replay if callable(replay) else (lambda: replay)
        self._metrics_address = metrics
        self._resume, self._min_version = resume, min_version
        # The driver warm-starts this learner before any engine joins: version 0 is then the warm-started
        # weights, published by warm_start() rather than by start().
        self._warm_start_follows = warm_start_follows
        self._timeout_s = request_timeout_s
        # Synchronous mode (η = 0): engines confirm each version before the next batch is asked for,
        # so no sample is made with weights one version old (it could never be trained on).
        self.confirm_before_next = confirm_before_next
        self.busy_s = 0.0
        self.shares_gpu = shares_gpu  # colocated with its engines: CUDA IPC instead of NCCL
        self.ranks = RankSpec(rank, world_size, master) if world_size > 1 else None
        self.version = 0
        self.step = 0  # RL steps taken (batches, each of several optimizer updates), across restores
        self.discarded_above = -1  # a restore discarded the versions in (discarded_above, version)
        self.backend: Trainer | LeaderBackend | None = None
        self.weights: WeightServer | None = None
        self._replay_client: RequestClient | None = None
        self._replay_address = ""
        self._metrics: PushChannel | None = None
        self._finished = False
        self.stats = {"steps": 0, "batch_waits": 0, "replay_timeouts": 0, "checkpoints": 0, "push_s": 0.0,
                      "restored_from": -1}

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        """Build (or restore) the model, serve its weights, and return the weight endpoints. The
        training loop starts with `run()`, so a driver can warm-start and wire engines first. A follower
        rank joins its group, follows its leader's calls and returns no endpoints."""
        channel = join(self.ranks, self.device) if self.ranks is not None else None
        backend = make_trainer(self.model_cfg, self.cfg, self.algo, temperature=self.temperature,
                               device=self.device)
        if not self.is_leader:
            self.backend = backend
            self.spawn(lambda: follow(backend, channel, self._count_call), "follow")
            return {}
        self.backend = LeaderBackend(backend, channel) if channel is not None else backend
        if self._resume:
            self._restore()
        transport = choose_transport(self.cfg.weight_sync, self.device, self.shares_gpu)
        self.weights = WeightServer(self.dir, transport, self.cfg.bucket_mb, host=self.host)
        endpoints = self.weights.start()
        _write_json(self.dir / "learner" / ENDPOINT_FILE, endpoints)
        if self._metrics_address:
            self._metrics = PushChannel(self._metrics_address)
        if not self._warm_start_follows:
            self._push()  # late engines and a restored run get the current weights at once
        return endpoints

    def run(self) -> None:
        """Start the training loop on its own thread (returns at once); a follower is already running."""
        if self.is_leader:
            self.spawn(self._loop, "train")

    @property
    def is_leader(self) -> bool:
        return self.ranks is None or self.ranks.rank == 0

    def _count_call(self, method: str, seconds: float) -> None:
        if method in ("train_step", "sft_step"):
            self.busy_s += seconds
            self.stats["steps"] += method == "train_step"

    def stop(self) -> None:
        if isinstance(self.backend, LeaderBackend):
            self.backend.stop_followers()
        super().stop()
        if self._replay_client is not None:
            self._replay_client.close()
        if self.weights is not None:
            self.weights.stop()
        if self._metrics is not None:
            self._metrics.close()

    def health(self) -> dict:
        weights = self.weights.health() if self.weights is not None else {}
        looping = any(t.is_alive() for t in self._threads)
        return {**super().health(), **self.stats, "busy_s": self.busy_s, "learner_id": self.learner_id,
                "rank": self.ranks.rank if self.ranks else 0,
                "version": self.version,
                "step": self.step, "finished": self._finished, "looping": looping,
                "discarded_above": self.discarded_above, "weights": weights}

    # --------------------------------------------------------------------------- warm start

    def warm_start(self, batches: list[TrainBatch], steps: int, lr: float | None = None) -> list[float]:
        """Cross-entropy steps on reference solutions before RL; returns the losses. Their result is
        version 0: saved (with checkpointing on, so that a restart resumes from it rather than from the
        initial weights), then published. Call between start() and run() on a learner built with
        `warm_start_follows`; without batches no step is taken and the initial weights are published."""
        if self.weights.version >= 0:
            raise RuntimeError("warm_start: version 0 is published already; build the learner with "
                               "warm_start_follows=True")
        losses = []
        for i in range(steps if batches else 0):
            with self.weights.updating():
                result = self.backend.sft_step(batches[i % len(batches)], lr=lr)
            losses.append(result.loss)
            self._emit(-1, {"sft/loss": result.loss, "sft/step_s": result.seconds})
        if losses and self.cfg.checkpoint_every:
            self.checkpoint()
        self._push()
        return losses

    # ------------------------------------------------------------------------------- training

    def _loop(self) -> None:
        while not self.stopping and self.version < self.algo.total_steps:
            batch = self._next_batch()
            if batch is None:
                continue
            t = time.perf_counter()
            if self.shares_gpu:  # colocated: the engines give the GPU back for the step
                self.weights.release_engines()
            with self.weights.updating():  # an engine joining now must not read a half-stepped model
                result = self.backend.train_step(batch)
            self.version += 1
            self.step += 1
            self.stats["steps"] += 1
            push_s = self._push()
            if self.confirm_before_next:
                self.weights.wait_confirmed(self.version, None, CONFIRM_TIMEOUT_S)
            self.busy_s += time.perf_counter() - t
            self._emit(self.step, self._step_values(result, batch, push_s))
            if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                self.checkpoint()
        if not self.stopping:
            self.checkpoint()
            self._finished = True

    def _next_batch(self) -> TrainBatch | None:
        """One request to replay: the batch, or None after waiting as told (or on a timeout)."""
        reply = self._request(BatchRequest(learner_id=self.learner_id, version=self.version,
                                           discarded_above=self.discarded_above))
        if reply is None:
            self._stop.wait(0.5)
            return None
        if reply.status == "stop":
            self.version = max(self.version, self.algo.total_steps)
            return None
        if reply.status == "wait":
            self.stats["batch_waits"] += 1
            self._stop.wait(reply.retry_after_s)
            return None
        return reply.batch

    def _request(self, rec: BatchRequest) -> BatchReply | None:
        address = self._replay()
        if not address:
            return None
        if self._replay_client is None or address != self._replay_address:
            if self._replay_client is not None:
                self._replay_client.close()
            self._replay_client = RequestClient(address, timeout_s=self._timeout_s, retries=1)
            self._replay_address = address
        try:
            reply = self._replay_client.request(rec)
        except ChannelTimeout:  # replay may be restarting, on a new address
            self.stats["replay_timeouts"] += 1
            self._replay_client.close()
            self._replay_client = None
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
            "train/loss": result.loss, "train/grad_norm": result.grad_norm,
            "train/step_s": result.seconds, "train/tokens": float(result.tokens),
            "train/trained_tokens": float(result.trained_tokens),
            "train/tokens_per_s": result.tokens / max(result.seconds, 1e-9),
            "train/sequences": float(len(batch.advantages)),
            "weights/version": float(self.version), "weights/sync_s": push_s,
            **{f"train/{k}": float(v) for k, v in result.metrics.items()},
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

    def drop_engine(self, engine_id: str) -> bool:
        """The driver saw this engine's actor die: stop pushing to it (a push blocked on it fails now)."""
        return self.weights.drop(engine_id, "its actor died") if self.weights is not None else False

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
        self.backend.export_hf(Path(path))
        return str(path)

    def _restore(self) -> None:
        latest = read_latest(self.dir)
        announced = self._read_announced()
        if latest is not None:
            path, meta = latest
            self.backend.load_checkpoint(path)
            self.step = meta.step
            self.discarded_above = meta.version
            self.stats["restored_from"] = meta.version
            log.info("%s: restored %s (version %d, step %d)", self.learner_id, path, meta.version, meta.step)
        else:
            log.warning("%s: no checkpoint in %s; starting from the initial weights", self.learner_id, self.dir)
        # Above every version announced before, even when the checkpoint is the newest state.
        self.version = max(announced + 1, self._min_version, 0)

    def _announced_path(self) -> Path:
        return self.dir / "learner" / ANNOUNCED_FILE

    def _read_announced(self) -> int:
        try:
            return int(json.loads(self._announced_path().read_text())["version"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def _record_announced(self, version: int) -> None:
        _write_json(self._announced_path(), {"version": version})

    def _emit(self, step: int, values: dict[str, float]) -> None:
        if self._metrics is None:
            return
        try:
            self._metrics.send(Metrics(source=self.learner_id, step=step, ts=time.time(), values=values),
                               timeout_s=1.0)
        except Exception as err:  # metrics are best effort; training goes on
            log.debug("%s: metrics push failed: %s", self.learner_id, err)


def _write_json(path: Path, value) -> None:
    """Atomically and durably: a reader sees the old content or the new, never a torn file."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_learner_endpoints(run_dir: str | Path) -> dict[str, str]:
    """The current learner's weight endpoints ({} while none has started)."""
    try:
        return dict(json.loads((Path(run_dir) / "learner" / ENDPOINT_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return {}
