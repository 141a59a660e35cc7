"""A modelled verification latency, for benchmarks on a machine without a GPU (`verifier.modelled_latency`,
used by `kiln bench`; off by default).

On the GPU machine a verification is a compile followed by GPU-side work: correctness trials,
legality checks under the runtime gate, and timing that holds the GPU exclusively. On a CPU machine
that second part takes milliseconds, so a benchmark of the loop there would see verifiers that are
never slow. `ModelledLatency` draws a stand-in duration for it, log-normal (a long tail: with σ = 1,
one verification in ten takes 3.6× the median, one in a hundred 10×), capped at `max_s`. The
verifier actor sleeps that long after the real verification, holding its worker slot as the GPU
work would, and records it in the verification's timeline span.
"""

from __future__ import annotations

import math
import random

from configs import ModelledLatencyConfig


class ModelledLatency:
    def __init__(self, cfg: ModelledLatencyConfig, rank: int = 0) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed + rank)

    @property
    def on(self) -> bool:
        return self.cfg.median_s > 0

    def draw(self) -> float:
        """Seconds of modelled GPU-side work for one verification (0 when off)."""
        if not self.on:
            return 0.0
        return min(self.cfg.median_s * math.exp(self.cfg.sigma * self.rng.gauss(0.0, 1.0)), self.cfg.max_s)
