"""The algorithm's decisions (actors/decisions.py), each pinned with hand-computed cases: admission
capacity in attempts, a complete group's fate, the fate at batch time, expiry and η's pace."""

from __future__ import annotations

import numpy as np
import pytest

from actors.decisions import (
    EXPIRED,
    TRAIN,
    Fate,
    GroupOutcome,
    admission_capacity,
    attempt_budget,
    bdr_step,
    engine_room,
    engine_token_room,
    fate_at_batch,
    fate_of_complete_group,
    is_overdue,
    is_stale,
    keep_rate,
    made_by_discarded,
    may_start_group,
    running_window,
    served_batch_finished,
    share_room,
    staleness_bound,
    staleness_room,
    token_budget,
    verifier_budget,
    verifier_room,
    waits_for_engines,
)

# ----------------------------------------------------------------------------------- admission


def test_staleness_bound_is_eta_plus_v_plus_one_batches_capped_at_the_run():
    assert staleness_bound(0, 0, 4, total_steps=100) == 4  # η = 0: one batch ahead, i.e. synchronous
    assert staleness_bound(1, 0, 4, total_steps=100) == 8
    assert staleness_bound(1, 3, 4, total_steps=100) == 20  # (1 + 3 + 1) * 4
    assert staleness_bound(4, 0, 2, total_steps=3) == 6  # never more groups than the run can train on
    assert staleness_bound(0, 0, 2, total_steps=3, whole_run=True) == 6  # rollout-only: all at once


def test_rooms_are_counted_in_attempts():
    G = 4
    assert staleness_room(running_groups=7, window_groups=8, group_size=G) == 4  # one whole group
    assert staleness_room(running_groups=8, window_groups=8, group_size=G) == 0
    # a window of 5 groups over 2 active actors: a share of ceil(5 / 2) = 3 groups each
    assert share_room(held_groups=1, window_groups=5, active_actors=2, group_size=G) == 8
    assert share_room(held_groups=3, window_groups=5, active_actors=2, group_size=G) == 0
    assert share_room(held_groups=0, window_groups=5, active_actors=0, group_size=G) == 20  # alone
    assert attempt_budget(0, max_batch=8) == 16 and attempt_budget(12, max_batch=8) == 12
    assert engine_room(attempts_at_engine=13, budget=16) == 3
    assert verifier_budget(0, max_batch=8) == 16 and verifier_budget(40, max_batch=8) == 40
    assert verifier_room(attempts_at_verifiers=17, budget=16) == -1
    # the token budget: 2 x max_batch x max_seq_len by default, a full batch of the longest rows queued twice
    assert token_budget(0, max_batch=8, max_seq_len=1024) == 16_384 and token_budget(5000, 8, 1024) == 5000
    # 16,384 - 10,000 reserved leaves 6,384 tokens: 4 more attempts of 1,500 expected each
    assert engine_token_room(tokens_reserved=10_000, budget=16_384, attempt_tokens=1500.0) == 4
    assert engine_token_room(tokens_reserved=16_000, budget=16_384, attempt_tokens=1500.0) == 0
    assert engine_token_room(tokens_reserved=17_000, budget=16_384, attempt_tokens=1500.0) < 0  # overshot
    # an idle engine takes one, however small the budget: a group at a time, never a stall
    assert engine_token_room(tokens_reserved=0, budget=100, attempt_tokens=1500.0) == 1
    assert engine_token_room(tokens_reserved=1, budget=100, attempt_tokens=1500.0) == 0


def test_the_window_counts_a_running_group_as_the_share_that_verdicts_keep():
    assert keep_rate([], floor=0.125) == 1.0  # before any group completes: the plain bound
    assert keep_rate([True, False, False, False], floor=0.125) == 0.25
    assert keep_rate([False] * 10, floor=0.125) == 0.125  # all tied: at most 8x the plain window
    # (η + v + 1)·B = 16 places, 6 taken by complete groups: 10 running at a keep rate of 1, 40 at 1/4
    assert running_window(bound_groups=16, complete_groups=6, keep=1.0) == 10
    assert running_window(bound_groups=16, complete_groups=6, keep=0.25) == 40
    assert running_window(bound_groups=16, complete_groups=6, keep=0.3) == 33  # rounded down


def test_capacity_is_the_tightest_room_and_a_group_starts_while_it_is_above_zero():
    assert admission_capacity(8, 3, 20) == 3
    assert may_start_group(admission_capacity(8, 3))  # the engine room is soft: 3 attempts start a group of 4
    assert not may_start_group(admission_capacity(0, 16))  # the staleness bound is reached
    assert not may_start_group(admission_capacity(8, -2))  # a group overshot the engine budget
    # the replay alone, with one group left under (η + v + 1)·B = 8 groups of G = 2
    assert may_start_group(admission_capacity(staleness_room(7, 8, 2)))
    assert not may_start_group(admission_capacity(staleness_room(8, 8, 2)))


# ------------------------------------------------------------------------------ a complete group


def close(outcome: GroupOutcome, *, streak=0, infra_retries=3, drop_tied=True, in_feed=True) -> Fate:
    return fate_of_complete_group(
        outcome, infra_streak=streak, infra_retries=infra_retries, drop_tied=drop_tied, task_in_feed=in_feed
    )


def test_a_group_with_signal_is_trained():
    assert close(GroupOutcome(is_retry=False, any_passed=True)) == TRAIN
    assert TRAIN.trained and not TRAIN.reissue


def test_a_tied_group_is_filtered_unless_tied_groups_are_kept():
    tied = GroupOutcome(is_retry=False, tied=True, any_passed=True)
    assert close(tied) == Fate(filtered="tied")  # no signal, no slot; its task is not re-issued
    assert close(tied, drop_tied=False) == TRAIN


def test_an_all_failed_group_goes_to_bdr_and_a_repair_group_resolves_its_entry():
    failed = GroupOutcome(is_retry=False, has_failed_attempt=True)
    assert close(failed) == Fate(retry="admit")
    # all failed with the same score: tied, filtered, and still buffered for retry
    assert close(GroupOutcome(is_retry=False, tied=True, has_failed_attempt=True)) == Fate(
        filtered="tied", retry="admit"
    )
    assert close(failed, in_feed=False) == TRAIN  # a late group of a task that left the feed: never buffered
    assert close(GroupOutcome(is_retry=True, any_passed=True)) == Fate(retry="resolve")
    assert close(GroupOutcome(is_retry=True, has_failed_attempt=True)) == Fate(retry="resolve")
    assert bdr_step(GroupOutcome(is_retry=False, any_passed=True, has_failed_attempt=True), task_in_feed=True) == "none"


def test_an_infra_group_is_reissued_until_its_task_has_failed_too_often():
    infra = GroupOutcome(is_retry=False, infra=True)
    assert close(infra, streak=0) == Fate(filtered="infra", reissue=True, infra_streak=1)
    assert close(infra, streak=1) == Fate(filtered="infra", reissue=True, infra_streak=2)
    third = close(infra, streak=2)
    assert (third.filtered, third.leave_feed, third.reissue, third.retry, third.infra_streak) == (
        "infra",
        True,
        False,
        "forget",
        0,
    )
    assert third.why.startswith("3 of its groups in a row failed")
    assert close(GroupOutcome(is_retry=False, any_passed=True), streak=2).infra_streak == 0  # a clean group ends it


def test_an_unservable_task_leaves_the_feed_at_once():
    fate = close(GroupOutcome(is_retry=True, unservable="prompt of 9000 tokens > max_seq_len 8192", infra=True))
    assert (fate.filtered, fate.leave_feed, fate.reissue, fate.retry) == ("unservable", True, False, "forget")
    assert "9000 tokens" in fate.why


# ------------------------------------------------------------------------------- at batch time


def test_one_stale_sample_filters_the_group_and_reissues_its_task():
    assert is_stale(2, 1) and not is_stale(1, 1) and not is_stale(0, 0) and is_stale(1, 0)
    assert not is_stale(None, 0)  # no gradient-carrying tokens: nothing to be stale
    assert fate_at_batch([0, 1], 1, made_by_discarded_weights=False) == TRAIN
    assert fate_at_batch([0, 2], 1, made_by_discarded_weights=False) == Fate(filtered="stale", reissue=True)
    assert fate_at_batch([None, 0], 0, made_by_discarded_weights=True) == Fate(filtered="rolled_back", reissue=True)
    assert fate_at_batch([3], 1, made_by_discarded_weights=True).filtered == "stale"  # stale is judged first


def test_made_by_discarded_weights_means_a_version_strictly_inside_a_discarded_range():
    assert made_by_discarded(np.array([3, 4]), [(2, 5)])
    assert not made_by_discarded(np.array([2, 5]), [(2, 5)])  # the ends were kept (restored, and the new one)
    assert not made_by_discarded(np.array([3]), [])


def test_a_silent_group_expires_and_its_task_goes_again():
    assert is_overdue(last_activity=10.0, now=71.0, timeout_s=60.0)
    assert not is_overdue(last_activity=10.0, now=70.0, timeout_s=60.0)
    assert EXPIRED == Fate(filtered="expired", reissue=True)


# ------------------------------------------------------------------------------------- learner


@pytest.mark.parametrize("eta, waits", [(0, True), (1, False), (2, False)])
def test_only_a_synchronous_learner_waits_for_the_engines(eta, waits):
    assert waits_for_engines(eta) is waits


def test_a_served_batch_is_unfinished_only_when_a_rollback_lands_one_above_it():
    # the learner moved on (4 after 3): finished; a restore at 7 that rolled back (4, 7): the batch
    # served at 6 was the newest version's, so its step never finished; one served at 5 did finish
    assert served_batch_finished(3, 4, rollback=False)
    assert not served_batch_finished(6, 7, rollback=True)
    assert served_batch_finished(5, 7, rollback=True)
