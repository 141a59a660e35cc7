"""A kernel verifier's lanes: one per GPU it runs sandboxes on (one for the host on cpu).

A lane holds what is tied to its device: the sandbox workers pinned to that GPU (a `SandboxPool`
whose sandboxes see only it), its device lease (exclusive timing windows are per GPU), its memory
as the runs reserve it (devmem.py), the references and the baselines computed on it (a client's
references in jailed processes pinned to its GPU: jailed_reference.py), and its bandwidth bound. A
candidate runs on the lane with the fewest runs under way, with the lane's GPU as its thread's
current CUDA device, so the trusted side's work for it (reference outputs, baselines, the clock)
happens on the GPU that the candidate's sandbox uses. The cpu backend has one lane and goes through the same code.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from actors.verifier import timing
from actors.verifier.baselines import Baselines
from actors.verifier.devmem import DeviceMemory
from actors.verifier.executor import SandboxPool
from actors.verifier.jailed_reference import ReferenceJail
from actors.verifier.reference import ReferenceCache
from actors.verifier.workers import RunWorkers, VerifierGpu
from actors.verifier.zygote import Zygote
from configs import VerifierConfig
from protocols.lease import DeviceLease


@dataclass
class Lane:
    device: str  # the torch device in the verifier's process: "cuda:N" or "cpu"
    gpu: VerifierGpu | None  # its GPU (None on cpu)
    workers: int  # sandboxes at a time on it (the run workers the plan pinned to its GPU)
    pool: SandboxPool  # those sandbox workers
    lease: DeviceLease
    references: ReferenceCache
    baselines: Baselines
    bandwidth: timing.Bandwidth
    memory: DeviceMemory  # the bytes its runs may hold at once
    running: int = field(default=0)  # candidate runs under way on this lane

    def current(self):
        """Make this lane's GPU the calling thread's current CUDA device (torch's "cuda" means it)."""
        return torch.cuda.device(self.gpu.device) if self.gpu is not None else nullcontext()


def build_lanes(
    cfg: VerifierConfig,
    gpus: tuple[VerifierGpu, ...],
    plan: RunWorkers,
    zygote: Zygote,
    hidden: tuple[str, ...],
    visible: tuple[str, ...],
) -> list[Lane]:
    """A lane for every GPU with at least one of the plan's workers (the host's one on cpu)."""
    lanes = []
    for position in sorted(set(plan.gpus), key=lambda g: -1 if g is None else g):
        gpu = gpus[position] if position is not None else None
        device = f"cuda:{gpu.device}" if gpu is not None else "cpu"
        uuid = str(torch.cuda.get_device_properties(gpu.device).uuid) if gpu is not None else ""
        workers = plan.on(position)
        pool = SandboxPool(
            cfg.backend,
            workers,
            cfg.memory_limit_mb,
            zygote=zygote,
            hidden=hidden,
            visible=visible,
            gpu=gpu.visible if gpu is not None else "",
            gpu_uuid=uuid,
        )
        lease = DeviceLease(device)
        with nullcontext() if gpu is None else torch.cuda.device(gpu.device), lease.exclusive():
            bandwidth = timing.Bandwidth("cuda" if gpu is not None else "cpu")
        jail = ReferenceJail(cfg, zygote, device, hidden=hidden, gpu=gpu.visible if gpu is not None else "")
        references = ReferenceCache(device, jail, sandbox_all=cfg.sandbox_references)
        baselines = Baselines(cfg, device, lease)
        lanes.append(
            Lane(device, gpu, workers, pool, lease, references, baselines, bandwidth, DeviceMemory.for_device(device))
        )
    return lanes


class Lanes:
    """The verifier's lanes, handed out least-busy first."""

    def __init__(self, lanes: list[Lane]) -> None:
        self.all = tuple(lanes)
        self._lock = threading.Lock()

    @contextmanager
    def take(self) -> Iterator[Lane]:
        """The lane with the fewest runs under way, current on this thread while the caller holds it."""
        with self._lock:
            lane = min(self.all, key=lambda x: x.running)
            lane.running += 1
        try:
            with lane.current():
                yield lane
        finally:
            with self._lock:
                lane.running -= 1

    def close(self) -> None:
        for lane in self.all:
            lane.references.close()
            lane.pool.close()
            lane.baselines.close()
