"""The sandbox's limits come from the task and the machine (actors/verifier/limits.py), and a sandbox
that dies of memory is `runtime` (or `infra` under a limit the machine capped), never cheating."""

from __future__ import annotations

import signal
import uuid
from types import SimpleNamespace

import pytest

from actors.verifier import limits
from actors.verifier.executor import SandboxCrash
from actors.verifier.outcome import RunOutcome
from actors.verifier.verifier import KernelVerifier
from actors.verifier.zygote import ExitStatus
from configs import load_config
from protocols import KernelSpec, Task, VerifyRequest

GiB = 1 << 30
MiB = 1 << 20


def test_a_small_task_gets_the_floor():
    got = limits.derive("cpu", 8192, 60.0, trial_bytes=4096, trial_calls=6, arena_bytes=1 << 16, machine_bytes=64 * GiB)
    assert got.private_bytes == 8192 * MiB and got.memory_bytes == 8192 * MiB + (1 << 16)
    assert not got.capped and got.run_timeout_s == pytest.approx(60.0, abs=0.01)


def test_a_task_with_big_inputs_gets_a_bigger_limit_and_more_time():
    trial = 8 * GiB  # KernelBench level1_5: 4 GiB of input and 4 GiB of output per trial
    got = limits.derive(
        "cuda", 8192, 60.0, trial_bytes=trial, trial_calls=6, arena_bytes=16 * GiB, machine_bytes=1 << 40
    )
    assert got.private_bytes == limits.BASE_BYTES["cuda"] + limits.COPIES["cuda"] * trial
    assert got.memory_bytes == got.private_bytes + 16 * GiB and not got.capped
    assert got.run_timeout_s > 60.0 + (6 * 2 * trial) / limits.COPY_BYTES_PER_S
    assert got.to_json()["memory_mb"] == got.memory_bytes >> 20 and "memory" in got.describe()


def test_the_parameters_of_the_modelnew_instances_count():
    """KernelBench level2_55 builds a 4 GiB Linear: the sandbox constructs it, then copies the
    reference's weights in, so a 16 MB trial still needs room for the parameters twice."""
    small = limits.derive("cuda", 8192, 60.0, 16 * MiB, 6, 4 * GiB, machine_bytes=1 << 40)
    wide = limits.derive("cuda", 8192, 60.0, 16 * MiB, 6, 4 * GiB, machine_bytes=1 << 40, param_bytes=8 * GiB)
    assert wide.private_bytes == limits.BASE_BYTES["cuda"] + 16 * MiB + limits.PARAM_COPIES * 8 * GiB
    assert wide.private_bytes > small.private_bytes == 8192 * MiB


def test_the_limit_is_never_above_the_machine():
    got = limits.derive(
        "cpu", 8192, 60.0, trial_bytes=8 * GiB, trial_calls=6, arena_bytes=16 * GiB, machine_bytes=32 * GiB
    )
    assert got.capped and got.memory_bytes <= 32 * GiB and "capped" in got.describe()
    here = limits.derive("cpu", 256, 60.0, trial_bytes=1 << 50, trial_calls=1, arena_bytes=1 << 16)
    assert here.capped and here.memory_bytes <= limits.machine_memory_bytes()


def _crash_outcome(memory: bool, capped: bool, exited_cleanly: bool) -> RunOutcome:
    out = RunOutcome(stage="correctness")
    crash = SandboxCrash(
        "the process exceeded the memory limit of 9000 MB", ExitStatus(0, 0), exited_cleanly, memory, capped
    )
    out.sandbox_failed(crash, "trial 1", 60.0)
    out.finish()
    return out


def test_a_memory_death_is_runtime_or_infra_never_cheating():
    runtime = _crash_outcome(memory=True, capped=False, exited_cleanly=False)
    assert runtime.error_class == "runtime" and not runtime.violations and "9000 MB" in runtime.message
    infra = _crash_outcome(memory=True, capped=True, exited_cleanly=False)
    assert infra.error_class == "infra" and not infra.violations
    cheat = _crash_outcome(memory=False, capped=False, exited_cleanly=True)  # os._exit(0) with memory to spare
    assert cheat.error_class == "cheating"


def _session(tripped: bool, peak: int, limit: int, killed: bool, oom_before: int):
    from actors.verifier.executor import ChildSession

    s = object.__new__(ChildSession)
    s.watchdog = SimpleNamespace(tripped=tripped, peak=peak, limit=limit)
    s.oom_kills = oom_before
    return ChildSession.died_of_memory(s, ExitStatus(0, 0), killed), ChildSession.died_of_memory(
        s, ExitStatus(-1, signal.SIGKILL), killed
    )


def test_an_exit_near_the_limit_or_after_the_oom_killer_is_memory():
    now = limits.oom_kills()
    assert _session(True, 0, GiB, False, now) == (True, True)  # the watchdog's own kill
    assert _session(False, GiB, GiB, False, now) == (True, True)  # near the limit at the last look
    assert _session(False, 0, GiB, False, now - 1) == (True, True)  # the kernel's OOM killer acted
    assert _session(False, 0, GiB, False, now) == (False, False)  # a plain exit with memory to spare
    assert _session(False, GiB, GiB, True, now) == (False, False)  # the verifier's own kill (a deadline)


REFERENCE = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, A):
        return A * 2.0

M = 2048
N = 8192

def get_inputs():
    return [torch.rand(M, N)]

def get_init_inputs():
    return []
"""

HOG = """
import torch
import torch.nn as nn

HELD = []


class ModelNew(nn.Module):
    def forward(self, A):
        HELD.append(b"x" * (3 << 30))  # kept: the watchdog sees it at its next look
        return A
"""


def test_a_sandbox_killed_for_memory_gets_runtime_naming_the_task_limit(tmp_path):
    """A 64 MB-input task: the limit is the floor plus the arena, the diagnostics name it, and a
    candidate that allocates past it is runtime, not cheating."""
    items = {
        "verifier.backend": "cpu",
        "verifier.cache_dir": str(tmp_path),
        "verifier.trials": 1,
        "verifier.memory_limit_mb": 256,
        "verifier.compile_baseline": "never",
        "verifier.compile_workers": 1,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in items.items()]).verifier
    task = Task(
        task_id="big/scale", kind="kernel", kernel=KernelSpec(name="scale", reference=REFERENCE, backend="cpu", level=1)
    )
    verifier = KernelVerifier(cfg)
    try:
        result = verifier.verify(VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=HOG))
    finally:
        verifier.close()
    used = result.diagnostics["sandbox"]["limits"]
    assert used["task_mb"] == pytest.approx(2 * 2048 * 8192 * 4 / MiB) and used["memory_mb"] > 256 + used["arena_mb"]
    assert result.error_class == "runtime" and not result.diagnostics["violations"], result.feedback
    assert f"memory limit of {used['memory_mb']} MB" in result.feedback
