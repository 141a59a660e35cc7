"""A lane's device memory, counted: the verifier's own work on one GPU reserves what it will hold.

Several candidate runs share a lane: the trusted side draws their trials on the GPU, their sandboxes
copy inputs to it and write outputs there, and the baseline process times references on it. At
KernelBench's own sizes a trial is up to 16 GB of inputs and outputs, so four such runs at once ask
more than an 80 GB card holds, and whichever allocation comes last fails: a candidate's sandbox
gets "CUDA out of memory" for the verifier's crowding, which is no verdict on the candidate.

So every run reserves, before it touches the device, what it will hold there (`reserve`), and waits
while the lane's budget is spoken for. Requests are served in arrival order (a large one is not
starved by a stream of small ones); one larger than the whole budget waits until the lane is empty
and then runs alone. A reservation is never taken while the same thread holds another, so no
thread waits on itself, and never while its run holds one of the lane's sandbox slots: runs that hold
memory wait for slots, so a slot's holder waiting for memory could wait on itself through them (the
order is memory first, then the sandbox, on every path of runner.py). A run whose verdict is no longer
wanted stops waiting (`wake`). The budget is most of the device's free memory when the lane starts (on
cpu, half the machine's memory: the same code, so the cpu backend exercises it).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# The share of the device's free memory at start-up that the verifier's work may reserve: the rest
# is headroom for what the counts do not see (CUDA contexts, the caching allocator's fragments).
DEVICE_SHARE = 0.85
HOST_SHARE = 0.5  # cpu backend: the share of the machine's memory


class GaveUp(Exception):
    """A reservation's wait ended by its `give_up` event: the run is no longer wanted."""


class DeviceMemory:
    """Bytes of one lane's memory that its runs may hold at once, handed out first come first served."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = max(int(budget_bytes), 1)
        self.used = 0
        self.peak = 0  # the most reserved at once (what benchmarks and tests read)
        self.waited_s = 0.0  # seconds runs spent waiting for memory, summed
        self._cond = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()
        self._tickets = itertools.count()

    @classmethod
    def for_device(cls, device: str) -> DeviceMemory:
        if device.startswith("cuda"):
            import torch

            free, _ = torch.cuda.mem_get_info(torch.device(device))
            return cls(int(free * DEVICE_SHARE))
        from actors.verifier.limits import machine_memory_bytes

        return cls(int(machine_memory_bytes() * HOST_SHARE))

    def grant(self, nbytes: int) -> int:
        """What a request for `nbytes` is given: itself, or the whole budget when it asks for more."""
        return min(max(int(nbytes), 0), self.budget)

    @contextmanager
    def reserve(self, nbytes: int, give_up: threading.Event | None = None) -> Iterator[int]:
        """Hold `nbytes` of the lane's memory for the block (waiting, in arrival order, until they are
        free); yields the bytes granted. GaveUp when `give_up` is set before they are (see `wake`)."""
        granted = self.grant(nbytes)
        if granted == 0:
            yield 0
            return
        started = time.perf_counter()
        with self._cond:
            ticket = next(self._tickets)
            self._queue.append(ticket)
            try:
                self._cond.wait_for(
                    lambda: (
                        (give_up is not None and give_up.is_set())
                        or (self._queue[0] == ticket and self.used + granted <= self.budget)
                    )
                )
                if give_up is not None and give_up.is_set():
                    raise GaveUp
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            self.used += granted
            self.peak = max(self.peak, self.used)
            self.waited_s += time.perf_counter() - started
        try:
            yield granted
        finally:
            with self._cond:
                self.used -= granted
                self._cond.notify_all()

    def wake(self) -> None:
        """Have the waiting reservations look at their `give_up` events again (one was just set)."""
        with self._cond:
            self._cond.notify_all()
