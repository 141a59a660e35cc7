"""The timing protocol (one harness for the candidate and the baselines) and the plausibility bound.

A figure that enters the reward comes from the verifier's own clock, never from a process that
loaded candidate code. The unit of measurement is a *trip*: K calls, each on a fresh draw of the
task's inputs staged into fixed buffers, each preceded (on cuda) by an L2 flush and followed by a
copy of its outputs (the snapshot the output check reads), the trip ending once the device is idle.
A *null trip* does the same work without the forward, re-using the last outputs. The verifier times
a trip and its null trip back to back, alternating which goes first; one call costs

    (trip - null trip) / K

so the round trip to the sandbox, the staging, the flush and the snapshot cancel out and K amortises
what noise is left (K is chosen so that a trip lasts TRIP_TARGET_S). The candidate's trips run in its
sandbox (a request each, timed here around the request); the baselines' trips run in the verifier
(`LocalTrips`, the same steps in the same order), which never loads candidate code. The mean of the
per-call figures pays; the median is recorded beside it.

`Bandwidth` is the physical plausibility bound: calibrated once per device at start-up (the fastest
copy this device achieves, at cache and at memory sizes), it gives the shortest time a call that
reads its inputs and writes its outputs can take. A measured time below it earns no speed bonus.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

MIN_RUNS = 3
# On the cpu backend both sides are timed on one intra-op thread: CPU timing shares the host with
# compiles and other sandboxes, and a spinning OpenMP team on an oversubscribed host turns a
# microsecond op into milliseconds. One thread measures the kernels, not the scheduler.
CPU_TIMING_THREADS = 1
# How long one trip should last: long enough that the round trip's noise (tens of microseconds on a
# loaded host) is a small part of it, short enough that a round of trips stays cheap.
TRIP_TARGET_S = {"cpu": 4e-3, "cuda": 2e-3}
MAX_CALLS_PER_TRIP = 64
# A mean per-call figure is resolved when it exceeds this many standard errors; until it is, up to
# EXTRA_PAIRS x the configured pairs are timed (within the time budget), since more pairs shrink the
# standard error where longer trips cannot (K is already at its target).
RESOLVED_SEMS = 2.0
EXTRA_PAIRS = 4
device_sync = getattr(torch._C, "_cuda_synchronize", None) or torch.cuda.synchronize


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


def median(times: list[float]) -> float:
    return statistics.median(times) if times else float("nan")


def calls_per_trip(estimate_s: float, device_type: str, most: int) -> int:
    """K for a call that takes about `estimate_s`: a trip of TRIP_TARGET_S, within [1, most]."""
    target = TRIP_TARGET_S.get(device_type, TRIP_TARGET_S["cpu"])
    k = math.ceil(target / max(estimate_s, 1e-7))
    return max(1, min(k, most, MAX_CALLS_PER_TRIP))


@dataclass
class TripTimes:
    """Per-call seconds from paired trips: what the reward reads (mean) and what is recorded beside it."""

    calls_per_trip: int
    per_call: list[float] = field(default_factory=list)  # (trip - null trip) / K, one per pair
    trips: list[float] = field(default_factory=list)
    nulls: list[float] = field(default_factory=list)

    @property
    def mean_s(self) -> float:
        return max(statistics.fmean(self.per_call), 1e-9) if self.per_call else float("nan")

    @property
    def sem_s(self) -> float:
        """The standard error of the mean per-call figure."""
        n = len(self.per_call)
        return statistics.stdev(self.per_call) / math.sqrt(n) if n >= 2 else float("inf")

    @property
    def resolved(self) -> bool:
        """The mean stands clear of the noise: at least MIN_RUNS pairs and mean > RESOLVED_SEMS x its
        standard error. On a loaded host a fast call's trip and null trip differ by less than their
        noise, and their difference is then any small number, zero or below included."""
        return len(self.per_call) >= MIN_RUNS and statistics.fmean(self.per_call) > RESOLVED_SEMS * self.sem_s

    @property
    def paid_s(self) -> float:
        """The candidate's figure: the mean when resolved; otherwise the upper end of its noise (mean +
        RESOLVED_SEMS x standard error), so noise can never make a call look faster than it is."""
        if not self.per_call:
            return float("nan")
        if self.resolved:
            return self.mean_s
        return max(statistics.fmean(self.per_call) + RESOLVED_SEMS * self.sem_s, 1e-9)

    @property
    def median_s(self) -> float:
        return max(median(self.per_call), 1e-9) if self.per_call else float("nan")

    def to_json(self) -> dict:
        return {
            "calls_per_trip": self.calls_per_trip,
            "pairs": len(self.per_call),
            "mean_s": self.mean_s,
            "median_s": self.median_s,
            "trip_min_s": min(self.trips, default=None),
            "null_min_s": min(self.nulls, default=None),
        }


def time_pair(trip, k: int, index: int) -> tuple[float, float]:
    """(trip seconds, null trip seconds) by this process's clock; `trip(k, null)` runs one. The order
    alternates with `index` so that drift between the two cancels over pairs."""
    order = (False, True) if index % 2 == 0 else (True, False)
    took = {}
    for null in order:
        t0 = time.perf_counter()
        trip(k, null)
        took[null] = time.perf_counter() - t0
    return took[False], took[True]


def choose_k(trip, device_type: str, most: int, warmups: int) -> int:
    """K for the timed pairs, from `warmups` untimed pairs of a few calls each (one call's cost is too
    close to the round trip's noise to measure alone)."""
    k0 = max(1, min(4, most))
    estimates = []
    for i in range(max(warmups, 1)):
        run_s, null_s = time_pair(trip, k0, i)
        estimates.append(max((run_s - null_s) / k0, 1e-7))
    return calls_per_trip(median(estimates), device_type, most)


def want_more(times: TripTimes, pairs: int, elapsed_s: float, budget_s: float) -> bool:
    """Whether to time another pair: until `pairs` are done, then while the figure is not resolved,
    up to EXTRA_PAIRS x `pairs` and `budget_s` seconds (at least MIN_RUNS pairs in any case)."""
    done = len(times.per_call)
    if done < MIN_RUNS:
        return True
    if elapsed_s > budget_s:
        return False
    return done < pairs or (not times.resolved and done < EXTRA_PAIRS * pairs)


def record(times: TripTimes, run_s: float, null_s: float) -> None:
    times.trips.append(run_s)
    times.nulls.append(null_s)
    times.per_call.append((run_s - null_s) / times.calls_per_trip)


class LocalTrips:
    """Trips of the reference (eager or compiled) in this process, step for step as the sandbox runs
    the candidate's (sealed.py, op_trip): each call on its own set of inputs already on the device,
    preceded (on cuda) by an L2 flush, its outputs copied to a snapshot; then wait for the device.
    `sets` are the calls' inputs (on the host); `stage(k)` puts the first k on the device, untimed."""

    def __init__(self, fn, sets: list[list], device: str) -> None:
        self.fn = fn
        self.sets = sets
        self.device = device
        self.cuda = device.startswith("cuda")
        self.staged: list[list] = []
        self.last = None
        self.snaps: dict[bool, list[list[torch.Tensor]]] = {False: [], True: []}
        self.flush = self.zero = None
        if self.cuda:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            size = max(2 * int(getattr(props, "L2_cache_size", 0) or (50 << 20)), 64 << 20)
            self.flush = torch.empty(size, dtype=torch.uint8, device=device)
            self.zero = torch.zeros(size, dtype=torch.uint8, device=device)

    def stage(self, k: int) -> None:
        self.staged = [
            [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in self.sets[i % len(self.sets)]]
            for i in range(k)
        ]
        if self.cuda:
            device_sync()

    def __call__(self, k: int, null: bool) -> None:
        if len(self.staged) != k:
            raise ValueError(f"{len(self.staged)} calls are staged, not {k}")
        snaps = self.snaps[null]
        for i in range(k):
            if self.flush is not None:
                self.flush.copy_(self.zero)
            out = self.last if null and self.last is not None else self.fn(*self.staged[i])
            items = list(out) if isinstance(out, (tuple, list)) else [out]
            while len(snaps) <= i:
                snaps.append([torch.empty_like(t) for t in items])
            # Not strict: the snapshots follow the first call's outputs; a candidate may return fewer later.
            for snap, t in zip(snaps[i], items, strict=False):
                snap.copy_(t)
            self.last = out
        if self.cuda:
            device_sync()


# The verifier measures a trip's round trip from one of its threads. When the reply arrives, that
# thread must take the GIL back from whichever thread took it while it waited, and CPython hands the
# GIL over only every switch interval (5 ms by default): a busy verifier would add up to 5 ms to a
# trip but rarely to its null trip. While any timed window is open the interval is this short, so the
# thread gets the GIL back within microseconds.
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
