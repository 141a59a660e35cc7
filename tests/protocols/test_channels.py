"""Channels across real processes: push/pull, request/reply with resend, PUB/SUB with a READY barrier
and a late subscriber that still receives every announcement."""

import multiprocessing as mp
import time

import numpy as np
import pytest

import protocols as P
from protocols.announcements import Publisher, Subscriber
from protocols.channels import ChannelTimeout, PullChannel, PushChannel, RemoteError, ReplyServer, RequestClient

CTX = mp.get_context("spawn")


def announcement(v):
    return P.WeightAnnouncement(
        version=v,
        manifest=[P.TensorSpec(name="w", dtype="float32", shape=[4, 4])],
        transport="disk",
        location=f"/ckpt/{v}",
    )


# ----------------------------------------------------------------------------- child processes


def _pusher(address, n, received):
    with PushChannel(address) as push:
        for i in range(n):
            push.send(P.Metrics(source="child", step=i, ts=time.time(), values={"i": float(i)}))
        received.wait(60)  # linger 0: the socket stays open until the test has every frame


def _server(q, stop, slow_first):
    calls = {"n": 0}

    def handle(rec):
        calls["n"] += 1
        if isinstance(rec, P.TaskRequest) and rec.actor_id == "boom":
            raise RuntimeError("handler bug")
        if slow_first and calls["n"] == 1:
            time.sleep(1.0)  # longer than the client's timeout: the client resends
        return P.EpisodeAck(episode_id=f"{rec.actor_id}:{calls['n']}", status="stored")

    with ReplyServer() as srv:
        q.put(srv.address)
        srv.serve(handle, stop)


def _publisher(q, go, received, n_before, n_after):
    with Publisher() as pub:
        for v in range(n_before):
            pub.publish(announcement(v))
        q.put((pub.address, pub.sync_address))  # only now: these were published before anyone subscribed
        go.wait(30)
        assert pub.wait_ready(1, timeout_s=30)
        for v in range(n_before, n_before + n_after):
            pub.publish(announcement(v))
        received.wait(60)  # keep serving catch-up until the subscriber has everything


# ----------------------------------------------------------------------------------- tests


def test_push_pull_across_processes():
    received = CTX.Event()
    with PullChannel() as pull:
        p = CTX.Process(target=_pusher, args=(pull.address, 200, received))
        p.start()
        steps = [pull.recv(timeout_s=30).step for _ in range(200)]
        received.set()
        p.join(30)
    assert steps == list(range(200))


@pytest.fixture
def server():
    q, stop = CTX.Queue(), CTX.Event()
    proc = CTX.Process(target=_server, args=(q, stop, True))
    proc.start()
    yield q.get(timeout=60)
    stop.set()
    proc.join(10)


def test_request_reply_resends_and_is_handled_once(server):
    with RequestClient(server, timeout_s=0.3, retries=10) as client:
        first = client.request(P.TaskRequest(actor_id="a"))
        # The slow first call was resent several times but handled once: the server answered the
        # resends from its reply cache, so the next request is the handler's second call.
        assert first.episode_id == "a:1" and client.stats.resent >= 1
        assert client.request(P.TaskRequest(actor_id="b")).episode_id == "b:2"
        with pytest.raises(RemoteError, match="RuntimeError: handler bug"):
            client.request(P.TaskRequest(actor_id="boom"))
        assert client.request(P.TaskRequest(actor_id="c")).episode_id == "c:4"  # still serving


def test_request_times_out_without_a_server():
    with ReplyServer() as srv:
        address = srv.address
    with RequestClient(address, timeout_s=0.1, retries=2) as client, pytest.raises(ChannelTimeout):
        client.request(P.TaskRequest(actor_id="x"))


def test_late_subscriber_loses_nothing():
    q, go, received = CTX.Queue(), CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_publisher, args=(q, go, received, 5, 5))
    proc.start()
    address, sync = q.get(timeout=60)
    with Subscriber(address, sync) as sub:
        sub.connect(timeout_s=30)
        go.set()
        versions = [sub.recv(timeout_s=30).version for _ in range(10)]
    received.set()
    proc.join(30)
    assert versions == list(range(10))


def test_subscriber_recovers_a_gap_from_history():
    with Publisher(hwm=10) as pub:
        sub = Subscriber(pub.address, pub.sync_address, hwm=10)
        sub.connect(timeout_s=10)
        assert pub.wait_ready(1, timeout_s=5)
        big = np.zeros(1 << 16, np.float32)
        for v in range(300):  # far past both high-water marks while the subscriber is not reading
            pub.publish(
                P.Turn(
                    prompt_ids=np.array([v], np.int32),
                    response_ids=np.zeros(0, np.int32),
                    logprobs=big[:0],
                    versions=np.zeros(0, np.int32),
                    finish_reason="stop",
                )
            )
        got = []
        while (rec := sub.recv(timeout_s=2)) is not None:
            got.append(int(rec.prompt_ids[0]))
        sub.close()
    assert got == list(range(300)) and sub.lost == 0


def test_subscriber_counts_what_history_no_longer_holds():
    with Publisher(hwm=10, history=50) as pub:
        sub = Subscriber(pub.address, pub.sync_address, hwm=10)
        sub.connect(timeout_s=10)
        for v in range(300):
            pub.publish(announcement(v))
        got = []
        while (rec := sub.recv(timeout_s=2)) is not None:
            got.append(rec.version)
        sub.close()
    assert got == sorted(set(got)) and got[-1] == 299  # in order, no duplicates, newest delivered
    assert len(got) + sub.lost == 300 and sub.lost > 0  # every missing message is counted
