"""Rollout-side progress, with or without learner steps, and the warning when a run cannot learn.

A run whose groups all tie at one reward never gets a batch: dynamic sampling filters every group
(`algo.drop_tied_groups`), the learner waits, and per-step metrics never come. So every
`logging.rollout_every_s` the driver writes a progress row of its own (`progress/*` keys) from
replay's health, which sees every episode, and from the rollouts' group reports:

* `progress/groups`, `progress/episodes`: groups completed and episodes emitted, run totals;
* `progress/filtered/<reason>`: groups filtered (tied, stale, infra, discarded, ...), run totals;
* `progress/trainable`: groups that went, or wait to go, into a batch, run total;
* `progress/pass_rate`, `progress/verdict/<outcome>`: the attempts verified since the last row, by
  outcome (passed, or the error class of the failure);
* `progress/decoded_tokens_per_s`: tokens the engines sampled since the last row, per second;
* `progress/retry_buffer`: the Buffered-Dynamic-Retry buffer's size.

`NoProgressCheck` watches for the two ways a run stalls, and answers one line that says why and what
helps: the last K groups (`logging.no_progress_groups`) all tied, or no group became trainable for
`logging.no_progress_s` while the admission bound did not hold the rollouts back. Both classes are
pure: the caller passes the clock and the readings.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from actors.buffer.health import ReplayHealth
from launch.driver.monitor import GroupOutcome, Window
from launch.observe.words import plural
from protocols import metric_keys as mk

# Why every attempt failed, by outcome (the verifier's error class), in the user's terms.
FAILURE_STORIES = {
    "extract": "the model never writes a fenced code block with a ModelNew class",
    "compile": "no attempt compiles",
    "runtime": "every attempt crashes when it runs",
    "timeout": "every attempt runs past verifier.run_timeout_s",
    "correctness": "no attempt computes the reference's result",
    "cheating": "every attempt falls back to PyTorch or otherwise breaks the legality rules",
    "infra": "the verifier itself fails (infra), not the attempts",
}
REMEDIES = (
    "a warm start (warm_start.steps > 0, or a checkpoint trained with `kiln sft`), easier or synthesized "
    "tasks (replay.tasks, `kiln tasks synth`), a share of forced candidates (rollout.forced_candidates "
    "with rollout.forced_fraction < 1), more turns (rollout.max_turns)"
)


@dataclass(frozen=True)
class ReplayCounts:
    """What the progress rows and the no-progress check read from replay's health."""

    groups: int  # complete: trained, ready or filtered
    episodes: int  # emitted
    trainable: int  # trained or ready to train
    filtered: dict[str, int] = field(default_factory=dict)  # groups by reason
    retry_buffer: int = 0
    held_back: bool = False  # the admission bound is reached: the rollouts wait for the learner

    @classmethod
    def of(cls, h: ReplayHealth) -> ReplayCounts:
        g = h.groups
        return cls(
            groups=g.settled,
            episodes=h.emitted,
            trainable=g.trained + g.ready,
            filtered=dict(g.filtered),
            retry_buffer=h.retry.size,
            held_back=h.admission.full,
        )


class ProgressRows:
    """One `progress/*` row every `every_s` seconds of the clock the caller passes."""

    def __init__(self, every_s: float, started: float) -> None:
        self.every_s, self.started = every_s, started
        self._last = started
        self._decoded: int | None = None

    def due(self, now: float) -> bool:
        return now - self._last >= self.every_s

    def row(
        self, now: float, counts: ReplayCounts | None, window: Window, decoded_tokens: int | None
    ) -> dict[str, float]:
        """The row at `now`: replay's totals (when it answered), the window's attempts, and the decoded
        tokens per second since the last row (`decoded_tokens`: the engines' running total)."""
        seconds = max(now - self._last, 1e-9)
        values = {mk.PROGRESS_ELAPSED_S: now - self.started}
        if counts is not None:
            values.update(
                {
                    mk.PROGRESS_GROUPS: float(counts.groups),
                    mk.PROGRESS_EPISODES: float(counts.episodes),
                    mk.PROGRESS_TRAINABLE: float(counts.trainable),
                    mk.PROGRESS_RETRY_BUFFER: float(counts.retry_buffer),
                }
            )
            values.update({mk.progress_filtered(reason): float(n) for reason, n in counts.filtered.items()})
        verified = sum(window.outcomes().values())
        if verified:
            values[mk.PROGRESS_PASS_RATE] = window.outcomes()["passed"] / verified
            values.update({mk.progress_verdict(o): float(n) for o, n in window.outcomes().items() if n})
        if decoded_tokens is not None:
            # forced answers are scored, not sampled: a run that never decoded shows no rate (not a rate of 0)
            if self._decoded is not None and decoded_tokens > 0:
                values[mk.PROGRESS_DECODED_TOKENS_PER_S] = max(decoded_tokens - self._decoded, 0) / seconds
            self._decoded = decoded_tokens
        self._last = now
        return values


class NoProgressCheck:
    """`check(...)` answers the warning line while the run makes no progress, else None."""

    def __init__(self, groups: int, stall_s: float, started: float) -> None:
        self.groups, self.stall_s = groups, stall_s
        self._trainable: int | None = None
        self._moved_at = started  # the last time a group became trainable (or the rollouts were held back)

    def check(
        self, now: float, recent: Sequence[GroupOutcome], counts: ReplayCounts | None, last_step_at: float | None
    ) -> str | None:
        if last_step_at is not None:
            self._moved_at = max(self._moved_at, last_step_at)
        if counts is not None:
            if counts.held_back or (self._trainable is not None and counts.trainable > self._trainable):
                self._moved_at = now
            self._trainable = counts.trainable
        if len(recent) >= self.groups and all(g.tied for g in list(recent)[-self.groups :]):
            return tie_warning(list(recent)[-self.groups :])
        if now - self._moved_at >= self.stall_s:
            return stall_warning(now - self._moved_at, list(recent), counts)
        return None


def tie_warning(groups: Sequence[GroupOutcome]) -> str:
    rewards = sorted({round(g.reward, 4) for g in groups if g.reward is not None})
    at = (
        f"at reward {rewards[0]:+.2f}"
        if len(rewards) == 1
        else "(each at its own reward: " + ", ".join(f"{r:+.2f}" for r in rewards[:4]) + ")"
    )
    return (
        f"no progress: the last {plural(len(groups), 'group')} all tied {at}, so dynamic sampling filters every group "
        f"and the learner gets no batch; {outcome_story(groups)}. What helps: {REMEDIES}."
    )


def stall_warning(seconds: float, groups: Sequence[GroupOutcome], counts: ReplayCounts | None) -> str:
    why = ""
    if counts is not None and counts.filtered:
        why = " (groups filtered so far: " + ", ".join(f"{n} {r}" for r, n in sorted(counts.filtered.items())) + ")"
    story = f"; {outcome_story(groups)}" if groups else "; no group has finished yet"
    return f"no progress: no group became trainable for {seconds:.0f} s{why}{story}. What helps: {REMEDIES}."


def outcome_story(groups: Sequence[GroupOutcome]) -> str:
    """How the groups' attempts ended, in one clause: 'every attempt fails at extract: ...' when one
    outcome covers them all, else the mix by share."""
    outcomes: collections.Counter = collections.Counter()
    stages: collections.Counter = collections.Counter()
    for g in groups:
        outcomes.update(g.outcomes)
        stages.update(g.stages)
    total = sum(outcomes.values())
    if not total:
        return "no attempt was verified"
    if outcomes.get("passed", 0) == total:
        return (
            "every attempt passes with the same score: the tasks are too easy to tell attempts apart "
            "(harder tasks, or the speedup term verifier.reward.lam, separate them)"
        )
    top, n = outcomes.most_common(1)[0]
    if n == total:
        stage = stages.most_common(1)[0][0] if stages else top
        return f"every attempt fails at {stage}: {FAILURE_STORIES.get(top, f'error class {top}')}"
    mix = ", ".join(f"{o} {c / total:.0%}" for o, c in outcomes.most_common())
    return f"the attempts end: {mix}"


class Warnings:
    """The no-progress warning as the log sees it: logged when it starts (or changes its first clause)
    and again every `repeat_s` while it lasts; every distinct one kept for the summary and the report."""

    def __init__(self, repeat_s: float) -> None:
        self.repeat_s = repeat_s
        self.current: str | None = None
        self.seen: list[str] = []
        self._logged_at = 0.0

    def update(self, warning: str | None, now: float) -> bool:
        """Take the warning at `now` (None: none now); True when it is to be logged now."""
        due = warning is not None and (
            warning.split(";")[0] != (self.current or "").split(";")[0] or now - self._logged_at >= self.repeat_s
        )
        if due:
            self._logged_at = now
            if warning not in self.seen:
                self.seen.append(warning)
        self.current = warning
        return due


@dataclass(frozen=True)
class StartReadings:
    """What the rollouts and the verifiers are doing before the first group completes."""

    engines: int  # rollout actors that answered
    engines_serving: int  # of those, the ones whose engine is up
    in_flight: int  # attempts the rollouts hold: generating, or at the verifier
    at_verifier: int  # attempts the verifiers received and have not answered
    verified: int  # attempts the verifiers answered so far
    verifiers: int = 0  # verifier actors that answered
    warming: int = 0  # of those, the ones whose warm-up (precompiled headers, sandbox) still runs


def waiting_story(counts: ReplayCounts | None, r: StartReadings | None) -> str | None:
    """Until the first group completes, what the run waits for, in one clause ('waiting for the
    verifier's warm-up (...); 4 attempts at the verifier; no verdict yet'); None once a group
    completed, or when nothing answered. A cold machine spends minutes here: the verifier builds its
    precompiled headers and its first compiles find no cached object."""
    if r is None or (counts is not None and counts.groups > 0):
        return None
    parts = []
    if r.engines_serving < r.engines:
        parts.append(f"the engines to load the model ({r.engines_serving} of {r.engines} serving)")
    if r.warming:
        which = "" if r.verifiers == 1 else f" ({r.warming} of {r.verifiers} verifiers)"
        parts.append(
            f"the verifier's one-off warm-up{which}: precompiled headers and sandbox, minutes on a cold machine"
        )
    if r.at_verifier:
        first = "; no verdict yet (first compiles find nothing cached)" if not r.verified else ""
        parts.append(f"{plural(r.at_verifier, 'attempt')} at the verifier{first}")
    generating = max(r.in_flight - r.at_verifier, 0)
    if generating:
        parts.append(f"{plural(generating, 'attempt')} generating")
    if not parts:
        if not r.verified:
            return "waiting for the rollouts to start"
        return f"waiting for the first complete group ({plural(r.verified, 'attempt')} verified so far)"
    return "waiting for " + "; ".join(parts)
