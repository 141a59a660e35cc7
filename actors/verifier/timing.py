"""Device-synchronised timing, the rule that decides which clock counts, and the plausibility bound.

`Clock` measures one call, the same way for the candidate (in its sandbox) and the reference
baselines (in the verifier):
* cuda: before each run (`prepare`, outside the window) a buffer twice the L2 size is zeroed (a cold
  cache, as a fresh call would see in a model); then start event -> the call -> a device-wide
  synchronize -> end event. The device-wide synchronize makes work on side streams count.
* cpu: perf_counter around the call (no L2 flush).

A sandbox's clock is the candidate's clock: it runs in the candidate's process. So every timed run
is also measured by the verifier, around the round trip of the request that made it (`run`), and
so is the same request without the forward (`null`) in between. `trusted_seconds` uses the
sandbox's median only while it is not clearly below the verifier's floor (fastest round trip minus
fastest null); when the sandbox claims less, the floor counts and the diagnostics say so.

`Bandwidth` is the physical plausibility bound: calibrated once per device at start-up (the fastest
copy this device achieves, at cache and at memory sizes), it gives the shortest time a call that
reads its inputs and writes its outputs can take. A measured time below it earns no speed bonus.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time

import torch

# Captured at import (before any candidate runs in this process): C-level functions that a
# candidate's monkey-patching of torch.cuda.Event / torch.cuda.synchronize cannot reach.
_EventBase = torch._C._CudaEventBase  # a method-less stub in CPU-only builds of torch
_record, _elapsed, _event_sync = (getattr(_EventBase, n, None) for n in ("record", "elapsed_time", "synchronize"))
_current_stream = torch.cuda.current_stream
device_sync = getattr(torch._C, "_cuda_synchronize", None) or torch.cuda.synchronize
_zero = torch._C.TensorBase.zero_

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

    def prepare(self) -> None:
        """Before a timed run, outside its window: a cold L2 on cuda."""
        if self.device_type == "cuda":
            _zero(self._flush)
            device_sync()

    def measure(self, fn):
        """(fn's result, seconds) for one call."""
        if self.device_type != "cuda":
            t0 = _perf_ns()
            result = fn()
            return result, (_perf_ns() - t0) / 1e9
        _record(self._start, _current_stream())
        result = fn()
        device_sync()
        _record(self._end, _current_stream())
        _event_sync(self._end)
        return result, _elapsed(self._start, self._end) / 1e3

    def sync(self) -> None:
        if self.device_type == "cuda":
            device_sync()


def median(times: list[float]) -> float:
    return statistics.median(times) if times else float("nan")


# The sandbox's clock is distrusted when the verifier's floor exceeds its median by more than this
# ratio and slack. The slack is the honest excess of the floor over the sandbox's own time, per
# backend: on cpu the run and null request paths differ by a Python call or two; on an H100 the
# floor of honest candidates exceeded their CUDA-event times by 0.03-0.36 ms (median 0.2-0.25 ms
# in four runs of 25): the host work after a real forward (output checks, the reply) runs slower
# than after the null's, and the events start after the handler's own work began. A forger gains
# at most this slack plus the ratio.
CLOCK_RATIO = 1.25
CLOCK_SLACK_S = {"cpu": 50e-6, "cuda": 400e-6}


def trusted_seconds(reported: list[float], round_trips: list[float], nulls: list[float],
                    device_type: str = "cpu") -> tuple[float, str]:
    """The candidate's time per call, and whose clock it is ("sandbox" or "verifier").

    `reported`: the sandbox's own measurement of each timed run; `round_trips`: the verifier's clock
    around the same requests; `nulls`: the verifier's clock around the same request path without the
    forward. Scheduling noise on a shared host only ever adds time to a round trip, so the fastest
    round trip minus the fastest null is a floor under what one forward took, measured from outside
    the sandbox. The sandbox's median counts while it is not clearly below that floor; otherwise the
    floor counts. A forged sandbox clock therefore gains at most the gap between a forward's fastest
    run and its median, plus the band."""
    own = median(reported)
    floor = max(min(round_trips) - min(nulls), 1e-9) if round_trips and nulls else 1e-9
    if not reported or own != own or own <= 0:
        return floor, "verifier"
    if floor > own * CLOCK_RATIO + CLOCK_SLACK_S.get(device_type, CLOCK_SLACK_S["cpu"]):
        return floor, "verifier"
    return own, "sandbox"


# The verifier measures a timed run's round trip from one of its threads. When the reply arrives, that
# thread must take the GIL back from whichever thread took it while it waited, and CPython hands the
# GIL over only every switch interval (5 ms by default): a busy verifier (other candidates' checks,
# compile supervision, baseline work) then adds up to 5 ms to a run's round trip but rarely to the
# much shorter null round trip, and the floor counts a 0.2 ms kernel as several ms. While any timed
# window is open the interval is this short, so the thread gets the GIL back within microseconds.
TIMING_SWITCH_INTERVAL_S = 20e-6
_windows = 0
_windows_lock = threading.Lock()
_saved_interval = 0.005


@contextlib.contextmanager
def responsive_gil():
    """Shorten the GIL switch interval while the block runs (process-wide; windows may overlap)."""
    global _windows, _saved_interval
    with _windows_lock:
        if _windows == 0:
            _saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(TIMING_SWITCH_INTERVAL_S)
        _windows += 1
    try:
        yield
    finally:
        with _windows_lock:
            _windows -= 1
            if _windows == 0:
                sys.setswitchinterval(_saved_interval)


class Bandwidth:
    """The fastest this device moves bytes, measured once: the plausibility bound's calibration."""

    SIZES = (256 << 10, 4 << 20, 64 << 20)  # cache-resident to memory-resident working sets
    SLACK = 4.0  # a candidate may beat the calibrated copy by this much before it is implausible

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.bytes_per_s = self._calibrate()

    def _calibrate(self) -> float:
        device = "cuda" if self.device_type == "cuda" else "cpu"
        best = 0.0
        threads = torch.get_num_threads()
        for size in self.SIZES:
            src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
            dst = torch.empty_like(src)
            for _ in range(2):
                dst.copy_(src)
            times = []
            for _ in range(5):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            best = max(best, 2 * size / max(min(times), 1e-9))  # bytes read + bytes written
        torch.set_num_threads(threads)
        return best

    def min_seconds(self, moved_bytes: int) -> float:
        """The least time a call that reads and writes `moved_bytes` can take on this device."""
        return moved_bytes / (self.bytes_per_s * self.SLACK) if self.bytes_per_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"bytes_per_s": self.bytes_per_s, "slack": self.SLACK}
