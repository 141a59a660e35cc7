"""Exclusive use of a device while it is being timed.

Every execution on a device (correctness trials, reference runs) holds a shared lease; a timing
window holds an exclusive one, so no other Kiln work runs on that GPU (or, on the cpu backend, no
other sandbox executes) while a candidate or a baseline is timed. The lease is an flock on a file
named after the device, so it holds across threads, run workers and verifier processes on one host.
A thread must not hold a shared lease while it asks for the exclusive one (flock would deadlock).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def device_key(device: str) -> str:
    """A host-unique name for `device` ("cpu", or the GPU's UUID so CUDA_VISIBLE_DEVICES cannot alias)."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    uuid = getattr(props, "uuid", None)
    return f"cuda-{uuid}" if uuid is not None else f"cuda-{props.pci_bus_id if hasattr(props, 'pci_bus_id') else 0}"


class DeviceLease:
    def __init__(self, device: str, lock_dir: str | None = None) -> None:
        root = Path(lock_dir or tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / f"kiln-device-{device_key(device)}.lock"

    @contextmanager
    def _hold(self, mode: int):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def shared(self):
        return self._hold(fcntl.LOCK_SH)

    def exclusive(self):
        return self._hold(fcntl.LOCK_EX)
