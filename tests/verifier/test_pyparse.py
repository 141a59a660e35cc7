"""Kiln's one parse lock (protocols/pyparse.py), against CPython 3.11.7's gh-106905.

Several threads parse while another makes cyclic garbage whose finalizers run Python code, with the
collector and thread switches made frequent: bare `ast.parse` raises "AST constructor recursion
depth mismatch" within about 50 ms here on 3.11.7; `parse_python` must not in 1.5 s.
"""

from __future__ import annotations

import ast
import gc
import sys
import threading
import time
from pathlib import Path

from actors.verifier.extract import extract
from actors.verifier.legality import static_scan
from protocols.pyparse import parse_python

SOURCE = "def f(x):\n    return [(a, b) for a in x for b in (a + 1, a * 2) if a and b]\n" * 8
RACE_S = 1.5


class _Finalized:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it, and runs __del__ when it does

    def __del__(self) -> None:
        sum(range(20))  # Python code in a finalizer: the interpreter may switch threads here


def _race(parse, seconds: float) -> list[BaseException]:
    errors: list[BaseException] = []
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for _ in range(50):
                _Finalized()

    def parser() -> None:
        while not stop.is_set():
            try:
                assert isinstance(parse(SOURCE), ast.Module)
            except BaseException as err:  # noqa: BLE001 - any failure is the finding
                errors.append(err)
                stop.set()

    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-5)
    gc.set_threshold(50, 5, 5)
    threads = [threading.Thread(target=churn)] + [threading.Thread(target=parser) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        stop.wait(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
        gc.set_threshold(*thresholds)
    return errors


def test_parses_racing_the_collectors_finalizers_never_fail():
    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    started = time.monotonic()
    assert _race(parse_python, RACE_S) == []
    assert time.monotonic() - started < 30  # bounded: the race stops at RACE_S
    assert (sys.getswitchinterval(), gc.get_threshold()) == (interval, thresholds)


# Parses that never share a process with Kiln's actors: timing_fidelity reads a task's shapes in a
# process that does not import Kiln.
OUTSIDE = {"launch/bench/timing_fidelity.py"}


def test_every_parse_of_kilns_goes_through_the_lock():
    """The race needs only one bare parse in the process: in an in-process run the rollout's prompts
    (actors/policy/prompts.py) parsed beside the verifier's threads, and a CI run of the demo got an
    honest candidate's `infra` from it. So no module of Kiln's that runs in a run's processes parses bare."""
    src = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
    assert extract(src).ok
    assert static_scan(src) == ([], [])
    root = Path(__file__).resolve().parents[2]
    bare = [
        str(p.relative_to(root))
        for package in ("actors", "protocols", "launch", "configs", "tasks")
        for p in (root / package).rglob("*.py")
        if p.name != "pyparse.py" and "ast.parse(" in p.read_text()
    ]
    assert sorted(bare) == sorted(OUTSIDE)
