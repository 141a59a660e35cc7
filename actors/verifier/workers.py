"""How many workers a verifier actor runs, and where: the sizing of `verifier.compile_workers` and
`verifier.run_workers`, as pure functions the verifier and the placement plan's printout share.

Compiles are CPU work apart from the GPU execution, so they scale with the node's cores (0 = the
cores its process may use, shared by the run's verifier actors on that node). Sandboxed execution
on cuda scales with the cores and the GPUs (0 = CORES_PER_RUN_WORKER cores a worker, dealt over the
verifier's GPUs, at most MAX_RUN_WORKERS_PER_GPU a GPU and no more than its free memory holds at
SANDBOX_BYTES each; every worker is pinned to its GPU). A run's timing windows are exclusive on its
GPU (the device lease), so several workers a GPU overlap one run's timing with others' staging,
correctness trials and checks, which are host work more than device work; a run's trials and timed
calls reserve their own device bytes before they start (devmem.py), so a large task's runs wait
their turn rather than fail. On cpu,
one, because a cpu sandbox's timing shares the host's cores with the compiles (the cpu device lease
already makes timing windows exclusive host-wide, so a second worker would only overlap correctness
trials with the compiles it competes with).

A verifier actor's GPUs (`VerifierGpu`) come from its placement (`actors.base.Slot`), or, without
one (tools, tests), from the devices its process sees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from actors.base import Slot

# Sandbox workers of a cpu verifier when `verifier.run_workers` is 0 (see the module docstring).
CPU_RUN_WORKERS = 1
# cuda with `verifier.run_workers` 0: cores a sandbox worker is counted for (a run keeps about one core
# busy between device work, its sandbox's and the verifier's Python; the compiles take the rest), the
# most workers a GPU gets, and the device memory a worker's sandbox holds before its run reserves any
# (a CUDA context, the trace's buffers, the L2 flush buffer, with room).
CORES_PER_RUN_WORKER = 2
MAX_RUN_WORKERS_PER_GPU = 8
SANDBOX_BYTES = 2 << 30


@dataclass(frozen=True)
class CompileWorkers:
    count: int  # compile processes of one verifier actor
    why: str  # how the count was reached, for the plan's printout and the logs


@dataclass(frozen=True)
class VerifierGpu:
    """One GPU of a verifier actor, named both ways it is used."""

    device: int  # its CUDA index in the verifier's process (references, baselines, the device lease)
    visible: str  # its CUDA_VISIBLE_DEVICES entry in the verifier's environment, which a sandbox gets alone


@dataclass(frozen=True)
class RunWorkers:
    """The sandbox workers of one verifier actor: for each, its GPU's position among the actor's GPUs."""

    gpus: tuple[int | None, ...]  # per worker: index into the actor's GPUs; None = the cpu backend
    why: str  # how the count was reached

    @property
    def count(self) -> int:
        return len(self.gpus)

    def on(self, gpu: int | None) -> int:
        """Workers pinned to the actor's GPU at position `gpu` (None: the cpu backend's host)."""
        return sum(1 for g in self.gpus if g == gpu)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def compile_workers(setting: int, verifiers_on_node: int = 1, cores: int | None = None) -> CompileWorkers:
    """`verifier.compile_workers` resolved: the setting, or with 0 the node's cores ÷ its verifiers."""
    if setting > 0:
        return CompileWorkers(setting, "set by verifier.compile_workers")
    cores = usable_cores() if cores is None else cores
    share = max(1, verifiers_on_node)
    return CompileWorkers(max(1, cores // share), f"0 = {cores} cores here ÷ {share} verifier actor(s)")


def node_compile_workers(verifiers_on_node: int = 1) -> int:
    return compile_workers(0, verifiers_on_node).count


def run_workers(
    backend: str,
    setting: int,
    gpus: int,
    *,
    cores: int | None = None,
    verifiers_on_node: int = 1,
    device_bytes: int | None = None,
) -> RunWorkers:
    """`verifier.run_workers` resolved for an actor with `gpus` GPUs: a set number dealt round-robin
    over the GPUs; with 0 on cuda, the actor's share of the node's `cores` at CORES_PER_RUN_WORKER a
    worker, per GPU at least 1, at most MAX_RUN_WORKERS_PER_GPU and what `device_bytes` (a GPU's free
    memory, when known) holds at SANDBOX_BYTES each; on cpu, CPU_RUN_WORKERS. ValueError for a cuda
    verifier without a GPU."""
    if backend != "cuda":
        count = setting or CPU_RUN_WORKERS
        why = "set by verifier.run_workers" if setting else "0 = 1 on cpu: its timing shares the cores with compiles"
        return RunWorkers((None,) * count, why)
    if gpus < 1:
        raise ValueError("verifier.backend=cuda, but this verifier actor has no GPU")
    if setting:
        return RunWorkers(tuple(i % gpus for i in range(setting)), f"set by verifier.run_workers, over {gpus} GPU(s)")
    cores = usable_cores() if cores is None else cores
    share = max(1, cores // max(1, verifiers_on_node))
    per_gpu = min(MAX_RUN_WORKERS_PER_GPU, share // (CORES_PER_RUN_WORKER * gpus))
    why = f"0 = {share} cores ÷ {CORES_PER_RUN_WORKER} a worker over {gpus} GPU(s), at most {MAX_RUN_WORKERS_PER_GPU} a GPU"
    if device_bytes is not None and device_bytes // SANDBOX_BYTES < per_gpu:
        per_gpu = device_bytes // SANDBOX_BYTES
        why += f", {device_bytes / 2**30:.0f} GiB free a GPU at {SANDBOX_BYTES / 2**30:.0f} GiB a sandbox"
    per_gpu = max(1, per_gpu)
    return RunWorkers(tuple(i % gpus for i in range(per_gpu * gpus)), f"{why}: {per_gpu} a GPU")


def visible_entry(device: int, environ: dict[str, str] | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES entry that names CUDA device `device` of this process to a process it
    starts with the same environment (the entry itself where the variable is set, else the index)."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return str(device)
    entries = [d.strip() for d in listed.split(",") if d.strip()]
    if device >= len(entries):
        raise ValueError(f"CUDA device {device} is not among CUDA_VISIBLE_DEVICES={listed!r}")
    return entries[device]


def verifier_gpus(
    slot: Slot | None, visible_count: int, environ: dict[str, str] | None = None
) -> tuple[VerifierGpu, ...]:
    """The GPUs of a verifier actor placed in `slot`, as this process numbers them. A Ray actor's process
    sees only its own (`slot.isolated`): all `visible_count` of them. In the driver's process the slot's
    ids are this machine's indices. Without a placed GPU (tools, tests): every device this process sees."""
    if slot is not None and slot.gpus and not slot.isolated:
        devices = tuple(slot.gpus)
    else:
        devices = tuple(range(visible_count))
    return tuple(VerifierGpu(d, visible_entry(d, environ)) for d in devices)
