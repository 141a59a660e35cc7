"""The trusted side draws a shape's later trials only when the sandbox is ready for them (runner.py's
plan): a candidate stopped on its first trial costs one reference draw per shape, not every trial's,
and a task whose sizes change between draws is a broken task, not a sandbox overrun."""

from __future__ import annotations

import uuid
import weakref
from pathlib import Path

import pytest

from actors.verifier.families import ALL
from actors.verifier.reference import Reference, Trial
from actors.verifier.runner import RUN_COPIES
from actors.verifier.verifier import KernelVerifier
from protocols import KernelSpec, Task
from tests.verifier.integrity import config, verify

RELU_SOLUTION = Path("tasks/solutions/cpu/level1/01_relu.py")


@pytest.fixture
def draws(monkeypatch):
    """Every reference trial drawn, as (shape label, trial index)."""
    seen: list[tuple[str, int]] = []
    original = Reference.trial

    def counted(self, instance, index, *args, **kw):
        seen.append((instance.config.label, index))
        return original(self, instance, index, *args, **kw)

    monkeypatch.setattr(Reference, "trial", counted)
    return seen


def _distinct(source: str) -> str:
    return source + f"\n# {uuid.uuid4().hex}\n"  # no verdict-cache hit; the same build


def test_a_candidate_stopped_on_its_first_trial_costs_one_draw_per_shape(relu_task, verifier_cache_dir, draws):
    verifier = KernelVerifier(config(verifier_cache_dir))
    try:
        cheat = verify(verifier, relu_task, _distinct(relu_task.kernel.reference.replace("Model", "ModelNew")))
        stopped = list(draws)
        draws.clear()
        honest = verify(verifier, relu_task, _distinct(RELU_SOLUTION.read_text()))
    finally:
        verifier.close()
    assert cheat.error_class == "cheating", cheat.feedback
    # relu has two declared alternative shapes: alt0, alt1 and the primary, one draw each
    assert sorted(label for label, _ in stopped) == ["alt0", "alt1", "primary"]
    assert honest.passed, honest.feedback
    # the honest one sees every trial: one per alternative, the primary's two and one per input family
    # (the sensitivity trial is drawn by Reference.sensitivity_trial)
    assert sorted(label for label, _ in draws) == ["alt0", "alt1"] + ["primary"] * (2 + len(ALL))
    assert len(honest.diagnostics["trials"]) == 4 + len(ALL) + 1
    # the run reserved device memory for its largest trial (the primary: 16 x 4096 floats in, as many out)
    assert honest.diagnostics["sandbox"]["limits"]["device_reserved_mb"] == (RUN_COPIES * 2 * 16 * 4096 * 4) >> 20


def test_a_trial_drawn_just_before_its_use_never_waits_and_is_gone_before_the_next(
    relu_task, verifier_cache_dir, monkeypatch
):
    """At KernelBench's sizes a trial is gigabytes: a later trial stays where it was drawn (no copy to
    the host and back) and no judged trial is still held when the next one is drawn."""
    drawn: list[tuple[str, int, bool, weakref.ref]] = []
    held_at_draw: list[list[int]] = []
    original = Reference.trial

    def watched(self, instance, index, *args, waits=True, **kw):
        held_at_draw.append([i for _, i, w, ref in drawn if not w and ref() is not None])
        trial = original(self, instance, index, *args, waits=waits, **kw)
        if isinstance(trial, Trial):
            drawn.append((instance.config.label, index, waits, weakref.ref(trial.expected[0])))
        return trial

    monkeypatch.setattr(Reference, "trial", watched)
    verifier = KernelVerifier(config(verifier_cache_dir, **{"verifier.trials": 4}))
    try:
        r = verify(verifier, relu_task, _distinct(RELU_SOLUTION.read_text()))
    finally:
        verifier.close()
    assert r.passed, r.feedback
    first = [(label, waits) for label, index, waits, _ in drawn if index % 100 == 0]
    later = [(label, waits) for label, index, waits, _ in drawn if index % 100 != 0]
    assert first and all(waits for _, waits in first)  # drawn while planning: they wait
    assert len(later) >= 2 and not any(waits for _, waits in later)
    assert held_at_draw and not any(held_at_draw), held_at_draw


GROWING = """
import torch
import torch.nn as nn

batch_size = 16
dim = 4096
KILN_ALT_SHAPES = []
DRAWN = [0]


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    DRAWN[0] += 1
    return [torch.randn(batch_size * DRAWN[0], dim)]


def get_init_inputs():
    return []
"""


def test_a_task_whose_sizes_change_between_draws_is_a_broken_task(verifier_cache_dir):
    task = Task(
        task_id="broken/growing",
        kind="kernel",
        kernel=KernelSpec(name="growing", reference=GROWING, backend="cpu", level=1),
    )
    verifier = KernelVerifier(config(verifier_cache_dir, **{"verifier.trials": 2}))
    try:
        result = verify(verifier, task, _distinct(RELU_SOLUTION.read_text()))
    finally:
        verifier.close()
    assert result.error_class == "infra" and not result.diagnostics["violations"], result.feedback
    assert "sizes must not change between draws" in result.feedback
    # the first trial (the plan's draw) was judged before the larger second draw was refused
    assert [t["passed"] for t in result.diagnostics["trials"]] == [True]


HINGE = """
import torch
import torch.nn as nn

batch_size = 64
input_shape = (64,)


class Model(nn.Module):
    def forward(self, predictions, targets):
        return torch.mean(torch.clamp(1 - predictions * targets, min=0))


def get_inputs():
    return [torch.rand(batch_size, *input_shape), torch.randint(0, 2, (batch_size,)).float() * 2 - 1]


def get_init_inputs():
    return []
"""


def test_a_derived_alternative_shape_the_forward_rejects_is_skipped(verifier_cache_dir, draws):
    """KernelBench level1_100: its forward broadcasts (batch, dim) against (batch,), so it runs only
    where batch == dim; the derived alternative batch is skipped with a note, not an infra verdict."""
    task = Task(
        task_id="kb/hinge", kind="kernel", kernel=KernelSpec(name="hinge", reference=HINGE, backend="cpu", level=1)
    )
    verifier = KernelVerifier(config(verifier_cache_dir))
    try:
        result = verify(verifier, task, _distinct(HINGE.replace("Model", "ModelNew")))
    finally:
        verifier.close()
    assert result.error_class == "cheating" and "refused in the sandbox" in result.feedback
    assert any("skipped shapes batch_size=33" in n for n in result.diagnostics["notes"]), result.diagnostics["notes"]
    assert [label for label, _ in draws] == ["alt0", "primary"]


def test_a_run_waiting_for_device_memory_holds_nothing_meanwhile(relu_task, verifier_cache_dir, monkeypatch):
    """A task's size is known before drawing, so a run reserves its device memory before its first
    draw and holds it to its verdict: on a lane that fits one run, a second run draws nothing (parks
    no trial on the host, writes no arena) until the first is done. At KernelBench's sizes two such
    runs, one running and one planned, held more host memory than a 128 GB machine has."""
    import threading

    from actors.verifier import lanes
    from actors.verifier.devmem import DeviceMemory

    one_run = RUN_COPIES * 2 * 16 * 4096 * 4  # the primary trial: 16 x 4096 floats in, as many out
    monkeypatch.setattr(lanes.DeviceMemory, "for_device", classmethod(lambda cls, device: DeviceMemory(one_run)))
    order: list[int] = []
    original = Reference.trial

    def counted(self, instance, index, *args, **kw):
        order.append(threading.get_ident())
        return original(self, instance, index, *args, **kw)

    monkeypatch.setattr(Reference, "trial", counted)
    verifier = KernelVerifier(config(verifier_cache_dir))
    results = {}
    try:
        runs = [
            threading.Thread(
                target=lambda k=k: results.update(
                    {k: verify(verifier, relu_task, _distinct(RELU_SOLUTION.read_text()))}
                )
            )
            for k in range(2)
        ]
        for run in runs:
            run.start()
        for run in runs:
            run.join()
    finally:
        verifier.close()
    assert all(r.passed for r in results.values()), [r.feedback for r in results.values()]
    each = 4 + len(ALL)  # the draws of Reference.trial: one per alternative, two plain primary, the families
    assert len(order) == 2 * each and len(set(order)) == 2
    # each run's draws are contiguous: the second began when the first had finished
    assert order[:each] == [order[0]] * each and order[each:] == [order[each]] * each, order


SIZED_WHEN_DRAWN = (
    Path("tasks/level1/01_relu.py")
    .read_text()
    .replace(
        "        return torch.relu(x)",
        "        if x.abs().sum().item() < 0:  # never true, but data-dependent: meta tensors cannot size it\n"
        "            return x\n"
        "        return torch.relu(x)",
    )
)


def test_no_run_waits_for_device_memory_while_it_holds_a_sandbox(relu_task, verifier_cache_dir, monkeypatch):
    """Runs that hold device memory wait for the lane's sandbox slots, so a run that holds a slot must
    never wait for memory. CI hung on that cycle: a task of unknown size reserved after its sandbox
    started, queued behind another such task's whole-budget draw, which waited for a known-size run's
    memory, which waited for the one slot. Memory comes first on every path, for both kinds of task."""
    import threading
    from contextlib import contextmanager

    from actors.verifier.devmem import DeviceMemory
    from actors.verifier.executor import SandboxPool

    holding = threading.local()
    inside: list[int] = []
    session, reserve = SandboxPool.session, DeviceMemory.reserve

    @contextmanager
    def watched_session(self, *args, **kw):
        with session(self, *args, **kw) as child:
            holding.slot = True
            try:
                yield child
            finally:
                holding.slot = False

    def watched_reserve(self, nbytes, *args, **kw):
        if nbytes and getattr(holding, "slot", False):
            inside.append(nbytes)
        return reserve(self, nbytes, *args, **kw)

    monkeypatch.setattr(SandboxPool, "session", watched_session)
    monkeypatch.setattr(DeviceMemory, "reserve", watched_reserve)
    unknown = Task(
        task_id="mem/sized-when-drawn",
        kind="kernel",
        kernel=KernelSpec(name="sized-when-drawn", reference=SIZED_WHEN_DRAWN, backend="cpu", level=1),
    )
    assert Reference(unknown, "cpu").footprint(Reference(unknown, "cpu").shape_configs("cpu", 1)[0]) is None
    verifier = KernelVerifier(config(verifier_cache_dir, **{"verifier.run_workers": 1}))
    results: dict[int, object] = {}
    try:
        runs = [
            threading.Thread(
                target=lambda k=k, task=task: results.update(
                    {k: verify(verifier, task, _distinct(RELU_SOLUTION.read_text()))}
                )
            )
            for k, task in enumerate([unknown, relu_task, unknown])
        ]
        for run in runs:
            run.start()
        for run in runs:
            run.join(120)
        assert not any(run.is_alive() for run in runs), "the runs deadlocked"
    finally:
        verifier.close()
    assert all(r.passed for r in results.values()), [r.feedback for r in results.values()]
    one_run_mb = (RUN_COPIES * 2 * 16 * 4096 * 4) >> 20  # each reserved its primary trial's copies
    assert [r.diagnostics["sandbox"]["limits"]["device_reserved_mb"] for r in results.values()] == [one_run_mb] * 3
    assert inside == [], f"reservations of {inside} bytes waited inside a sandbox"
