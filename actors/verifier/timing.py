"""The timing protocol (one harness for the candidate and the baselines) and the plausibility bound.

One call is timed the way KernelBench times it: on cuda, an L2 flush (a memset of FLUSH_BYTES on the
caller's stream), an event, the forward, an event, then wait until the whole device is idle; on cpu
the monotonic clock around the forward. The flush, the events and the wait are `kiln_native.CallClock`
(native/kiln_clock.h): calls into the CUDA driver, no ATen operator, nothing the candidate's code can
patch or re-register. That per-call figure is what KernelBench's method measures, and it is what the
figure paid is made of: the mean over every timed call, the median recorded beside it.

A figure from a process that loaded candidate code is not trusted alone. The unit of work is a
*trip*: K calls, each on its own fresh inputs already on the device, each call's outputs copied to a
snapshot. A *null trip* does the same work without the forward. The verifier times a trip and its
null trip back to back around the requests, with its own clock (alternating which goes first), so

    trusted = mean of two medians of (trip - null trip) / K: over the pairs whose run trip went
              first, and over those whose null trip went first

is what one call costs by a clock the candidate cannot touch: the round trip, the staging, the
flushes, the events and the snapshots cancel, and K amortises the noise left. The two medians are
there because whichever trip of a pair goes first reads slow by about a constant (on an H200, an
rmsnorm candidate at 5 calls a trip read 57-86 us a call in its run-first pairs and 35-64 us in its
null-first ones, against 60 us by events): the alternation cancels that only where both orders
weigh the same. A median over all pairs took a run-first pair's figure whenever they were the more
(3 pairs: 2 and 1), and overcharged a 73 us softmax by 15%.

A trip follows a gap (the staging, the round trip, the check), and after a gap the device and the
host are not as KernelBench's loop keeps them: an idle GPU drops its clocks within milliseconds, and
the host's launch path goes cold. So the first calls of a trip read slow, in the sandbox and in the
baseline process alike (measured: on one H100 a 50 us relu's first call read 126-131 us after a
50 ms gap). Every trip, and its null trip alike, therefore starts with a preroll (PREROLL_S;
CallClock.preroll): flushes, each waited for, then HEAD_START_S of flushes left running ahead of the
first call's own, so that the first call starts as a call in the loop does. A baseline's trip also
makes BASELINE_WARM_CALLS untimed calls (trusted code only; docs/verifier.md). It runs no candidate code and is the same in both
trips, so it cancels in the trusted figure. The first call's per-call figure is recorded apart as
well (`first_calls`, the diagnostics' `first_call_mean_s`) and stays in the mean. Dropping it, as
KernelBench drops its first trial, would leave the bound comparing unlike things: the trusted figure
cannot drop it (the null trip runs no candidate code, by design, so nothing cancels the candidate's
cold call), and a margin wide enough for the gap is a margin a forger could use. K, chosen by what
the forward adds to a trip, dilutes what the preroll leaves. The figure paid is

    paid = max(per-call mean, trusted - margin)
    margin = max(BOUND_REL x trusted, BOUND_ABS_S, 2 standard errors of trusted)

so a forged per-call clock buys at most the margin, and so does work the per-call clock cannot see
(a stream the events do not wait for): the trusted clock pays it, less the margin. There is no cliff
at the bound: an honest call just past it (at a few microseconds, where the host's part of a call
that the flush hides from the events is about the margin) pays the bound, not the whole trusted
figure. Pairs are added until the trusted figure
is that sharp (within a budget). The candidate's trips run in its
sandbox; the baselines' trips run in the verifier (`LocalTrips`, the same CallClock, the same steps
in the same order), which never loads candidate code.

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

from actors.verifier import native

MIN_RUNS = 3
# On the cpu backend both sides are timed on one intra-op thread: CPU timing shares the host with
# compiles and other sandboxes, and a spinning OpenMP team on an oversubscribed host turns a
# microsecond op into milliseconds. One thread measures the kernels, not the scheduler.
CPU_TIMING_THREADS = 1
# How much forward time one trip should hold: enough that the round trip's noise (tens of
# microseconds on a loaded host) is a small part of it, little enough that a round of trips stays cheap.
TRIP_TARGET_S = {"cpu": 4e-3, "cuda": 4e-3}
MAX_CALLS_PER_TRIP = 64
# Every trip, and its null trip alike, starts with a preroll (CallClock.preroll): on cuda this long of
# flushes, each waited for, then one left running ahead of the first call. A trip follows a gap
# (staging, the round trip, the check) in which an idle GPU drops its clocks (an H100 idles at 345 of
# 1,980 MHz) and the host's launch path goes cold; KernelBench's loop never idles. Measured on one
# H100 (docs/BENCHMARKS.md): after a 50 ms gap a 50 us relu's first call read 126-131 us, and a
# trip of five read 1.32x the loop's mean; after 5 ms of preroll, 1.00x. On cpu the preroll is a spin
# and none is taken: a sandbox that spun instead of sleeping between requests did not change its first
# calls (their cold path is the candidate's own code), and on a 2-core host a spinning sandbox takes
# the core the verifier's clock needs.
PREROLL_S = {"cpu": 0.0, "cuda": 5e-3}
# ...and the device time of flushes it leaves running ahead of the first call's own: the first launch
# of a trip is colder than the loop's (one H200: a 68 us relu candidate's first call read 8-40 us
# slow behind one 55 us flush), so it gets a longer run-up than one flush.
HEAD_START_S = {"cpu": 0.0, "cuda": 250e-6}
# After its preroll a baseline's trip (run and null alike) makes this many untimed calls: the host's
# launch path of a reference of several operators goes cold between trips (one H100: eager rmsnorm's
# first call read 369 us against a 166 us median), and KernelBench's loop keeps it warm. Only the
# baseline may: it is trusted code, while a candidate's untimed call could compute the trip's
# outputs ahead of its timed calls. A candidate's own launch path is hidden instead by the flush
# the preroll leaves running.
BASELINE_WARM_CALLS = {"cpu": 0, "cuda": 1}
# KernelBench flushes L2 with a 256 MB fill before every call; the same size here (at least four times
# the L2 of larger caches), so a call starts as cold, and the flush hides as much of the launch.
FLUSH_MIN_BYTES = 256 << 20
# The per-call mean may sit this far below the trusted figure before the trusted figure pays
# instead: relative, absolute (the two clocks' own disagreement on an honest call: a microsecond or
# two of event and wake-up latency on cuda, a few of the interpreter's on cpu), or RESOLVED_SEMS
# standard errors of the trusted figure, whichever is largest. Pairs are added (up to EXTRA_PAIRS x
# the configured number, within a time budget) until the trusted figure resolves the mean that finely.
BOUND_REL = 0.10
# The standard error of a median of n normal draws is 1.2533 sigma / sqrt(n), and sigma is 1.4826
# median absolute deviations: so 1.858 MADs / sqrt(n).
MEDIAN_SE_PER_MAD = 1.2533 * 1.4826
BOUND_ABS_S = {"cpu": 10e-6, "cuda": 2e-6}
RESOLVED_SEMS = 2.0
EXTRA_PAIRS = 4
device_sync = getattr(torch._C, "_cuda_synchronize", None) or torch.cuda.synchronize


def flush_bytes(l2_bytes: int) -> int:
    """The L2 flush's size on a device with `l2_bytes` of L2."""
    return max(FLUSH_MIN_BYTES, 4 * int(l2_bytes or 0))


def call_clock(device: str, flush: torch.Tensor | None = None):
    """A CallClock for trips of up to MAX_CALLS_PER_TRIP calls on `device`'s current stream (its
    context is the one the clock keeps; kiln_native must be loaded: the zygote loads it, the verifier
    loads the one the zygote uses)."""
    kn = native.loaded()
    if not device.startswith("cuda"):
        return kn.CallClock("cpu", 0, 0, 0, 2 * MAX_CALLS_PER_TRIP)
    ptr, nbytes = (flush.data_ptr(), flush.numel()) if flush is not None else (0, 0)
    with torch.cuda.device(torch.device(device)):
        torch.cuda.current_stream().synchronize()  # makes the device's context current on this thread
        stream = torch.cuda.current_stream().cuda_stream
        return kn.CallClock("cuda", stream, ptr, nbytes, 2 * MAX_CALLS_PER_TRIP)


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


def preroll_s(device_type: str) -> float:
    return PREROLL_S.get(device_type, PREROLL_S["cpu"])


def head_start_s(device_type: str) -> float:
    return HEAD_START_S.get(device_type, HEAD_START_S["cpu"])


def median(times: list[float]) -> float:
    return statistics.median(times) if times else float("nan")


def calls_per_trip(per_call_s: float, device_type: str, most: int) -> int:
    """K for forwards that add about `per_call_s` each to a trip: TRIP_TARGET_S of them (the trip,
    with its flushes and snapshots, lasts longer), within [1, most]."""
    target = TRIP_TARGET_S.get(device_type, TRIP_TARGET_S["cpu"])
    k = math.ceil(target / max(per_call_s, 1e-7))
    return max(1, min(k, most, MAX_CALLS_PER_TRIP))


@dataclass
class TripTimes:
    """One side's timed calls: the per-call clock's figures and the verifier's trusted figure per pair."""

    calls_per_trip: int
    device_type: str = "cpu"
    # The per-call clock ran in a process that never loaded candidate code (a baseline): nothing there
    # could forge it, so its mean pays as measured and the trusted figure is a cross-check only. Below
    # about 10 us a call's host work (its launch) outlasts its device time and the trip's clock reads
    # it: one H200 read eager relu 4x2048 at 3.9 us by events, 6.1 us by trips.
    trusted_calls: bool = False
    calls: list[float] = field(default_factory=list)  # the per-call clock, every timed call
    first_calls: list[float] = field(default_factory=list)  # the per-call clock, each trip's first (also in calls)
    per_call: list[float] = field(default_factory=list)  # trusted: (trip - null trip) / K, one per pair
    run_first: list[bool] = field(default_factory=list)  # per pair: the run trip went first
    trips: list[float] = field(default_factory=list)
    nulls: list[float] = field(default_factory=list)

    @property
    def mean_s(self) -> float:
        """The per-call clock's mean (KernelBench's figure)."""
        return max(statistics.fmean(self.calls), 1e-9) if self.calls else float("nan")

    @property
    def median_s(self) -> float:
        return max(median(self.calls), 1e-9) if self.calls else float("nan")

    def _by_order(self) -> list[list[float]]:
        """The pairs' figures in two groups, run trip first and null trip first (the groups present)."""
        order = self.run_first + [True] * (len(self.per_call) - len(self.run_first))
        groups = [[x for x, first in zip(self.per_call, order, strict=True) if first is want] for want in (True, False)]
        return [g for g in groups if g]

    @property
    def trusted_s(self) -> float:
        """The verifier's own figure: the mean of the medians of (trip - null trip) / K over the pairs of
        each order (the module's docstring says why). A median because the round trip's noise has a
        long tail (a pause of a millisecond in either trip of a pair); the mean let one such pair move
        a 70 us call's figure by hundreds of microseconds, and even below zero."""
        groups = self._by_order()
        return statistics.fmean(median(g) for g in groups) if groups else float("nan")

    @property
    def sem_s(self) -> float:
        """The standard error of the trusted figure, from the pairs' median absolute deviation about
        their own order's median (the round trip's noise, over K and the pairs; a long-tailed pause
        widens it only as one pair). Two medians of n/2 pairs each, averaged, have the error of one
        median of n."""
        n = len(self.per_call)
        if n < 2:
            return float("inf")
        mad = median([abs(x - median(g)) for g in self._by_order() for x in g])
        return MEDIAN_SE_PER_MAD * mad / math.sqrt(n)

    @property
    def margin_s(self) -> float:
        """How far below the trusted figure the per-call mean may sit and still pay: BOUND_REL of it,
        BOUND_ABS_S, or RESOLVED_SEMS standard errors (the trusted clock's own resolution), whichever
        is largest."""
        sem = self.sem_s if math.isfinite(self.sem_s) else abs(self.trusted_s)
        return max(
            BOUND_REL * abs(self.trusted_s), BOUND_ABS_S.get(self.device_type, BOUND_ABS_S["cpu"]), RESOLVED_SEMS * sem
        )

    @property
    def resolved(self) -> bool:
        """The trusted figure is sharp enough to bound the per-call mean within BOUND_REL (or BOUND_ABS_S)."""
        if len(self.per_call) < MIN_RUNS:
            return False
        scale = max(abs(self.trusted_s), self.mean_s if self.calls else 0.0)
        return RESOLVED_SEMS * self.sem_s <= max(BOUND_REL * scale, BOUND_ABS_S.get(self.device_type, 0.0))

    @property
    def bounded(self) -> bool:
        """The per-call mean is within the trusted clock's bound (else the trusted figure pays)."""
        return not self.per_call or self.mean_s >= self.trusted_s - self.margin_s

    @property
    def paid_s(self) -> float:
        """The figure that pays: the per-call mean while the trusted clock bounds it (or where no
        candidate code could have touched it), else the bound (a per-call clock that claims more than
        the margin below the verifier's is believed only to the margin)."""
        if not self.calls:
            return float("nan")
        if self.bounded or self.trusted_calls:
            return self.mean_s
        return max(self.trusted_s - self.margin_s, 1e-9)

    def to_json(self) -> dict:
        return {
            "calls_per_trip": self.calls_per_trip,
            "pairs": len(self.per_call),
            "calls": len(self.calls),
            "mean_s": self.mean_s,
            "median_s": self.median_s,
            "paid_s": self.paid_s,
            "trusted_s": self.trusted_s,
            "trusted_sem_s": self.sem_s if math.isfinite(self.sem_s) else None,
            "margin_s": self.margin_s if self.per_call else None,
            "resolved": self.resolved,
            "bounded": self.bounded,
            "trusted_calls": self.trusted_calls,
            "first_call_mean_s": statistics.fmean(self.first_calls) if self.first_calls else None,
            "per_pair_s": list(self.per_call),
            "run_first": list(self.run_first),
            "trip_min_s": min(self.trips, default=None),
            "null_min_s": min(self.nulls, default=None),
        }


def time_pair(trip, k: int, index: int) -> tuple[float, float, list[float], bool]:
    """(trip seconds, null trip seconds, the trip's per-call figures, whether the run trip went first)
    by this process's clock; `trip(k, null)` runs one and returns its per-call figures (the run
    trip's). The order alternates with `index`, and the trusted figure weighs both orders alike."""
    run_first = index % 2 == 0
    order = (False, True) if run_first else (True, False)
    took, spans = {}, []
    for null in order:
        t0 = time.perf_counter()
        got = trip(k, null)
        took[null] = time.perf_counter() - t0
        if not null:
            spans = list(got or [])
    return took[False], took[True], spans, run_first


def choose_k(trip, device_type: str, most: int, warmups: int) -> int:
    """K for the timed pairs, from untimed pairs of a few calls each: what the forward adds to a trip
    (trip - null trip), the median over `warmups` pairs after a first one. The first pair is the
    first contact (lazily loaded modules, the snapshots' first buffers: milliseconds) and says nothing
    of a call; with one warm-up pair it cut K to 2 for a 70 us candidate. Nor is the round trip a
    call's cost: it is what K must amortise."""
    k0 = max(1, min(4, most))
    walls = []
    for i in range(max(warmups, 1) + 1):
        run_s, null_s, _, _ = time_pair(trip, k0, i)
        if i:
            walls.append(max(run_s - null_s, 0.0) / k0)
    return calls_per_trip(median(walls), device_type, most)


def want_more(times: TripTimes, pairs: int, elapsed_s: float, budget_s: float) -> bool:
    """Whether to time another pair: until `pairs` are done (at least MIN_RUNS), then while the
    trusted figure is not resolved, up to EXTRA_PAIRS x `pairs`; never past `budget_s` seconds once
    MIN_RUNS are done."""
    done = len(times.per_call)
    if done < MIN_RUNS:
        return True
    if elapsed_s > budget_s:
        return False
    return done < pairs or (not times.resolved and done < EXTRA_PAIRS * pairs)


def record(times: TripTimes, run_s: float, null_s: float, spans: list[float], run_first: bool = True) -> None:
    """One pair: the trusted figure from the whole trip (and which trip went first), every per-call
    figure, and the trip's first call's figure apart (the slow first call, a diagnostic)."""
    times.trips.append(run_s)
    times.nulls.append(null_s)
    times.per_call.append((run_s - null_s) / times.calls_per_trip)
    times.run_first.append(run_first)
    times.calls.extend(spans)
    times.first_calls.extend(spans[:1])


class LocalTrips:
    """Trips of the reference (eager or compiled) in this process, step for step as the sandbox runs
    the candidate's (sealed.py, op_trip): the preroll (and BASELINE_WARM_CALLS), then for each call on its own set of inputs
    already on the device, the flush, a mark, the forward, a mark, wait until the device is idle, its
    outputs copied to a snapshot; on cpu the outputs kept until the next trip's same call and the inputs
    until the stage after the next, as the sandbox keeps them. `sets` are the calls' inputs; `stage(k)`
    puts the first k on the device, untimed."""

    def __init__(self, fn, sets: list[list], device: str) -> None:
        self.fn = fn
        self.sets = sets
        self.device = device
        self.cuda = device.startswith("cuda")
        self.staged: list[list] = []
        self.previous_staged: list[list] | None = None
        self.last = None
        self.held: list = []
        self.snaps: dict[bool, list[list[torch.Tensor]]] = {False: [], True: []}
        self.flush = None
        if self.cuda:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            self.flush = torch.empty(flush_bytes(getattr(props, "L2_cache_size", 0)), dtype=torch.uint8, device=device)
        self.clock = None

    def stage(self, k: int) -> None:
        self.previous_staged = None  # the last trip's inputs are kept through the next, as the sandbox's are
        self.previous_staged, self.staged = (
            self.staged if not self.cuda else None,
            [
                [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in self.sets[i % len(self.sets)]]
                for i in range(k)
            ],
        )
        if self.cuda:
            device_sync()

    def _scratch(self, i: int) -> list:
        bufs = getattr(self, "_bufs", None)
        want = [(x.shape, x.dtype) if isinstance(x, torch.Tensor) else None for x in self.staged[i]]
        if bufs is None or [(b.shape, b.dtype) if b is not None else None for b in bufs] != want:
            bufs = self._bufs = [torch.empty_like(x) if isinstance(x, torch.Tensor) else None for x in self.staged[i]]
        return bufs

    def __call__(self, k: int, null: bool) -> list[float]:
        if len(self.staged) != k:
            raise ValueError(f"{len(self.staged)} calls are staged, not {k}")
        if self.clock is None:  # made on the thread that times (its stream and context)
            self.clock = call_clock(self.device, self.flush)
        clock, snaps = self.clock, self.snaps[null]
        device_type = "cuda" if self.cuda else "cpu"
        clock.preroll(preroll_s(device_type), head_start_s(device_type))
        for _ in range(BASELINE_WARM_CALLS[device_type] if k else 0):
            self.fn(*self.staged[0])
            clock.idle()
        for i in range(k):
            clock.flush()
            if not self.cuda:  # on cpu the call finds its inputs in cache (sealed.py, _warmer)
                for x, buf in zip(self.staged[i], self._scratch(i), strict=True):
                    if buf is not None:
                        buf.copy_(x)
            clock.mark(2 * i)
            out = self.last if null and self.last is not None else self.fn(*self.staged[i])
            clock.mark(2 * i + 1)
            clock.idle()
            items = list(out) if isinstance(out, (tuple, list)) else [out]
            while len(snaps) <= i:
                snaps.append([torch.empty_like(t) for t in items])
            # Not strict: the snapshots follow the first call's outputs; a candidate may return fewer later.
            for snap, t in zip(snaps[i], items, strict=False):
                snap.copy_(t)
            self.last = out
            if not null and not self.cuda:
                if i < len(self.held):
                    self.held[i] = out
                else:
                    self.held.append(out)
        if self.cuda:
            device_sync()
        return [] if null else clock.spans(k)


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
