"""The stall watchdog: when the learner makes no step for far longer than its steps take, say in one line
which side waits for what, from the actors' health records alone.

`StallWatch` decides when (a pure clock rule, the clock passed in): no step for `factor` × the
median of the recent step intervals, or, before two steps exist, for `first_step_s`; once per stall
(a new step re-arms it). `diagnose` reads the records and names the stuck stage, in the order the
work flows backwards from the learner:

1. the learner does not answer, or has not asked for a batch since its last step (it is stepping,
   pushing weights, or waiting for the engines' confirmations);
2. it waits for a batch, and replay has fewer trainable groups than a batch takes, because
   - replay admits no new group (the staleness window is full) while its running groups are held by
     rollout actors with nothing in flight (an earlier session's, or a dead actor's), or
   - the rollout side is waiting: for verdicts (attempts at the verifiers), for weights, or for tasks.
The session logs the line and writes every record to RUN_DIR/logs/stall-NNN.json.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from actors.buffer.health import ReplayHealth
from actors.learner.health import LearnerHealth
from actors.rollout.health import RolloutHealth
from actors.verifier.health import VerifierHealth

RECENT_STEPS = 8  # the step intervals the expected interval is the median of
# A stall is never shorter than this: with steps a fraction of a second apart (the CPU examples), a
# restart's few seconds are recovery, not a stall.
MIN_STALL_S = 30.0


@dataclass
class StallWatch:
    factor: float  # a stall: no step for factor × the median recent step interval
    first_step_s: float  # ... or, before two steps exist, for this long since the rollouts started
    since: float  # monotonic: when the run could first step (its rollouts started)
    steps: list[float] = field(default_factory=list)  # monotonic times of the recent steps
    reported: bool = False  # this stall was reported (a new step re-arms)

    def step(self, now: float) -> None:
        self.steps = [*self.steps[-RECENT_STEPS:], now]
        self.reported = False

    def limit_s(self) -> float:
        """How long without a step is a stall now."""
        if len(self.steps) < 2:
            return self.first_step_s
        intervals = [b - a for a, b in zip(self.steps, self.steps[1:], strict=False)]
        return max(self.factor * statistics.median(intervals), MIN_STALL_S)

    def due(self, now: float) -> bool:
        """True once per stall, when it passes the limit."""
        last = self.steps[-1] if self.steps else self.since
        if self.reported or now - last < self.limit_s():
            return False
        self.reported = True
        return True


@dataclass(frozen=True)
class Readings:
    """The actors' health records at the stall (None: the actor did not answer)."""

    learner: LearnerHealth | None
    replay: ReplayHealth | None
    rollouts: dict[str, RolloutHealth | None]
    verifiers: dict[str, VerifierHealth | None]
    batch_groups: int
    learner_asking: bool  # the learner asked replay for a batch since its last step (its batch_waits grew)


def diagnose(r: Readings, stalled_s: float) -> str:
    """One line: who waits for what."""
    head = f"no learner step for {stalled_s:.0f} s: "
    if r.learner is None:
        return head + "the learner does not answer its health call (busy in a long call, or hung)"
    if r.replay is None:
        return head + f"the learner waits for a batch at version {r.learner.version}; replay does not answer"
    v, replay = r.learner.version, r.replay
    if not r.learner_asking:
        return head + (
            f"the learner has not asked for a batch since its last step: it is inside a step, a weight push "
            f"or (η = 0) waiting for the engines to confirm version {v}"
        )
    waiting = (
        f"the learner waits for a batch at version {v}: replay has {replay.groups.ready} of the "
        f"{r.batch_groups} trainable groups a batch takes"
    )
    silent = [n for n, h in r.rollouts.items() if h is None]
    idle = sorted(n for n, h in r.rollouts.items() if h is not None and h.inflight == 0)
    admission = replay.admission
    if admission.full:
        held = replay.groups.running
        why = (
            f"replay admits no new group (the staleness window is full: {admission.running} of {admission.window} "
            f"running, {admission.admitted} groups of the bound's {admission.limit} admitted)"
        )
        if held and len(idle) == len(r.rollouts):
            return head + (
                f"{waiting}; {why}, and its {held} running group(s) are held while no rollout actor has an "
                "attempt in flight (groups of a dead actor or an earlier session: they expire after "
                "replay.group_timeout_s)"
            )
        return head + f"{waiting}; {why}, with {held} group(s) still running"
    if silent:
        return head + f"{waiting}; rollout actor(s) {', '.join(silent)} do not answer"
    at_verifiers = sum(max(h.received - h.replied, 0) for h in r.verifiers.values() if h is not None)
    inflight = sum(h.inflight for h in r.rollouts.values() if h is not None)
    if inflight and at_verifiers:
        return head + (
            f"{waiting}; the rollout actors wait for verdicts: {at_verifiers} of their {inflight} attempts in "
            "flight are at the verifiers"
        )
    behind = [
        f"{n} serves version {h.weights.version}"
        for n, h in r.rollouts.items()
        if h is not None and h.weights is not None and h.weights.version is not None and h.weights.version < v
    ]
    if behind:
        return head + f"{waiting}; the engines wait for weights: {', '.join(behind)}"
    if inflight:
        return head + f"{waiting}; {inflight} attempt(s) are generating"
    return head + f"{waiting}; no rollout actor has an attempt in flight and replay admits more (task requests fail?)"
