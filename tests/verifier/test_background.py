"""Background work (actors/verifier/background.py): a compile started on a niced thread, and every
process it starts, yields the CPU; the thread that times keeps its priority."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from actors.verifier import background
from actors.verifier.background import BACKGROUND_NICE


def _child_niceness() -> int:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def test_work_in_the_background_and_its_processes_are_niced_and_the_caller_is_not():
    before = background.niceness(threading.get_native_id())
    inside, child = background.in_background(
        lambda: (background.niceness(threading.get_native_id()), _child_niceness())
    )
    assert inside == BACKGROUND_NICE and child == BACKGROUND_NICE
    assert background.niceness(threading.get_native_id()) == before


def test_an_exception_in_the_background_reaches_the_caller():
    with pytest.raises(ValueError, match="compile failed"):
        background.in_background(lambda: (_ for _ in ()).throw(ValueError("compile failed")))


def test_a_worker_pool_started_at_normal_priority_is_lowered():
    # A pool's workers started by this thread (torch.compile's, say) before any background work.
    pool = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert os.getpriority(os.PRIO_PROCESS, pool.pid) == background.niceness()
        assert background.lower_children() >= 1
        assert os.getpriority(os.PRIO_PROCESS, pool.pid) == BACKGROUND_NICE
    finally:
        pool.stdin.close()
        pool.wait()
