"""Reference timings (eager PyTorch and torch.compile) that speedups are measured against.

Measured in the verifier's own process, which never loads candidate code, by the same protocol as
the candidate (timing.py): paired trips of K calls on fresh draws of `get_inputs()`, each call timed
by the same CallClock (flush, events, idle device) and its outputs snapshotted, the trusted trip
minus null trip alongside; under the exclusive device lease;
once per (task, shapes, device), then reused by every candidate of the task. torch.compile's own
compilation (seconds to a minute) happens outside the exclusive window.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from actors.verifier import timing
from actors.verifier.reference import Instance, Reference, ShapeConfig
from configs import VerifierConfig
from protocols.lease import DeviceLease

# Seconds a baseline's pairs may take once MIN_RUNS are done (a slow reference times fewer pairs).
BASELINE_BUDGET_S = 10.0

log = logging.getLogger(__name__)


class Baselines:
    def __init__(self, cfg: VerifierConfig, device: str, lease: DeviceLease) -> None:
        self.cfg = cfg
        self.device = device
        self.device_type = "cuda" if device.startswith("cuda") else "cpu"
        self.lease = lease
        self._cache: dict[tuple, tuple[timing.TripTimes, timing.TripTimes | None]] = {}
        self._locks: dict[tuple, threading.Lock] = {}
        self._guard = threading.Lock()
        self.notes: dict[tuple, str] = {}

    def wants_compile(self) -> bool:
        mode = self.cfg.compile_baseline
        return (
            self.cfg.reward.baseline == "compile" or mode == "always" or (mode == "auto" and self.device_type == "cuda")
        )

    def _key(self, ref: Reference, config: ShapeConfig) -> tuple:
        return ref.task_id, ref.hash, tuple(sorted(config.overrides.items())), self.device

    def measure(
        self, ref: Reference, instance: Instance, pairs: int
    ) -> tuple[timing.TripTimes, timing.TripTimes | None]:
        """(eager, torch.compile or None) per-call times of the reference at `instance`'s shapes."""
        key = self._key(ref, instance.config)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._cache:
                self._cache[key] = self._measure(key, ref, instance, pairs)
            return self._cache[key]

    def note(self, ref: Reference, config: ShapeConfig) -> str:
        return self.notes.get(self._key(ref, config), "")

    def _measure(self, key: tuple, ref: Reference, instance: Instance, pairs: int):
        sets = self._inputs(ref, instance)
        eager = self._time(instance.model, sets, pairs)
        compiled = None
        if self.wants_compile():
            try:
                fn = torch.compile(instance.model)
                with self.lease.shared(), torch.no_grad():
                    fn(*ref.to_device(sets[0]))  # compile outside the timed window
                compiled = self._time(fn, sets, pairs)
            except Exception as err:  # noqa: BLE001 - inductor missing a compiler, an unsupported op, ...
                self.notes[key] = f"torch.compile baseline unavailable: {type(err).__name__}: {str(err)[:200]}"
                log.warning("verifier: %s", self.notes[key])
        return eager, compiled

    def _inputs(self, ref: Reference, instance: Instance) -> list[list]:
        """Fresh draws for the trips (as many as a trip of the largest K uses, within the budget)."""
        first = ref.fresh_inputs(instance)
        nbytes = max(sum(x.numel() * x.element_size() for x in first if isinstance(x, torch.Tensor)), 1)
        count = max(2, min(timing.MAX_CALLS_PER_TRIP, (1 << 30) // nbytes))
        with self.lease.shared():
            return [first] + [ref.fresh_inputs(instance) for _ in range(count - 1)]

    def _time(self, fn, sets: list[list], pairs: int) -> timing.TripTimes:
        """Per-call times of `fn` by the candidate's protocol: warm-up pairs that choose K, then `pairs`
        paired trips."""
        trips = timing.LocalTrips(fn, sets, self.device)
        with torch.no_grad(), timing.cpu_threads(self.device_type):
            k0 = max(1, min(4, len(sets)))
            with self.lease.shared():
                trips.stage(k0)
            with self.lease.exclusive(), timing.responsive_gil():
                k = timing.choose_k(trips, self.device_type, len(sets), self.cfg.warmup)
            times = timing.TripTimes(k, self.device_type)
            started, i = time.perf_counter(), -1
            while timing.want_more(times, pairs, time.perf_counter() - started, BASELINE_BUDGET_S):
                i += 1
                trips.sets = sets[(i * k) % len(sets) :] + sets[: (i * k) % len(sets)]  # fresh draws where there are
                with self.lease.shared():
                    trips.stage(k)
                with self.lease.exclusive(), timing.responsive_gil():
                    timing.record(times, *timing.time_pair(trips, k, i))
        return times
