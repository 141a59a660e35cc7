"""The device lease: exclusive use of a device while something on it is being timed.

Every piece of Kiln work on a device holds a shared lease while it runs: the verifier's correctness
trials and reference runs, each decode step of the embedded engine, each learner step. A timing
window (a candidate's timed runs, a baseline) holds the exclusive lease, so no other Kiln work runs
on that GPU (or, on the cpu backend, on the host) while it is measured; engines and learners pause
between their steps until it ends. The lease is a pair of flock'ed files named after the device, so
it holds across threads and processes on one host (Ray actors included): a turnstile that an
exclusive holder takes first, so a stream of shared holders cannot starve it, and the lock itself.
A thread must not hold a shared lease while it asks for the exclusive one (flock would deadlock).

This is a coordination protocol between actors, like the records and channels of this package;
it needs torch only to name a CUDA device by its UUID (so CUDA_VISIBLE_DEVICES cannot alias two).

With KILN_LEASE_TRACE=FILE in the environment, every hold of every lease in the process (and in the
processes it starts, which inherit the variable) is appended to FILE as one JSON line: who held it
(the calling function), when it was asked for, granted and released, and for an exclusive hold when
it won the turnstile (from then on it waits for the shared holders to drain, and every new shared
holder waits for it). `python -m launch.bench.lease_report FILE` says where the device's time went.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path


def device_key(device: str) -> str:
    """A host-unique name for `device` ("cpu", or the GPU's UUID so CUDA_VISIBLE_DEVICES cannot alias)."""
    if not str(device).startswith("cuda"):
        return "cpu"
    import torch  # only CUDA devices need it, and only here

    props = torch.cuda.get_device_properties(torch.device(device))
    uuid = getattr(props, "uuid", None)
    return f"cuda-{uuid}" if uuid is not None else f"cuda-{props.pci_bus_id if hasattr(props, 'pci_bus_id') else 0}"


TRACE_ENV = "KILN_LEASE_TRACE"
_TRACE_LOCK = threading.Lock()


def _trace(kind: str, asked: float, granted: float, turnstile: float | None = None) -> None:
    """Append one hold, released now, to the trace file named by KILN_LEASE_TRACE (one write a line,
    under a lock: whole lines whatever the threads; O_APPEND keeps processes' lines whole too)."""
    record = {"kind": kind, "pid": os.getpid(), "holder": _holder(), "asked": asked, "granted": granted}
    if turnstile is not None:
        record["turnstile"] = turnstile
    record["released"] = time.monotonic()
    line = (json.dumps(record) + "\n").encode()
    with _TRACE_LOCK:
        fd = os.open(os.environ[TRACE_ENV], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _holder() -> str:
    """`module.function:line` of the code that holds the lease: the first frame outside this module
    and contextlib (an ExitStack's frames included)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "") in (__name__, "contextlib"):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}:{frame.f_lineno}"


class DeviceLease:
    def __init__(self, device: str, lock_dir: str | None = None) -> None:
        root = Path(lock_dir or tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        key = device_key(device)
        self.path = root / f"kiln-device-{key}.lock"
        self.turnstile = root / f"kiln-device-{key}.turnstile"
        self.exclusive_s = 0.0  # seconds this process held the device exclusively (what benchmarks report)

    @staticmethod
    def _open(path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            os.fchmod(fd, 0o666)  # shared by every Kiln process on the host, whoever made it first
        except OSError:
            pass
        return fd

    @contextmanager
    def shared(self):
        traced = TRACE_ENV in os.environ
        asked = granted = time.monotonic()
        gate = self._open(self.turnstile)
        try:
            fcntl.flock(gate, fcntl.LOCK_SH)  # waits while an exclusive holder is queued or running
        finally:
            os.close(gate)
        fd = self._open(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            granted = time.monotonic()
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock
            if traced:
                _trace("shared", asked, granted)

    @contextmanager
    def exclusive(self):
        traced = TRACE_ENV in os.environ
        asked = time.monotonic()
        gate = self._open(self.turnstile)
        fd = -1
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            turnstile = time.monotonic()
            fd = self._open(self.path)
            fcntl.flock(fd, fcntl.LOCK_EX)
            started = time.perf_counter()
            granted = time.monotonic()
            try:
                yield
            finally:
                self.exclusive_s += time.perf_counter() - started
                if traced:
                    _trace("exclusive", asked, granted, turnstile)
        finally:
            if fd >= 0:
                os.close(fd)
            os.close(gate)
