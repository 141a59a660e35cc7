"""Replay's admission shares and held requests: one rollout actor cannot take the whole admission
window while another asks too, a dead actor's share goes to the live ones at once, and a request
that must wait is answered the moment it can be served (not at its client's next ask)."""

from __future__ import annotations

import threading
import time

from actors.buffer.shares import AdmissionShares
from protocols import BatchRequest, TaskRequest
from protocols.channels import RequestClient
from tests.buffer.test_actor import episodes, make


def test_a_share_is_the_window_split_over_the_active_actors_rounded_up():
    shares = AdmissionShares(idle_s=1.0)
    G = 2  # the room is in attempts: G per group
    assert shares.room("a", {}, window=5, group_size=G, now=0.0) == 10  # alone: the whole window
    assert shares.room("b", {"a": 1}, window=5, group_size=G, now=0.1) == 6  # two active: ceil(5 / 2) = 3 each
    assert shares.room("a", {"a": 2, "b": 1}, window=5, group_size=G, now=0.2) == 2
    assert shares.room("a", {"a": 3, "b": 1}, window=5, group_size=G, now=0.3) == 0
    # b holds nothing and has not asked for longer than idle_s: a may take the window again
    assert shares.room("a", {"a": 3}, window=5, group_size=G, now=1.5) == 4
    # an actor that holds a running group counts however long ago it asked
    assert shares.room("a", {"a": 3, "b": 2}, window=5, group_size=G, now=9.0) == 0
    shares.release("b")  # b died: its groups are released, and it no longer counts
    assert shares.room("a", {"a": 3}, window=5, group_size=G, now=9.1) == 4


def test_two_rollout_actors_split_the_window_and_a_dead_ones_groups_go_to_the_other(tmp_path):
    replay = make(tmp_path, eta=0, B=4)  # a window of 4 groups
    client = RequestClient(replay.start()["replay"], timeout_s=5.0, retries=0)
    try:
        ask = lambda actor: client.request(TaskRequest(actor_id=actor))
        assert ask("rollout-0").status == "task"
        assert ask("rollout-1").status == "task"
        assert ask("rollout-0").status == "task"
        assert ask("rollout-0").status == "wait"  # it holds its 2 of 4 while rollout-1 asks too
        assert ask("rollout-1").status == "task"
        assert ask("rollout-1").status == "wait"  # the window is full
        assert replay.release_actor("rollout-0") == 2  # dead: its groups are re-issued
        taken = [ask("rollout-1") for _ in range(3)]
        assert [r.status for r in taken] == ["task", "task", "wait"]  # the survivor takes both
        assert all(r.task is not None for r in taken[:2])
    finally:
        client.close()
        replay.stop()


def test_a_request_that_must_wait_is_answered_the_moment_it_can_be_served(tmp_path):
    replay = make(tmp_path, eta=0, B=1, G=2, retry_after_s=3.0)  # a long hold: an answer within it is the serve
    address = replay.start()["replay"]
    client = RequestClient(address, timeout_s=10.0, retries=0)
    learner = RequestClient(address, timeout_s=10.0, retries=0)
    try:
        group = client.request(TaskRequest(actor_id="rollout-0"))
        answered: list = []

        def ask_for_the_batch() -> None:
            answered.append(learner.request(BatchRequest(learner_id="learner", version=0)))
            answered.append(time.monotonic())

        waiting = threading.Thread(target=ask_for_the_batch)
        waiting.start()
        time.sleep(0.3)
        assert not answered  # no batch yet: held, not answered "wait"
        for ep in episodes(group):
            assert client.request(ep).status == "stored"
        completed = time.monotonic()
        waiting.join(timeout=5.0)
        reply, at = answered
        assert reply.status == "batch" and at - completed < 1.0, at - completed
        # Held for its whole hold with nothing to serve it: told to ask again at once.
        started = time.monotonic()
        reply = client.request(TaskRequest(actor_id="rollout-0"))  # the admission bound is reached
        assert reply.status == "wait" and reply.retry_after_s == 0.0
        assert 2.5 < time.monotonic() - started < 6.0
    finally:
        client.close()
        learner.close()
        replay.stop()


def test_a_released_process_gets_no_group_from_a_request_held_or_queued_at_its_death(tmp_path):
    replay = make(tmp_path, eta=0, B=1, G=2, retry_after_s=1.0)
    address = replay.start()["replay"]
    dead, new = RequestClient(address, timeout_s=10.0, retries=0), RequestClient(address, timeout_s=10.0, retries=0)
    try:
        first = dead.request(TaskRequest(actor_id="rollout-0", incarnation="a"))
        assert first.status == "task"
        answered: list = []
        held = threading.Thread(
            target=lambda: answered.append(dead.request(TaskRequest(actor_id="rollout-0", incarnation="a")))
        )  # the window is full: held
        held.start()
        time.sleep(0.2)
        assert replay.release_actor("rollout-0") == 1  # its process died: the group's task is re-issued
        held.join(timeout=5.0)
        assert answered[0].status == "wait"  # the release freed the window, but not for the dead process
        again = new.request(TaskRequest(actor_id="rollout-0", incarnation="b"))  # its replacement
        assert again.status == "task" and again.task == first.task
    finally:
        dead.close()
        new.close()
        replay.stop()
