"""The I/O arena of one sandbox session: the memory file through which every tensor passes between the
verifier and the sandbox (inputs in, outputs and inputs-as-left out; nothing tensor-sized crosses
the request socket). The verifier creates and maps it; the sandbox maps the same file. Regions are
handed out in order for each request; what the sandbox placed is read only at the offsets and sizes
the verifier expects (`take`). On cuda both sides page-lock it (`pin`), so copies between it and the
device go by DMA. Page-locking costs about 0.6 ms a MB (H200 host), and a KernelBench-sized task's
arena is about a gigabyte: the verifier's side is locked on a thread of its own while the sandbox
starts (and locks its own side), not before it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import torch

from actors.verifier import tensors


class Arena:
    """The I/O arena of one session: a memory file of `size` bytes, mapped here (and, by the sandbox,
    there). Regions are handed out in order; `reset()` starts over for the next request."""

    ALIGN = 64
    SMALLEST = 1 << 16

    def __init__(self, size: int) -> None:
        self.size = self.size_for(size)
        self.fd = os.memfd_create("kiln-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.used = 0
        self.pinned = False
        self.pin_s = 0.0  # seconds the page-locking took (on its own thread)
        self._pinning: threading.Thread | None = None

    @classmethod
    def size_for(cls, size: int) -> int:
        """The size of the arena asked for `size` bytes."""
        return max(int(size), cls.SMALLEST)

    def reset(self) -> None:
        self.used = 0

    def region(self, nbytes: int) -> list[int]:
        """[offset, nbytes] of a fresh region (ValueError when the arena is full)."""
        offset = self.used
        end = offset + int(nbytes)
        if end > self.size:
            raise ValueError(f"the I/O arena ({self.size} bytes) cannot hold {nbytes} more bytes")
        self.used = (end + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        return [offset, int(nbytes)]

    def put(self, value) -> dict | list:
        """An input into the arena: a tensor becomes [offset, nbytes, dtype, shape]; anything else
        travels as a value."""
        from actors.verifier.sandbox import DTYPE_NAMES

        self.ready()
        if not isinstance(value, torch.Tensor):
            return {"v": value}
        t = value.detach().contiguous()  # a device tensor is copied straight into the arena
        name = DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise ValueError(f"inputs of dtype {t.dtype} are not supported")
        nbytes = t.numel() * t.element_size()
        offset, _ = self.region(nbytes)
        if nbytes:
            self.bytes[offset : offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        return [offset, nbytes, name, list(t.shape)]

    def pin(self) -> None:
        """Page-lock the arena for the device (cuda), on a thread of its own; every use of the arena
        here waits for it (`ready`). Copies between it and device memory then go at the bus's speed
        instead of through the driver's bounce buffers: pageable copies of KernelBench-sized tensors
        were most of a cuda verification's timed stage. Left pageable (only slower) where the driver
        refuses."""
        self._pinning = threading.Thread(target=self._pin, args=(torch.cuda.current_device(),), daemon=True)
        self._pinning.start()

    def _pin(self, device: int) -> None:
        started = time.perf_counter()
        torch.cuda.set_device(device)  # the current device is per thread
        self.pinned = tensors.page_lock(self.bytes, portable=True)  # for every GPU's context of this process
        self.pin_s = time.perf_counter() - started

    def ready(self) -> None:
        """Wait for the page-locking started by `pin`, if any."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None

    def take(
        self, entry: list, expected: torch.Tensor, *, copy: bool = True, device: str | None = None
    ) -> torch.Tensor | None:
        """A copy (or, `copy=False`, a view) of the tensor the sandbox placed at `entry` ([offset,
        nbytes, dtype, shape, ...]), read only if it has exactly the expected dtype and shape; else None.
        `device`: the copy is made there (a copy onto the device is as much a snapshot as one on the
        host, and saves the host copy a device comparison would then need)."""
        from actors.verifier.sandbox import DTYPES

        self.ready()
        if not isinstance(entry, list) or len(entry) < 4 or not isinstance(entry[0], int) or entry[0] < 0:
            return None
        offset, nbytes, name, shape = entry[:4]
        if DTYPES.get(name) != expected.dtype or shape != list(expected.shape):
            return None
        if nbytes != expected.numel() * expected.element_size() or offset + nbytes > self.size:
            return None
        if nbytes == 0:
            return torch.empty(expected.shape, dtype=expected.dtype)
        region = self.bytes[offset : offset + nbytes]
        if not copy:
            return region.view(expected.dtype).reshape(expected.shape)
        if device is not None:  # a blocking copy: done, so a snapshot, when it returns
            return region.view(expected.dtype).reshape(expected.shape).to(device)
        return region.clone().view(expected.dtype).reshape(expected.shape)

    def close(self) -> None:
        self.ready()  # never unmapped while it is being locked
        if self.pinned:
            tensors.page_unlock(self.bytes)
            self.pinned = False
        del self.bytes
        self.map.close()
        os.close(self.fd)
