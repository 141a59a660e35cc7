"""A learner of several ranks (docs/training.md): rank 0 leads, the other ranks follow it.

Every learner call (a `Trainer`'s: steps, logprobs, weights, checkpoints) is collective across the
ranks (TP all-gathers, DP gradient sums, checkpoint barriers), so every rank must make the same calls
in the same order. Only rank 0 is the learner the rest of Kiln sees: it asks replay for batches,
pushes weights to the engines and answers the driver. Before each call it sends the call, a typed
record (`TrainStep`, `SftStep`, ... with its arguments, the batch included), to the other ranks on a
gloo control group; each of them runs the same record on its own Trainer. A follower therefore has
no logic of its own and cannot drift from its leader.

Ranks find each other through a TCP store that rank 0 opens (`host_rendezvous`, on a port the kernel
picks, so no other process can take it between picking and binding) and names in a `RankSpec`; `join`
also sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for libraries that read them. Each rank process
sees one accelerator (Ray gives each rank actor one GPU), so LOCAL_RANK is 0. If any rank dies the others block or fail in a collective:
the driver restarts the whole group, which resumes from the last checkpoint.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from actors.learner.algorithm import StepResult, Trainer
from protocols import TrainBatch

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a collective a peer never joins fails after this
# A follower waits for its leader's next call through every wait for a batch, so its control group
# never times out; a dead leader closes the sockets, which ends the wait with an error at once.
CONTROL_TIMEOUT = timedelta(days=7)


# ------------------------------------------------------------------------------ the calls
# One record per Trainer call; `run` makes the call. The leader runs a record locally after sending
# it; a follower runs what it receives. A record is the whole call: there is no name to look up.


@dataclass(frozen=True)
class TrainStep:
    batch: TrainBatch

    def run(self, trainer: Trainer) -> StepResult:
        return trainer.train_step(self.batch)


@dataclass(frozen=True)
class SftStep:
    batch: TrainBatch
    lr: float | None = None

    def run(self, trainer: Trainer) -> StepResult:
        return trainer.sft_step(self.batch, lr=self.lr)


@dataclass(frozen=True)
class Logprobs:
    batch: TrainBatch
    temperature: float

    def run(self, trainer: Trainer) -> torch.Tensor:
        return trainer.logprobs(self.batch, self.temperature)


@dataclass(frozen=True)
class NamedWeights:
    def run(self, trainer: Trainer) -> list[tuple[str, torch.Tensor]]:
        # Gathered in full: the TP all-gathers happen as the generator runs, and a lazily consumed
        # generator could leave the followers' all-gathers ahead of the leader's when the consumer
        # stops early.
        return list(trainer.named_weights())


@dataclass(frozen=True)
class SaveCheckpoint:
    path: Path

    def run(self, trainer: Trainer) -> None:
        trainer.save_checkpoint(self.path)


@dataclass(frozen=True)
class LoadCheckpoint:
    path: Path

    def run(self, trainer: Trainer) -> None:
        trainer.load_checkpoint(self.path)


@dataclass(frozen=True)
class ExportHf:
    path: Path

    def run(self, trainer: Trainer) -> None:
        trainer.export_hf(self.path)


@dataclass(frozen=True)
class Stop:
    """Ends a follower's life (the learner stops)."""


# The calls a leader may send: the Trainer's, nothing else.
RankCall = TrainStep | SftStep | Logprobs | NamedWeights | SaveCheckpoint | LoadCheckpoint | ExportHf
CALLS = (TrainStep, SftStep, Logprobs, NamedWeights, SaveCheckpoint, LoadCheckpoint, ExportHf)


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    master: str  # "host:port" where rank 0 hosts the rendezvous store

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"master must be 'host:port', got {self.master!r}")


class ControlChannel:
    """The leader's calls to its followers, over a gloo group of the whole world."""

    def __init__(self, group) -> None:
        self.group = group

    def send(self, call: RankCall | Stop) -> None:
        dist.broadcast_object_list([call], src=0, group=self.group)

    def receive(self) -> object:
        """The leader's next record; the follower checks what it is before running it."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def host_rendezvous(host: str, world_size: int, port: int = 0) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on `port` (0: one the kernel picks; `.port` names it)."""
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


def join(spec: RankSpec, device: str | torch.device, store: dist.Store | None = None) -> ControlChannel:
    """Join the rank group (blocks until every rank joined) and return its control channel. Rank 0
    passes the store it opened (`host_rendezvous`); the others connect to `spec.master`. The default
    process group is NCCL on GPUs, gloo on CPU; a backend's own groups (megatron's TP and DP) are
    built on it afterwards, by every rank in the same order."""
    device = torch.device(device)
    host, _, port = spec.master.rpartition(":")
    if store is None:
        store = dist.TCPStore(host, int(port), spec.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=host,
        MASTER_PORT=port,
        LOCAL_RANK=str(device.index or 0),
    )
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = None, "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device,
    )
    return ControlChannel(dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))


class LeaderBackend:
    """Rank 0's Trainer: every call goes to the followers first, then runs here. Calls are serialised
    (a lock), so a call made from another thread cannot interleave with a step's collectives."""

    def __init__(self, local: Trainer, channel: ControlChannel) -> None:
        self.local, self.channel = local, channel
        self._lock = threading.Lock()

    def _everywhere(self, call: RankCall):
        with self._lock:
            self.channel.send(call)
            return call.run(self.local)

    def train_step(self, batch: TrainBatch) -> StepResult:
        return self._everywhere(TrainStep(batch))

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> StepResult:
        return self._everywhere(SftStep(batch, lr))

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self._everywhere(Logprobs(batch, temperature))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._everywhere(NamedWeights()))  # gathered in full while the lock is held

    def save_checkpoint(self, path: Path) -> None:
        self._everywhere(SaveCheckpoint(Path(path)))

    def load_checkpoint(self, path: Path) -> None:
        self._everywhere(LoadCheckpoint(Path(path)))

    def export_hf(self, path: Path) -> None:
        self._everywhere(ExportHf(Path(path)))

    def stop_followers(self, timeout_s: float = 10.0) -> bool:
        """Tell the followers to return; False if the leader is mid-call or a follower is gone (the
        driver then kills the rank actors)."""
        if not self._lock.acquire(timeout=timeout_s):
            return False
        sent = threading.Event()

        def send() -> None:
            try:
                self.channel.send(Stop())
                sent.set()
            except Exception as err:  # noqa: BLE001 - a follower died first
                log.warning("learner ranks: stop not delivered: %s", err)

        try:
            t = threading.Thread(target=send, name="kiln-rank-stop", daemon=True)
            t.start()
            t.join(timeout_s)
            return sent.is_set()
        finally:
            self._lock.release()


def follow(backend: Trainer, channel: ControlChannel, on_call: Callable[[RankCall, float], None] | None = None) -> None:
    """A follower's whole life: run each call its leader sends, until told to stop. Anything that is not
    one of the Trainer's calls is a protocol error and ends the follower (the group restarts)."""
    while True:
        call = channel.receive()
        if isinstance(call, Stop):
            return
        if not isinstance(call, CALLS):
            # the leader broke the protocol; not a caller's type error
            raise RuntimeError(f"learner rank {dist.get_rank()}: unknown call {type(call).__name__} from the leader")  # noqa: TRY004
        started = time.perf_counter()
        call.run(backend)
        if on_call is not None:
            on_call(call, time.perf_counter() - started)
