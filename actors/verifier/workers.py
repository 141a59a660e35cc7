"""How many workers a verifier actor runs, and where: the sizing of `verifier.compile_workers` and
`verifier.run_workers`, as pure functions the verifier and the placement plan's printout share.

Compiles are CPU work apart from the GPU execution, so they scale with the node's cores (0 = the
cores its process may use, shared by the run's verifier actors on that node). Sandboxed execution
scales with the verifier's GPUs (0 = one sandbox worker per GPU, each pinned to its GPU); on cpu,
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


def run_workers(backend: str, setting: int, gpus: int) -> RunWorkers:
    """`verifier.run_workers` resolved for an actor with `gpus` GPUs: with 0, one worker per GPU (cpu:
    CPU_RUN_WORKERS); a set number is dealt round-robin over the GPUs. ValueError for a cuda verifier
    without a GPU."""
    if backend != "cuda":
        count = setting or CPU_RUN_WORKERS
        why = "set by verifier.run_workers" if setting else "0 = 1 on cpu: its timing shares the cores with compiles"
        return RunWorkers((None,) * count, why)
    if gpus < 1:
        raise ValueError("verifier.backend=cuda, but this verifier actor has no GPU")
    if not setting:
        return RunWorkers(tuple(range(gpus)), f"0 = one per GPU ({gpus})")
    return RunWorkers(tuple(i % gpus for i in range(setting)), f"set by verifier.run_workers, over {gpus} GPU(s)")


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
