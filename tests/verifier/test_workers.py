"""How many workers a verifier actor runs and where (actors/verifier/workers.py): pure planning, and
the pin a sandbox's jail gets (isolation.run_jail)."""

from __future__ import annotations

import pytest

from actors.base import Slot
from actors.verifier import isolation
from actors.verifier.workers import (
    CPU_RUN_WORKERS,
    MAX_RUN_WORKERS_PER_GPU,
    SANDBOX_BYTES,
    VerifierGpu,
    compile_workers,
    run_workers,
    verifier_gpus,
    visible_entry,
)


def test_run_workers_auto_follows_the_cores_and_the_gpus_memory_and_a_setting_is_dealt_round_robin():
    sized = run_workers("cuda", 0, 2, cores=16)  # 16 cores at 2 a worker, over 2 GPUs: 4 a GPU
    assert sized.gpus == (0, 1) * 4 and sized.on(0) == sized.on(1) == 4 and "16 cores" in sized.why
    assert run_workers("cuda", 0, 1, cores=64).count == MAX_RUN_WORKERS_PER_GPU  # capped a GPU
    assert run_workers("cuda", 0, 1, cores=64, verifiers_on_node=4).count == 8  # 16 cores of 64
    assert run_workers("cuda", 0, 1, cores=2).count == 1  # at least one
    small = run_workers("cuda", 0, 1, cores=64, device_bytes=5 * SANDBOX_BYTES // 2)  # room for 2 sandboxes
    assert small.count == 2 and "GiB free" in small.why
    assert run_workers("cuda", 0, 1, cores=64, device_bytes=0).count == 1
    three = run_workers("cuda", 3, 2)
    assert three.gpus == (0, 1, 0) and three.on(0) == 2 and three.on(1) == 1 and three.count == 3
    assert run_workers("cuda", 1, 2).gpus == (0,)  # the second GPU gets none


def test_run_workers_on_cpu_and_without_a_gpu():
    auto = run_workers("cpu", 0, 0)
    assert auto.gpus == (None,) * CPU_RUN_WORKERS and auto.on(None) == CPU_RUN_WORKERS and "cpu" in auto.why
    assert run_workers("cpu", 2, 0).gpus == (None, None)
    with pytest.raises(ValueError, match="no GPU"):
        run_workers("cuda", 0, 0)


def test_compile_workers_auto_shares_the_cores_among_the_verifiers():
    assert compile_workers(0, 2, cores=32).count == 16
    assert compile_workers(0, 64, cores=32).count == 1  # at least one
    assert "32 cores here ÷ 2" in compile_workers(0, 2, cores=32).why
    assert compile_workers(4, 2, cores=32).count == 4


def test_a_gpu_is_named_to_a_sandbox_by_the_verifiers_own_visible_entry():
    assert visible_entry(1, {}) == "1"
    assert visible_entry(1, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == "5"
    assert visible_entry(0, {"CUDA_VISIBLE_DEVICES": "GPU-abc"}) == "GPU-abc"
    with pytest.raises(ValueError, match="not among"):
        visible_entry(2, {"CUDA_VISIBLE_DEVICES": "3,5"})


def test_a_verifiers_gpus_come_from_its_slot():
    ray_env = {"CUDA_VISIBLE_DEVICES": "6,7"}  # a Ray actor sees only its own GPUs, renumbered from 0
    ray = Slot(gpus=(4, 5), num_gpus=2.0, bundle=0, isolated=True)
    assert verifier_gpus(ray, 2, ray_env) == (VerifierGpu(0, "6"), VerifierGpu(1, "7"))
    driver = Slot(gpus=(1,), num_gpus=1.0, bundle=0)  # in the driver's process: this machine's indices
    assert verifier_gpus(driver, 4, {}) == (VerifierGpu(1, "1"),)
    assert verifier_gpus(None, 2, {}) == (VerifierGpu(0, "0"), VerifierGpu(1, "1"))  # tools: all it sees
    assert verifier_gpus(Slot(), 0, {}) == ()


def test_a_pinned_sandbox_sees_only_its_gpu(tmp_path):
    pinned = dict(isolation.run_jail(str(tmp_path), cuda=True, uid=70000, gpu="5").env)
    assert pinned["CUDA_VISIBLE_DEVICES"] == "5"
    unpinned = dict(isolation.run_jail(str(tmp_path), cuda=False, uid=70000).env)
    assert unpinned.get("CUDA_VISIBLE_DEVICES") == isolation.os.environ.get("CUDA_VISIBLE_DEVICES")
