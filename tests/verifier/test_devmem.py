"""A lane's memory is counted (devmem.py): runs reserve what they will hold, first come first served,
one larger than the budget alone; a task's footprint is known before its first draw (meta tensors)."""

from __future__ import annotations

import threading
import time

import pytest

from actors.verifier.devmem import DeviceMemory, GaveUp
from actors.verifier.reference import Reference
from protocols import KernelSpec, Task


def _hold(memory: DeviceMemory, nbytes: int, log: list, name: str, release: threading.Event) -> threading.Thread:
    def body():
        with memory.reserve(nbytes):
            log.append(f"{name}+")
            release.wait(5)
            log.append(f"{name}-")

    t = threading.Thread(target=body)
    t.start()
    return t


def _until(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.005)
    assert pred()


def test_runs_wait_for_memory_in_arrival_order_and_an_oversized_one_runs_alone():
    memory = DeviceMemory(100)
    log: list[str] = []
    go_a, go_big, go_c = threading.Event(), threading.Event(), threading.Event()
    a = _hold(memory, 60, log, "a", go_a)
    _until(lambda: log == ["a+"])
    big = _hold(memory, 500, log, "big", go_big)  # more than the budget: granted all of it, alone
    _until(lambda: len(memory._queue) == 1)
    c = _hold(memory, 10, log, "c", go_c)  # would fit beside a, but arrived after big: waits its turn
    _until(lambda: len(memory._queue) == 2)
    assert log == ["a+"] and memory.used == 60
    go_a.set()
    _until(lambda: "big+" in log)
    assert memory.used == 100 and "c+" not in log
    go_big.set()
    _until(lambda: "c+" in log)
    go_c.set()
    for t in (a, big, c):
        t.join(5)
    assert log == ["a+", "a-", "big+", "big-", "c+", "c-"]
    assert memory.used == 0 and memory.peak == 100 and memory.grant(500) == 100


def test_a_reservation_is_returned_when_its_block_raises():
    memory = DeviceMemory(100)
    with pytest.raises(RuntimeError), memory.reserve(80):
        raise RuntimeError("the run failed")
    assert memory.used == 0
    with memory.reserve(100) as granted:
        assert granted == 100


def test_a_run_no_longer_wanted_stops_waiting_and_leaves_the_queue():
    """A service's deadline cancels a run that may still be queued for memory: it stops waiting then,
    instead of drawing its trials once memory frees, and the run behind it is served in its place."""
    memory = DeviceMemory(100)
    log: list[str] = []
    go_a = threading.Event()
    a = _hold(memory, 90, log, "a", go_a)
    _until(lambda: log == ["a+"])
    unwanted, outcome = threading.Event(), []

    def queued():
        try:
            with memory.reserve(50, unwanted):
                outcome.append("reserved")
        except GaveUp:
            outcome.append("gave up")

    waiting = threading.Thread(target=queued)
    waiting.start()
    _until(lambda: len(memory._queue) == 1)
    go_c = threading.Event()
    c = _hold(memory, 10, log, "c", go_c)  # fits beside a, but queued behind the waiting one
    _until(lambda: len(memory._queue) == 2)
    assert "c+" not in log
    unwanted.set()
    memory.wake()
    waiting.join(5)
    assert outcome == ["gave up"]
    _until(lambda: "c+" in log)  # served in the unwanted one's place, beside a
    assert memory.used == 100 and list(memory._queue) == []
    go_a.set()
    go_c.set()
    a.join(5)
    c.join(5)
    assert memory.used == 0


RELU = """
import torch
import torch.nn as nn

batch_size = 64
dim = 1000


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x), x.sum(dim=1)


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
"""

DATA_DEPENDENT = RELU.replace("return torch.relu(x), x.sum(dim=1)", "return x[: int(x.abs().sum().item()) % 3 + 1]")


def _reference(source: str) -> Reference:
    spec = KernelSpec(name="t", reference=source, backend="cpu", level=1)
    return Reference(Task(task_id="mem/t", kind="kernel", kernel=spec), "cpu")


def test_a_tasks_footprint_is_known_before_its_first_draw():
    ref = _reference(RELU)
    primary, alt = ref.shape_configs("cpu", 4)[:2]
    assert ref.footprint(primary) == 4 * (64 * 1000 + 64 * 1000 + 64)  # input, relu output, row sums
    assert ref.footprint(alt) == 4 * (33 * 1000 * 2 + 33)  # the derived alternative: batch 64 // 2 + 1
    trial = ref.trial(ref.instance(primary), 0)
    assert sum(t.numel() * 4 for t in [*trial.inputs, *trial.expected]) == ref.footprint(primary)


def test_a_forward_meta_tensors_cannot_run_is_unknown_until_drawn():
    ref = _reference(DATA_DEPENDENT)
    primary = ref.shape_configs("cpu", 1)[0]
    assert ref.footprint(primary) is None  # the runner then reserves the whole budget for the draw
    trial = ref.trial(ref.instance(primary), 0)
    assert ref.footprint(primary) == sum(t.numel() * 4 for t in [*trial.inputs, *trial.expected])
