"""The sandbox limits of one candidate's execution, derived from its task and the machine.

A fixed memory limit is wrong at both ends: KernelBench's level1_5 holds 4 GiB of input and 4 GiB
of output per trial, so an 8 GiB sandbox dies of memory whatever the kernel does, while a task of a
few kilobytes needs nothing near that. So the limit of a sandbox is

    memory = max(verifier.memory_limit_mb, BASE + COPIES x one trial's bytes
                 + PARAM_COPIES x the parameters of every ModelNew it builds) + the I/O arena,
    never more than MACHINE_SHARE of the machine's memory,

where one trial's bytes are its inputs and the reference's outputs (the largest trial of the plan),
COPIES counts what the sandbox holds of a trial at once beyond the arena (its own copy of the inputs,
the candidate's outputs and their snapshot), BASE is the process itself (interpreter, torch, on cuda
the CUDA context and its libraries), the parameters count because ModelNew is constructed on the
host (KernelBench level2_55 builds a 4 GiB Linear, initialised before the reference's weights are
copied in), and the arena (shared pages the sandbox touches) is sized by the runner's plan. A machine
too small for the task caps the limit (`capped`). Whether a sandbox that dies of memory under a
capped limit is the machine's failure is decided by what the limit still leaves: a limit below the
least any candidate holds (`starved`: the process, one copy of the parameters and MIN_COPIES of the
trial beside the arena) is the machine's (infra); above that, a candidate that died of memory held
more than the least it needed, and the death is its own (runtime), as under any other limit.

The run time limit grows likewise: `verifier.run_timeout_s` plus the time to move every trial's bytes
through the sandbox at COPY_BYTES_PER_S, so a task of gigabytes is not a `timeout` for copying them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

# The process itself, before any task data: the interpreter and torch (~0.5 GiB resident), and on
# cuda the CUDA context with cuBLAS/cuDNN mapped (1.5-3 GiB resident on an H100).
BASE_BYTES = {"cpu": 1 << 30, "cuda": 3 << 30}
# Copies of one trial (inputs + outputs) the sandbox holds outside the arena at once: on cpu its own
# copy of the inputs, the candidate's outputs, their snapshot, and as much again for the candidate's
# working memory; on cuda those live on the device, and host memory holds transient staging only.
COPIES = {"cpu": 4, "cuda": 1}
# Copies of the parameters a sandbox holds while it builds ModelNew: the candidate's own initialised
# ones and the reference's being copied in from the arena.
PARAM_COPIES = 2
# Copies of one trial that any candidate's sandbox holds outside the arena at least: on cpu the
# inputs it computes from and the outputs it writes; on cuda none (they live on the device).
MIN_COPIES = {"cpu": 2, "cuda": 0}
# The share of the machine's memory one sandbox may have at most: the verifier's own process holds
# the trials and the arena too.
MACHINE_SHARE = 0.9
# A floor on the rate at which the sandbox moves a trial's bytes (arena to tensors, outputs back,
# twice each): far below a host memcpy or a pageable host-to-device copy, so only truly slow work
# times out.
COPY_BYTES_PER_S = 1 << 30
# Calls of the timing stage counted for the time limit (its trips stay within a byte budget).
TIMED_CALLS = 4


@dataclass(frozen=True)
class SandboxLimits:
    """The limits one sandbox ran under, as the verdict's diagnostics report them."""

    memory_bytes: int  # the RSS watchdog's limit on the sandbox's process tree, the arena included
    arena_bytes: int  # of which the I/O arena
    floor_bytes: int  # verifier.memory_limit_mb
    task_bytes: int  # one trial's inputs + reference outputs (the largest trial)
    machine_bytes: int  # the machine's memory (its cgroup's limit where lower)
    capped: bool  # the task needed more than the machine gives one sandbox
    run_timeout_s: float  # sandbox seconds for the whole execution
    starved: bool = False  # capped below the least any candidate holds: a memory death is the machine's

    @property
    def private_bytes(self) -> int:
        """The limit less the arena (what the pool's sessions are given; the watchdog adds the arena)."""
        return self.memory_bytes - self.arena_bytes

    def to_json(self) -> dict:
        return {
            "memory_mb": self.memory_bytes >> 20,
            "arena_mb": self.arena_bytes >> 20,
            "floor_mb": self.floor_bytes >> 20,
            "task_mb": round(self.task_bytes / (1 << 20), 1),
            "machine_mb": self.machine_bytes >> 20,
            "capped": self.capped,
            "starved": self.starved,
            "run_timeout_s": round(self.run_timeout_s, 1),
        }

    def describe(self) -> str:
        """One line for a note or a table: "memory 12288 MB, run 96 s"."""
        capped = f" (capped by the machine's {self.machine_bytes >> 20} MB)" if self.capped else ""
        return f"memory {self.memory_bytes >> 20} MB{capped}, run {self.run_timeout_s:.0f} s"


def derive(
    device: str,
    floor_mb: int,
    run_timeout_s: float,
    trial_bytes: int,
    trial_calls: int,
    arena_bytes: int,
    machine_bytes: int | None = None,
    param_bytes: int = 0,
) -> SandboxLimits:
    """The limits for a task whose largest trial moves `trial_bytes` (inputs + reference outputs),
    over `trial_calls` correctness calls, in an arena of `arena_bytes`, whose ModelNew instances
    hold `param_bytes` of parameters and buffers together, on a machine of `machine_bytes`
    (default: this one's)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    machine = machine_memory_bytes() if machine_bytes is None else machine_bytes
    floor = floor_mb << 20
    private = max(floor, BASE_BYTES[kind] + COPIES[kind] * trial_bytes + PARAM_COPIES * param_bytes)
    cap = int(machine * MACHINE_SHARE)
    capped = private + arena_bytes > cap
    memory = min(private + arena_bytes, cap) if capped else private + arena_bytes
    least = BASE_BYTES[kind] + MIN_COPIES[kind] * trial_bytes + param_bytes + arena_bytes
    moved = (trial_calls + TIMED_CALLS) * 2 * trial_bytes
    return SandboxLimits(
        memory_bytes=max(memory, arena_bytes + (256 << 20)),
        arena_bytes=arena_bytes,
        floor_bytes=floor,
        task_bytes=trial_bytes,
        machine_bytes=machine,
        capped=capped,
        starved=capped and least > max(memory, arena_bytes + (256 << 20)),
        # Whole seconds, and only where moving the bytes takes one or more: a small task keeps the
        # configured limit exactly (the limit is quoted in verdicts).
        run_timeout_s=run_timeout_s + (math.ceil(moved / COPY_BYTES_PER_S) if moved >= COPY_BYTES_PER_S else 0),
    )


def trial_bytes(trials) -> int:
    """The largest trial's inputs + reference outputs, in bytes (`trials`: reference.Trial records)."""
    return max((_nbytes(t.inputs) + _nbytes(t.expected) for t in trials), default=0)


def machine_memory_bytes() -> int:
    """The memory of this machine: MemTotal, or the cgroup's limit where that is lower."""
    total = _meminfo_bytes("MemTotal")
    limit = _cgroup_limit_bytes()
    return min(total, limit) if limit else total


def oom_kills() -> int:
    """How many processes the kernel's out-of-memory killer has killed on this machine (and in this
    process's cgroup): a count that grew while a sandbox ran says who killed it."""
    count = 0
    for path, key in (("/proc/vmstat", "oom_kill"), ("/sys/fs/cgroup/memory.events", "oom_kill")):
        try:
            with open(path, encoding="ascii") as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        count += int(value)
        except (OSError, ValueError):
            continue
    return count


def _meminfo_bytes(key: str) -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_limit_bytes() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _nbytes(items) -> int:
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))
