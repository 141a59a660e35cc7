"""The replay actor end to end over real ZMQ sockets: intake, bad input, staleness filter with
re-issue, infra failures, batch idempotency, expiry, durable recovery (snapshot + log, torn tails),
and the same actor as a Ray actor."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import zmq

from actors.base import RunContext, as_ray_actor
from actors.buffer import ReplayActor
from actors.buffer.storage import StorageError
from configs import AlgoConfig, ReplayConfig
from configs.schema import RetryConfig
from protocols import BatchRequest, Control, ErrorReply, TaskRequest, decode_parts, encode_parts
from protocols.channels import RemoteError, RequestClient
from tests.buffer.test_formulas import REVIEW, REVIEW_ADVANTAGES
from tests.helpers.synthetic import TurnSpec, make_episode

TEXT = "actors.buffer.examples.TextMatchTasks"


def make(run_dir, *, eta=1, G=2, B=1, steps=20, train_turns="first", turn_credit="per_turn", retry=None, **replay):
    cfg = ReplayConfig(task_source=TEXT, val_fraction=0.0, retry=RetryConfig(**(retry or {})), **replay)
    algo = AlgoConfig(
        group_size=G,
        batch_groups=B,
        total_steps=steps,
        train_turns=train_turns,
        turn_credit=turn_credit,
        seed=3,
        max_staleness=eta,
    )
    return ReplayActor(cfg, algo, RunContext(run_dir=str(run_dir)))


def episodes(reply, scores=(1.0, -1.0), version=0, **spec):
    return [
        make_episode(reply.task, reply.group_id, i, [TurnSpec(passed=s > 0, score=s, version=version, **spec)])
        for i, s in enumerate(scores)
    ]


@pytest.fixture
def served(tmp_path):
    actor = make(tmp_path, G=2)
    address = actor.start()["replay"]
    client = RequestClient(address, timeout_s=5.0, retries=0)
    yield actor, client
    client.close()
    actor.stop()


# ---------------------------------------------------------------------------------------- intake


def test_intake_over_sockets_stores_once_and_rejects_inconsistent_episodes(served):
    actor, client = served
    reply = client.request(TaskRequest(actor_id="r"))
    other = client.request(TaskRequest(actor_id="r"))
    assert reply.status == "task" and reply.group_size == 2
    ep0, ep1 = episodes(reply)
    assert client.request(ep0).status == "stored"
    assert client.request(ep0).status == "duplicate"  # a resend after a lost ack
    bad = {
        "unknown_group": make_episode(reply.task, "g9999999", 0, [TurnSpec()]),
        "sample_index": make_episode(reply.task, reply.group_id, 2, [TurnSpec()]),
        "slot_taken": make_episode(reply.task, reply.group_id, 0, [TurnSpec()]),
        "task_mismatch": make_episode(other.task, reply.group_id, 1, [TurnSpec()]),
    }
    bad["non_finite"] = make_episode(reply.task, reply.group_id, 1, [TurnSpec()])
    bad["non_finite"].rewards[0] = float("nan")
    for key, ep in bad.items():
        ack = client.request(ep)
        assert ack.status == "rejected" and ack.reason, key
    bad_lp = make_episode(reply.task, reply.group_id, 1, [TurnSpec()])
    bad_lp.turns[0].logprobs[0] = np.inf
    assert client.request(bad_lp).status == "rejected"
    assert client.request(ep1).status == "stored"  # the real sample 1 still fits its slot
    h = actor.health()
    assert h.rejected_by_reason == {
        "unknown_group": 1,
        "sample_index": 1,
        "slot_taken": 1,
        "task_mismatch": 1,
        "non_finite": 2,
    }
    assert (h.emitted, h.duplicates, h.groups.ready, h.invariant_ok) == (2, 1, 1, True)
    assert h.ack_latency_ms.n >= 2 and h.ack_latency_ms.p50 > 0


def test_garbage_and_unknown_records_get_error_replies_and_service_continues(served):
    actor, client = served
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(client.address)
    raw.send_multipart([b"corr-id-1", b"\x00not a kiln frame"])
    assert raw.poll(5000)
    answer = decode_parts(raw.recv_multipart()[1:])
    assert isinstance(answer, ErrorReply) and "undecodable" in answer.message
    raw.send_multipart([b"corr-id-2", *encode_parts(Control(command="pause"))])
    assert raw.poll(5000)
    assert "not Control" in decode_parts(raw.recv_multipart()[1:]).message
    raw.close()
    assert client.request(BatchRequest(learner_id="l", version=5)).status == "wait"
    with pytest.raises(RemoteError, match="versions only grow"):
        client.request(BatchRequest(learner_id="l", version=4))
    assert client.request(TaskRequest(actor_id="r")).status == "task"
    assert actor.health().handler_errors == 0


# ------------------------------------------------------------------------------ staleness, infra


def test_stale_group_is_filtered_counted_and_its_task_reissued_first(tmp_path):
    a = make(tmp_path, eta=1, B=1)
    old, new = a.handle(TaskRequest(actor_id="r")), a.handle(TaskRequest(actor_id="r"))
    for ep in episodes(old, version=0) + episodes(new, version=2):
        a.handle(ep)
    reply = a.handle(BatchRequest(learner_id="l", version=2))  # old lags by 2 > η = 1
    assert reply.status == "batch"
    assert set(reply.batch.episode_ids) == set(a.episode_ids()["trained"])
    h = a.health()
    assert h.filtered == {"stale": 2} and h.trained == 2 and h.trained_lag.max == 0
    again = a.handle(TaskRequest(actor_id="r"))
    assert again.task == old.task and again.group_id != old.group_id  # a fresh group of the same task
    assert h.invariant_ok
    a.stop()


@pytest.mark.parametrize("train_turns, stale", [("first", False), ("all", True)])
def test_staleness_looks_only_at_gradient_carrying_turns(tmp_path, train_turns, stale):
    a = make(tmp_path, eta=1, B=1, train_turns=train_turns)
    r = a.handle(TaskRequest(actor_id="r"))
    for i, first_version in enumerate((5, 5)):
        turns = [
            TurnSpec(score=-1.0, version=first_version),
            TurnSpec(passed=i == 0, score=1.0 if i == 0 else -0.8, version=2),
        ]
        a.handle(make_episode(r.task, r.group_id, i, turns))
    reply = a.handle(BatchRequest(learner_id="l", version=5))
    assert reply.status == ("wait" if stale else "batch")
    assert a.health().filtered == ({"stale": 2} if stale else {})
    a.stop()


# the review's group (tests/buffer/test_formulas.py): one advantage per episode, as group_advantages(R) gives it
EPISODE_ADVANTAGES = [1.58208, -0.59418, 0.07875, -1.06665]


@pytest.mark.parametrize(
    "turn_credit, train_turns, advantages, credited",
    [
        # per-turn credit, every turn trains: each turn its own advantage; B1 + C2 + D2 = 5 repair turns
        ("per_turn", "all", REVIEW_ADVANTAGES, 5),
        # the ablation arm: each turn its episode's advantage, no turn credited on its own
        ("episode", "all", [[a] * len(s) for a, (s, _) in zip(EPISODE_ADVANTAGES, REVIEW, strict=True)], 0),
        # turn 1 only: valued at R, so the per-episode advantages again
        ("per_turn", "first", [[a] for a in EPISODE_ADVANTAGES], 0),
    ],
)
def test_a_batch_carries_each_turns_advantage_and_counts_turns_credited_on_their_own(
    tmp_path, turn_credit, train_turns, advantages, credited
):
    a = make(tmp_path, G=4, B=1, train_turns=train_turns, turn_credit=turn_credit)
    r = a.handle(TaskRequest(actor_id="r"))
    eps = [
        make_episode(r.task, r.group_id, i, [TurnSpec(passed=p, score=s) for s, p in zip(scores, passed, strict=True)])
        for i, (scores, passed) in enumerate(REVIEW)
    ]
    for ep in eps:
        a.handle(ep)
    batch = a.handle(BatchRequest(learner_id="l", version=0)).batch
    np.testing.assert_allclose(batch.advantages, [x for adv in advantages for x in adv], atol=1e-3)
    assert batch.episode_ids == [ep.episode_id for ep, adv in zip(eps, advantages, strict=True) for _ in adv]
    assert a.health().turn_credited_turns == credited
    again = a.handle(BatchRequest(learner_id="l", version=0)).batch  # a repeated request counts nothing new
    assert np.array_equal(again.advantages, batch.advantages) and a.health().turn_credited_turns == credited
    a.stop()


def test_a_snapshot_of_another_format_is_refused_with_a_clear_error(tmp_path):
    a = make(tmp_path)
    old = a._state.dump() | {"format": 2}  # format 2 kept one advantage per episode
    with pytest.raises(ValueError, match="replay snapshot format 2 is not 3"):
        a._state.load(old, now=0.0)
    a.stop()


def test_infra_failures_are_filtered_reissued_and_never_buffered_for_retry(tmp_path):
    a = make(tmp_path, eta=1)
    r = a.handle(TaskRequest(actor_id="r"))
    a.handle(make_episode(r.task, r.group_id, 0, [TurnSpec(score=-1.0)]))
    a.handle(make_episode(r.task, r.group_id, 1, [TurnSpec(score=-1.0, infra=True)]))
    h = a.health()
    assert h.filtered == {"infra": 2} and h.retry.size == 0
    assert a.handle(TaskRequest(actor_id="r")).task == r.task
    a.stop()


def test_repeated_request_for_a_version_gets_the_same_batch(tmp_path):
    a = make(tmp_path, eta=2, B=1)
    for _ in range(2):
        r = a.handle(TaskRequest(actor_id="r"))
        for ep in episodes(r):
            a.handle(ep)
    b0 = a.handle(BatchRequest(learner_id="l", version=0)).batch
    again = a.handle(BatchRequest(learner_id="rank-1", version=0)).batch
    assert again.episode_ids == b0.episode_ids and np.array_equal(again.tokens, b0.tokens)
    b1 = a.handle(BatchRequest(learner_id="l", version=1)).batch
    assert set(b1.episode_ids).isdisjoint(b0.episode_ids)
    assert isinstance(a.handle(BatchRequest(learner_id="l", version=0)), ErrorReply)
    assert a.health().trained == 4
    a.stop()


def test_an_abandoned_group_expires_and_late_samples_are_counted(tmp_path):
    a = make(tmp_path, eta=0, group_timeout_s=0.3)
    client = RequestClient(a.start()["replay"], timeout_s=5.0, retries=0)
    try:
        r = client.request(TaskRequest(actor_id="r"))
        first, late = episodes(r)
        assert client.request(first).status == "stored"
        deadline = time.monotonic() + 5
        while a.health().groups.filtered.get("expired") != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.request(late).status == "stored"
        h = a.health()
        assert h.filtered == {"expired": 2} and h.invariant_ok
        assert client.request(TaskRequest(actor_id="r")).task == r.task  # re-issued
    finally:
        client.close()
        a.stop()


def test_a_dead_rollouts_groups_are_released_at_once_and_survive_a_restart(tmp_path):
    a = make(tmp_path, eta=1, B=2)  # the default hour-long group timeout: only the release can free them
    client = RequestClient(a.start()["replay"], timeout_s=5.0, retries=0)
    try:
        mine = client.request(TaskRequest(actor_id="rollout-0"))
        other = client.request(TaskRequest(actor_id="rollout-1"))
        first, _ = episodes(mine)
        assert client.request(first).status == "stored"
        assert a.release_actor("rollout-0") == 1 and a.release_actor("rollout-0") == 0
        h = a.health()
        assert h.groups.running == 1 and h.filtered == {"expired": 1} and h.invariant_ok
        assert client.request(TaskRequest(actor_id="rollout-2")).task == mine.task  # re-issued first
        assert other.group_id in a._state.running
    finally:
        client.close()
        a.stop()
    b = make(tmp_path, eta=1, B=2)  # the release was logged: a restart makes the same decision
    assert b.health().filtered == {"expired": 1}
    b.stop()


# -------------------------------------------------------------------------------------- recovery


def drive(a, rounds=6):
    """A realistic mix: groups, duplicates, rejections, a stale filter, BDR, batches."""
    version = 0
    for k in range(rounds):
        replies = [a.handle(TaskRequest(actor_id="r")) for _ in range(3)]
        for j, r in enumerate(x for x in replies if x.status == "task"):
            scores = (-1.0, -0.9) if (k + j) % 3 == 0 else (1.0, -1.0)
            eps = episodes(r, scores=scores, version=max(version - (k % 2) * 3, 0))
            for ep in eps:
                a.handle(ep)
            a.handle(eps[0])  # duplicate
        known = next((r.task for r in replies if r.task is not None), None)
        if known is not None:
            a.handle(make_episode(known, "nope", 0, [TurnSpec()]))  # rejected: unknown group
        if a.handle(BatchRequest(learner_id="l", version=version)).status == "batch":
            version += 1


def durable_view(a):
    state = copy.deepcopy(a._state.dump())
    for diagnostic in ("duplicates", "rejected", "admission_waits", "batch_waits", "val_served"):
        state["counters"].pop(diagnostic)  # restored as of the last snapshot only (not logged)
    return state


@pytest.mark.parametrize("snapshot_every", [1000, 7])
def test_recovery_after_an_abrupt_end_rebuilds_the_exact_state(tmp_path, snapshot_every):
    a = make(
        tmp_path, eta=1, B=2, snapshot_every=snapshot_every, retry={"capacity": 4, "probability": 0.5, "max_retries": 2}
    )
    drive(a)
    expected, ids, logged = durable_view(a), a.episode_ids(), a._store.since_snapshot
    assert (a._store.stats.snapshots > 0) == (snapshot_every == 7)
    # no stop(): as after kill -9, only what was committed to disk is there
    b = make(
        tmp_path, eta=1, B=2, snapshot_every=snapshot_every, retry={"capacity": 4, "probability": 0.5, "max_retries": 2}
    )
    assert b.recovered["snapshot"] == (snapshot_every == 7) and b.recovered["log_entries"] == logged
    assert logged > 0 or snapshot_every == 7
    assert durable_view(b) == expected and b.episode_ids() == ids
    h = b.health()
    assert h.invariant_ok and h.filtered.get("stale") and h.retry.admitted and h.batches >= 2
    assert b.handle(TaskRequest(actor_id="r")) == a.handle(TaskRequest(actor_id="r"))  # same RNG, cursor, queue
    b.stop()


def test_a_torn_log_tail_is_truncated_and_a_damaged_snapshot_refused(tmp_path):
    a = make(tmp_path)
    drive(a, rounds=2)
    expected = durable_view(a)
    wal = a._store._wal(a._store.generation)
    a._store.close()
    with open(wal, "ab") as f:
        f.write(b"KW\x01\x00\xff\xff\x00\x00half a frame")  # what kill -9 mid-append leaves
    b = make(tmp_path)
    assert b.recovered["truncated_bytes"] == 20
    assert durable_view(b) == expected
    b.stop()  # writes a snapshot
    snapshot = tmp_path / "replay" / "snapshot.bin"
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="damaged"):
        make(tmp_path)


def test_disk_failure_stops_acknowledging(tmp_path, monkeypatch):
    a = make(tmp_path)
    r = a.handle(TaskRequest(actor_id="r"))

    def broken(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fdatasync", broken)
    ep = episodes(r)[0]
    ack = a.handle(ep)
    assert isinstance(ack, ErrorReply) and "No space left" in ack.message
    monkeypatch.undo()
    assert isinstance(a.handle(TaskRequest(actor_id="r")), ErrorReply)  # fail-stop until restarted
    assert a.health().storage.failure
    a._store.close()
    b = make(tmp_path)  # the restart holds the group; the unacked episode may or may not have reached disk
    assert b.health().groups.running == 1
    assert b.handle(ep).status in ("stored", "duplicate")  # so the rollout's resend is what makes it safe
    assert b.health().emitted == 1
    b.stop()


# ------------------------------------------------------------------------------------------- Ray


def test_runs_as_a_ray_actor(ray_session, tmp_path):
    ray = ray_session
    cfg = ReplayConfig(task_source=TEXT, val_fraction=0.0)
    handle = as_ray_actor(ReplayActor, num_cpus=0).remote(
        cfg, AlgoConfig(group_size=2), RunContext(run_dir=str(tmp_path))
    )
    address = ray.get(handle.start.remote(), timeout=60)["replay"]
    with RequestClient(address, timeout_s=10.0, retries=0) as client:
        r = client.request(TaskRequest(actor_id="r"))
        for ep in episodes(r):
            assert client.request(ep).status == "stored"
    h = ray.get(handle.health.remote(), timeout=30)
    assert h.emitted == 2 and h.groups.ready == 1 and h.invariant_ok
    ray.get(handle.stop.remote(), timeout=30)
    ray.kill(handle)
