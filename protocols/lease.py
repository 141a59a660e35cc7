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
"""

from __future__ import annotations

import fcntl
import os
import tempfile
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
        gate = self._open(self.turnstile)
        try:
            fcntl.flock(gate, fcntl.LOCK_SH)  # waits while an exclusive holder is queued or running
        finally:
            os.close(gate)
        fd = self._open(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    @contextmanager
    def exclusive(self):
        gate = self._open(self.turnstile)
        fd = -1
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fd = self._open(self.path)
            fcntl.flock(fd, fcntl.LOCK_EX)
            started = time.perf_counter()
            try:
                yield
            finally:
                self.exclusive_s += time.perf_counter() - started
        finally:
            if fd >= 0:
                os.close(fd)
            os.close(gate)
