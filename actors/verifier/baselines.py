"""Reference timings (eager PyTorch and torch.compile) that speedups are measured against.

Measured in the trusted process with the same `Clock` and the same input sets as the candidate, under
the exclusive device lease, once per (task, shapes, device) and then reused by every candidate of the
task. torch.compile's own compilation (seconds to a minute) happens outside the exclusive window.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading

import torch

from actors.verifier import timing
from actors.verifier.lease import DeviceLease
from actors.verifier.reference import Reference, ShapeConfig, Trial
from configs import VerifierConfig

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

    def measure(self, ref: Reference, config: ShapeConfig, sets: list[Trial],
                model: torch.nn.Module) -> tuple[float, float | None]:
        """(eager seconds, torch.compile seconds or None) for the reference at `config`'s shapes."""
        key = (ref.task_id, ref.hash, tuple(sorted(config.overrides.items())), self.device)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._cache:
                self._cache[key] = self._measure(key, model, sets)
            return self._cache[key]

    def note(self, ref: Reference, config: ShapeConfig) -> str:
        return self.notes.get((ref.task_id, ref.hash, tuple(sorted(config.overrides.items())), self.device), "")

    def _measure(self, key: tuple, model: torch.nn.Module, sets: list[Trial]) -> tuple[float, float | None]:
        feeds = [[x.to(self.device) if isinstance(x, torch.Tensor) else x for x in s.inputs] for s in sets]
        eager = self._time(model, feeds)
        compiled_s = None
        if self.wants_compile():
            try:
                compiled = torch.compile(model)
                with self.lease.shared(), torch.no_grad():
                    for feed in feeds:  # compile (and recompile per input set) outside the timed window
                        compiled(*feed)
                compiled_s = self._time(compiled, feeds)
            except Exception as err:  # inductor missing a compiler, an unsupported op, ...
                self.notes[key] = f"torch.compile baseline unavailable: {type(err).__name__}: {str(err)[:200]}"
                log.warning("verifier: %s", self.notes[key])
        return eager, compiled_s

    def _time(self, fn, feeds: list[list]) -> float:
        """Median seconds of `fn`, fed exactly like the candidate's timed runs (see InputFeeder)."""
        feeder = timing.InputFeeder(feeds, run_order(self.cfg.repeats))
        with self.lease.exclusive(), torch.no_grad(), timing.cpu_threads(self.device_type):
            if self._clock is None:
                self._clock = timing.Clock(self.device_type)
            times = timing.run_series(self._clock, lambda i: fn(*feeder.feed), warmup=self.cfg.warmup,
                                      repeats=self.cfg.repeats, budget_s=20.0, before=feeder.before)
        return timing.median(times)


def run_order(repeats: int) -> list[int]:
    """Which of two input sets each timed run uses: both early, then an unpredictable mix."""
    rng = random.Random(secrets.randbits(64))
    head = [0, 1] if rng.random() < 0.5 else [1, 0]
    return head + [rng.randrange(2) for _ in range(max(repeats - 2, 0))]
