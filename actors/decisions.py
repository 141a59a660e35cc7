"""The algorithm's decisions, as pure functions of state: when a new group may start, and what becomes
of a group (docs/architecture.md, "The algorithm's decisions"). The replay state machine
(actors/buffer/state.py) keeps the books and carries these decisions out; the rollout actor asks the
same admission question of its engine; the learner asks whether η makes it wait for the engines.
Nothing here reads a clock, a socket or a file, so every rule is tested by hand (tests/buffer/).

Read top to bottom, this is a group's life:

1. Admission. A group may start while the admission capacity is above zero. Capacity is counted in
   one unit, attempts (a group is G attempts), and is the tightest of the rooms that bound it:
   * staleness room (replay): (η + v + 1)·B groups may be accepted or running at learner version v,
     so every sample can still be trained on (`staleness_bound`). The bound is about trained data, so a
     running group counts as the share of complete groups that their verdicts keep (`keep_rate`): where
     most groups tie, more run at once, and the batch-time filter (3.) still holds every trained
     sample within η (`running_window`);
   * share room (replay): one rollout actor holds at most ceil(window / active actors) running groups,
     so the step's groups spread over the engines (`share_room`);
   * engine room (rollout actor): attempts at the actor's engine (queued or generating) stay under its
     budget, a full batch and a queue behind it; attempts being verified do not count, so slow
     verifications never starve the engine (`engine_room`);
   * verifier room (rollout actor): attempts sent to verifiers and not answered stay under their own
     budget, so a verifier slower than the engine holds the actor back instead of piling up requests
     that would outlast their reply timeout or η (`verifier_room`);
   * token room (rollout actor): the engine tokens the actor's attempts at its engine reserve (each its
     prompt plus max_new_tokens) stay under the actor's token budget, so the engine holds a full batch
     and a queue behind it however many attempts wait on verifiers (`engine_token_room`).
   The staleness and share rooms are whole groups, so "above zero" means a whole group fits; the
   engine and token rooms are soft: a group may overshoot them by up to G-1 attempts rather than
   leave the engine idle.
2. A complete group (all G samples in) is judged (actors/buffer/groups.py) and `fate_of_complete_group`
   decides: the task leaves the feed (unservable, or infra-failed `replay.infra_retries` times in a
   row), or the group is filtered as infra and its task re-issued, or it is kept; an all-failed group
   is sent to Buffered Dynamic Retry (BDR) and a repair group resolves its retry entry; a kept group
   whose credited values tie (every advantage zero: no signal) is filtered when `algo.drop_tied_groups`,
   else it waits for a batch.
3. When a batch is made, `fate_at_batch` filters a waiting group that has a sample lagging the
   learner by more than η (`is_stale`) or made by weights a learner restore discarded; its task is
   re-issued (a fresh group of it goes to the front of the feed).
4. A running group with no sign of life for `replay.group_timeout_s` (`is_overdue`) expires
   (`EXPIRED`): filtered, its task re-issued.
5. η also decides the learner's pace: at η = 0 it waits for every engine to load a version before
   it asks for the next batch (`waits_for_engines`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

# ---------------------------------------------------------------------------------------- admission


def staleness_bound(
    max_staleness: int, learner_version: int, batch_groups: int, total_steps: int, *, whole_run: bool = False
) -> int:
    """Groups that may be accepted or running at learner version v: (η + v + 1)·B, capped at the run's
    total_steps·B (the groups it can ever train on). `whole_run` (rollout-only runs, where no learner
    advances v) hands out all total_steps·B at once."""
    if whole_run:
        return total_steps * batch_groups
    return min(max_staleness + learner_version + 1, total_steps) * batch_groups


def keep_rate(kept: Sequence[bool], floor: float) -> float:
    """The share of the recent complete groups that their verdicts kept (not tied, not infra), at least
    `floor`; 1 before any group completed, so a run opens with the plain bound."""
    if not kept:
        return 1.0
    return max(sum(kept) / len(kept), floor)


def running_window(bound_groups: int, complete_groups: int, keep: float) -> int:
    """Groups that may be running at once: the places of the staleness bound that complete groups
    (waiting for a batch, or trained) do not take, over the share of running groups expected to be kept.
    At `keep` 1 this is the plain (η + v + 1)·B less the complete groups. A group admitted beyond what
    the learner takes within η steps is filtered as stale at batch time, never trained stale."""
    return int((bound_groups - complete_groups) / keep)


def staleness_room(running_groups: int, window_groups: int, group_size: int) -> int:
    """Attempts the staleness bound leaves room for: (window − running)·G."""
    return (window_groups - running_groups) * group_size


def share_room(held_groups: int, window_groups: int, active_actors: int, group_size: int) -> int:
    """Attempts one rollout actor's share leaves room for. The window is the groups that may be running
    at once now (the staleness bound less the complete ones); the share is ceil(window / active actors),
    rounded up so the window is never left unused for want of a share."""
    share = -(-window_groups // max(active_actors, 1))
    return (share - held_groups) * group_size


def attempt_budget(max_attempts_at_engine: int, max_batch: int) -> int:
    """A rollout actor's attempts at its engine, queued or generating: `rollout.max_attempts_at_engine`,
    or 2 × the engine's batch when 0, a full batch and as many queued behind it to take a finished row's
    place at once. Attempts being verified are not counted: replay's window bounds those."""
    return max_attempts_at_engine or 2 * max_batch


def engine_room(attempts_at_engine: int, budget: int) -> int:
    """Attempts a rollout actor's engine budget leaves room for."""
    return budget - attempts_at_engine


def verifier_budget(max_attempts_at_verifiers: int, max_batch: int) -> int:
    """A rollout actor's attempts waiting on verifiers: `rollout.max_attempts_at_verifiers`, or 2 × the
    engine's batch when 0: a batch's worth of answers being verified while the next batch's arrive."""
    return max_attempts_at_verifiers or 2 * max_batch


def verifier_room(attempts_at_verifiers: int, budget: int) -> int:
    """Attempts a rollout actor's verification budget leaves room for."""
    return budget - attempts_at_verifiers


def token_budget(max_tokens_in_flight: int, max_batch: int, max_seq_len: int) -> int:
    """Engine tokens a rollout actor's attempts at its engine may reserve: `rollout.max_tokens_in_flight`,
    or 2 × max_batch × model.max_seq_len when 0, a full batch of the longest rows decoding and as many
    queued behind it (shorter rows: more of them)."""
    return max_tokens_in_flight or 2 * max_batch * max_seq_len


def engine_token_room(tokens_reserved: int, budget: int, attempt_tokens: float) -> int:
    """Attempts the token budget leaves room for: what is left of it over the tokens one more attempt is
    expected to reserve (`attempt_tokens`, its prompt plus max_new_tokens), rounded down. An engine with
    nothing reserved always has room for one, so a budget below one attempt slows the actor to a group
    at a time instead of stopping it."""
    room = int((budget - tokens_reserved) // max(attempt_tokens, 1.0))
    return max(room, 1) if tokens_reserved <= 0 else room


def admission_capacity(*rooms: int) -> int:
    """The attempts that may still start: the tightest of the rooms an actor knows of. A new group
    starts while it is above zero."""
    return min(rooms)


def may_start_group(capacity: int) -> bool:
    return capacity > 0


# ------------------------------------------------------------------------------------ a group's fate

FilterReason = Literal["", "tied", "stale", "rolled_back", "expired", "infra", "unservable"]
RetryStep = Literal["none", "admit", "resolve", "forget"]


@dataclass(frozen=True)
class GroupOutcome:
    """What a complete group's verdict says, as far as its fate depends on it."""

    is_retry: bool  # a BDR repair group (its task carries the failed attempt and its feedback)
    unservable: str = ""  # why the rollouts could not pose the task at all; "" when they could
    infra: bool = False  # a turn failed through the system's fault: the rewards are not the policy's
    tied: bool = False  # every credited value equal (rewards, or per-turn values): all advantages zero, no signal
    any_passed: bool = False
    has_failed_attempt: bool = False  # a failed turn with a verdict exists (what BDR would retry)


@dataclass(frozen=True)
class Fate:
    """What becomes of a group. The replay state carries it out: the ledger, the feed, the retry buffer."""

    filtered: FilterReason = ""  # why it is never trained on; "" = it is trained (waits for a batch)
    reissue: bool = False  # a fresh group of its task goes to the front of the feed
    leave_feed: bool = False  # its task leaves the feed for good (reported once, with `why`)
    retry: RetryStep = "none"  # BDR: admit its best failed attempt, resolve its retry entry, or forget the task
    infra_streak: int = 0  # its task's groups filtered as infra in a row, this one included
    why: str = ""  # for the log, when the task leaves the feed

    @property
    def trained(self) -> bool:
        return not self.filtered


TRAIN = Fate()
EXPIRED = Fate(filtered="expired", reissue=True)  # nobody delivered it: the task goes again


def fate_of_complete_group(
    outcome: GroupOutcome, *, infra_streak: int, infra_retries: int, drop_tied: bool, task_in_feed: bool
) -> Fate:
    """All G samples are in. `infra_streak`: the task's infra-filtered groups in a row before this one;
    `task_in_feed`: its task has not left the feed (a late group of a dropped task is never buffered)."""
    if outcome.unservable:
        return Fate(
            filtered="unservable",
            leave_feed=True,
            retry="forget",
            why=f"the rollouts cannot pose it: {outcome.unservable}",
        )
    if outcome.infra:
        streak = infra_streak + 1
        if streak >= infra_retries:
            return Fate(
                filtered="infra",
                leave_feed=True,
                retry="forget",
                why=f"{streak} of its groups in a row failed through the system's fault (infra), "
                "e.g. a reference that raises",
            )
        return Fate(filtered="infra", reissue=True, infra_streak=streak)
    retry = bdr_step(outcome, task_in_feed=task_in_feed)
    if outcome.tied and drop_tied:  # dynamic sampling: no signal, no slot in a batch
        return Fate(filtered="tied", retry=retry)
    return Fate(retry=retry)


def bdr_step(outcome: GroupOutcome, *, task_in_feed: bool) -> RetryStep:
    """Buffered Dynamic Retry: a repair group resolves its entry (passed: it leaves; failed: its newer
    failure replaces the old one); a fresh group whose every sample failed enters the buffer with its
    best failed attempt."""
    if outcome.is_retry:
        return "resolve"
    if task_in_feed and not outcome.any_passed and outcome.has_failed_attempt:
        return "admit"
    return "none"


def fate_at_batch(lags: Sequence[int | None], max_staleness: int, *, made_by_discarded_weights: bool) -> Fate:
    """A complete, kept group when a batch is made at learner version v: `lags` are its samples' lags
    (v − their oldest gradient-carrying token version). A group's baseline means something only over
    samples of one policy window, and lag only grows, so one stale sample filters the whole group."""
    if any(is_stale(lag, max_staleness) for lag in lags):
        return Fate(filtered="stale", reissue=True)
    if made_by_discarded_weights:
        return Fate(filtered="rolled_back", reissue=True)
    return TRAIN


def served_batch_finished(served_version: int, version: int, *, rollback: bool) -> bool:
    """Whether the step on the batch last served (at `served_version`) finished, now that the learner
    asks at a newer `version`. Without a rollback it did: the learner moves on only after its step. A
    restore that rolled versions back continues at one above the newest version announced; had the
    served batch's step finished, its result would be that newest version, so the step never finished
    exactly when the batch was served at `version` - 1 (its groups are judged again)."""
    return not (rollback and served_version == version - 1)


def is_stale(lag: int | None, max_staleness: int) -> bool:
    """A sample lagging the learner by more than η versions is never trained on; one with no
    gradient-carrying tokens (lag None) has nothing to be stale."""
    return lag is not None and lag > max_staleness


def made_by_discarded(token_versions: np.ndarray, discarded: Sequence[tuple[int, int]]) -> bool:
    """Whether any gradient-carrying token was made by weights a learner restore threw away: a version
    strictly inside a discarded range (lo, hi)."""
    return any(bool(np.any((token_versions > lo) & (token_versions < hi))) for lo, hi in discarded)


def is_overdue(last_activity: float, now: float, timeout_s: float) -> bool:
    """A running group with no sign of life for `timeout_s`: its rollout died or lost its task."""
    return now - last_activity > timeout_s


# ------------------------------------------------------------------------------------- the learner


def waits_for_engines(max_staleness: int) -> bool:
    """At η = 0 (synchronous) the learner waits for every engine to confirm a version before it asks
    for the next batch, so no sample is made with weights one version old (it could never be trained)."""
    return max_staleness == 0
