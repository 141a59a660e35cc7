"""Device-synchronised timing, shared by the candidate (in the sandbox) and the reference baselines.

Both sides are measured by the same `Clock`, so speedups compare like with like:
* cuda: before each run a buffer twice the L2 size is zeroed (a cold cache, as a fresh call would see
  in a model), then start event -> the call -> a device-wide synchronize -> end event. The device-wide
  synchronize makes work on side streams count: it cannot escape the window.
* cpu: perf_counter around the call (no L2 flush).
Runs repeat up to `repeats` times or until `budget_s` is spent (at least `MIN_RUNS`); the median is
what counts. Functions are captured at import time, before any candidate runs in this process.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time

import torch

# Captured at import (before any candidate runs in this process): C-level functions that a
# candidate's monkey-patching of torch.cuda.Event / torch.cuda.synchronize cannot reach.
_EventBase = torch._C._CudaEventBase  # a method-less stub in CPU-only builds of torch
_record, _elapsed, _event_sync = (getattr(_EventBase, n, None) for n in ("record", "elapsed_time", "synchronize"))
_current_stream = torch.cuda.current_stream
device_sync = getattr(torch._C, "_cuda_synchronize", None) or torch.cuda.synchronize

MIN_RUNS = 3
# On the cpu backend both sides are timed on one intra-op thread: CPU timing shares the host with
# compiles and other sandboxes, and a spinning OpenMP team on an oversubscribed host turns a
# microsecond op into milliseconds. One thread measures the kernels, not the scheduler.
CPU_TIMING_THREADS = 1
_perf_ns = time.perf_counter_ns


@contextlib.contextmanager
def cpu_threads(device_type: str):
    """Run the block with CPU_TIMING_THREADS intra-op threads on the cpu backend (restored after)."""
    if device_type != "cpu":
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(CPU_TIMING_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class Clock:
    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._flush = None
        if device_type == "cuda":
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            l2 = int(getattr(props, "L2_cache_size", 0) or 0) or (50 << 20)
            self._flush = torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device="cuda")
            self._start = _EventBase(enable_timing=True)
            self._end = _EventBase(enable_timing=True)

    def measure(self, fn):
        """(fn's result, seconds) for one call."""
        if self.device_type != "cuda":
            t0 = _perf_ns()
            result = fn()
            return result, (_perf_ns() - t0) / 1e9
        self._flush.zero_()
        _record(self._start, _current_stream())
        result = fn()
        device_sync()
        _record(self._end, _current_stream())
        _event_sync(self._end)
        return result, _elapsed(self._start, self._end) / 1e3

    def sync(self) -> None:
        if self.device_type == "cuda":
            device_sync()


def run_series(clock: Clock, call, *, warmup: int, repeats: int, budget_s: float,
               before=None, after=None) -> list[float]:
    """Time `call(i)` for runs i = 0, 1, ...: `before(i)` and `after(i, result)` run outside the window.
    Warm-up runs (untimed) get negative i. Stops at `repeats` runs, or once `budget_s` is spent after MIN_RUNS."""
    for w in range(warmup):
        if before:
            before(-1 - w)
        result, _ = clock.measure(lambda: call(-1 - w))
        if after:
            after(-1 - w, result)
    clock.sync()
    times: list[float] = []
    started = _perf_ns()
    for i in range(repeats):
        if before:
            before(i)
        result, seconds = clock.measure(lambda: call(i))
        times.append(seconds)
        if after:
            after(i, result)
        if len(times) >= MIN_RUNS and (_perf_ns() - started) / 1e9 > budget_s:
            break
    return times


def median(times: list[float]) -> float:
    return statistics.median(times) if times else float("nan")


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


class InputFeeder:
    """Prepares the inputs of each timed run, identically for candidate and baseline: input set
    `order[i]` is copied into fixed buffers (same addresses every run), and a repeat of a set gets the
    lowest mantissa bit of one random element of each floating input flipped, so no run ever sees
    an input it has seen before (a cache keyed on content misses). Warm-up runs (i < 0) are fed
    like timed runs; the first timed run of each set gets it unchanged."""

    def __init__(self, sets: list[list], order: list[int]) -> None:
        self.sets, self.order = sets, order
        self.feed = [x.clone() if isinstance(x, torch.Tensor) else x for x in sets[0]]
        self.seen: set[int] = set()
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))

    def set_of(self, i: int) -> int:
        return self.order[i % len(self.order)] if i >= 0 else self.order[(-1 - i) % len(self.order)]

    def before(self, i: int) -> None:
        k = self.set_of(i)
        for buf, src in zip(self.feed, self.sets[k]):
            if isinstance(buf, torch.Tensor):
                buf.copy_(src)
        if i < 0 or k in self.seen:
            self._perturb()
        if i >= 0:
            self.seen.add(k)

    def _perturb(self) -> None:
        for buf in self.feed:
            if isinstance(buf, torch.Tensor) and buf.dtype in _BITS and buf.numel() and buf.is_contiguous():
                flat = buf.view(-1).view(_BITS[buf.dtype])
                flat[self._rng.randrange(flat.numel())].bitwise_xor_(1)
