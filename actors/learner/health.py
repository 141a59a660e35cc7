"""The learner's health record and the report of its warm start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.base import ActorHealth
from protocols import metric_keys as mk


@dataclass(frozen=True)
class WarmStartReport:
    """What a fresh learner's warm start did (none when `warm_start.steps` is 0 or no solution fit)."""

    steps: int
    solutions: int  # (task, solution) pairs in its batches
    first_loss: float
    final_loss: float
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The run's `sft/` metrics row."""
        return {
            mk.SFT_FIRST_LOSS: self.first_loss,
            mk.SFT_FINAL_LOSS: self.final_loss,
            mk.SFT_STEPS: float(self.steps),
            mk.SFT_SECONDS: self.seconds,
        }


@dataclass(frozen=True, kw_only=True)
class LearnerHealth(ActorHealth):
    learner_id: str = ""
    rank: int = 0
    version: int = 0  # the weight version it serves
    step: int = 0  # optimizer steps taken (RL), across restores
    discarded_above: int = -1  # a restore rolled back (discarded_above, version), until replay has the range
    steps: int = 0  # steps taken by this process (a follower counts its leader's)
    batch_waits: int = 0
    replay_timeouts: int = 0
    checkpoints: int = 0
    push_s: float = 0.0  # the last weight publish
    restored_from: int = -1  # the checkpoint version it restored; -1 = none
    rolled_back: int = 0  # versions its restore found lost (announced after that checkpoint): filtered, redone
    warm_start: WarmStartReport | None = None
    start_phases: dict[str, float] = field(
        default_factory=dict
    )  # seconds of each phase of start(): build, restore, serve
    weights: dict[str, Any] = field(default_factory=dict)  # the weight server's report (transport, engines, last push)
