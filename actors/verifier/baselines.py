"""Reference timings (eager PyTorch and torch.compile) that speedups are measured against.

Measured in the trusted process with the same `Clock` as the candidate and fed the same way: every
timed call gets a fresh draw of `get_inputs()`, copied into fixed buffers (the same addresses every
call) outside the timed window, under the exclusive device lease; once per (task, shapes, device),
then reused by every candidate of the task. torch.compile's own compilation (seconds to a minute)
happens outside the exclusive window.
"""

from __future__ import annotations

import logging
import threading

import torch

from actors.verifier import timing
from actors.verifier.reference import Instance, Reference, ShapeConfig
from configs import VerifierConfig
from protocols.lease import DeviceLease

log = logging.getLogger(__name__)


class Baselines:
    def __init__(self, cfg: VerifierConfig, device: str, lease: DeviceLease) -> None:
        self.cfg = cfg
        self.device = device
        self.device_type = "cuda" if device.startswith("cuda") else "cpu"
        self.lease = lease
        self._clock: timing.Clock | None = None
        self._cache: dict[tuple, tuple[float, float | None]] = {}
        self._locks: dict[tuple, threading.Lock] = {}
        self._guard = threading.Lock()
        self.notes: dict[tuple, str] = {}

    def wants_compile(self) -> bool:
        mode = self.cfg.compile_baseline
        return self.cfg.reward.baseline == "compile" or mode == "always" or (mode == "auto" and self.device_type == "cuda")

    def _key(self, ref: Reference, config: ShapeConfig) -> tuple:
        return ref.task_id, ref.hash, tuple(sorted(config.overrides.items())), self.device

    def measure(self, ref: Reference, instance: Instance, runs: int) -> tuple[float, float | None]:
        """(eager seconds, torch.compile seconds or None) for the reference at `instance`'s shapes."""
        key = self._key(ref, instance.config)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._cache:
                self._cache[key] = self._measure(key, ref, instance, runs)
            return self._cache[key]

    def note(self, ref: Reference, config: ShapeConfig) -> str:
        return self.notes.get(self._key(ref, config), "")

    def _measure(self, key: tuple, ref: Reference, instance: Instance, runs: int) -> tuple[float, float | None]:
        with self.lease.shared():
            sets = [ref.fresh_inputs(instance) for _ in range(runs + self.cfg.warmup)]
        eager = self._time(instance.model, sets)
        compiled_s = None
        if self.wants_compile():
            try:
                compiled = torch.compile(instance.model)
                with self.lease.shared(), torch.no_grad():
                    compiled(*ref.to_device(sets[0]))  # compile outside the timed window
                compiled_s = self._time(compiled, sets)
            except Exception as err:  # inductor missing a compiler, an unsupported op, ...
                self.notes[key] = f"torch.compile baseline unavailable: {type(err).__name__}: {str(err)[:200]}"
                log.warning("verifier: %s", self.notes[key])
        return eager, compiled_s

    def _time(self, fn, sets: list[list]) -> float:
        """Median seconds of `fn`, fed exactly like the candidate's timed runs."""
        feed = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in sets[0]]
        times = []
        with self.lease.exclusive(), torch.no_grad(), timing.cpu_threads(self.device_type):
            if self._clock is None:
                self._clock = timing.Clock(self.device_type)
            for i, inputs in enumerate(sets):
                for buf, src in zip(feed, inputs):
                    if isinstance(buf, torch.Tensor):
                        buf.copy_(src)
                self._clock.prepare()
                _, seconds = self._clock.measure(lambda: fn(*feed))
                if i >= self.cfg.warmup:
                    times.append(seconds)
        return timing.median(times)
