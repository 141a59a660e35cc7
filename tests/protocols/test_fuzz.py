"""10,000+ random, truncated and mutated frames: `decode` raises only ProtocolError, and live PULL
and ROUTER channels count and drop them and keep serving valid messages."""

import random

import msgpack
import numpy as np
import pytest
import zmq

import protocols as P
from protocols.channels import PullChannel, ReplyServer, RequestClient

N_FRAMES = 10_000


def valid_records():
    task = P.Task(
        task_id="level1/relu",
        kind="kernel",
        kernel=P.KernelSpec(name="relu", reference="class Model: ...", backend="cpu", level=1),
    )
    turn = P.Turn(
        prompt_ids=np.arange(40, dtype=np.int32),
        response_ids=np.arange(900, dtype=np.int32),
        logprobs=np.zeros(900, np.float32),
        versions=np.ones(900, np.int32),
        finish_reason="stop",
    )
    return [
        P.TaskRequest(actor_id="rollout-0"),
        P.TaskReply(status="task", task=task, group_id="g1", group_size=4),
        P.Episode(episode_id="e1", task=task, group_id="g1", sample_index=0, turns=[turn], rewards=[-1.0]),
        P.Metrics(source="learner", step=3, ts=1.5, values={"loss": 0.25}),
    ]


def mutated_frames(rng: random.Random, n: int):
    """Frames of five kinds: random bytes, truncations, bit flips, byte splices, and well-formed
    msgpack with the wrong structure."""
    blobs = [P.encode(r) for r in valid_records()]
    headers = [P.encode_parts(r)[0] for r in valid_records()]
    for i in range(n):
        kind = i % 5
        if kind == 0:
            yield rng.randbytes(rng.randint(0, 300))
        elif kind == 1:
            b = rng.choice(blobs)
            yield b[: rng.randint(0, len(b) - 1)]
        elif kind == 2:
            b = bytearray(rng.choice(blobs + headers))
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            yield bytes(b)
        elif kind == 3:
            b = bytearray(rng.choice(blobs))
            at = rng.randrange(len(b))
            b[at : at + rng.randint(1, 16)] = rng.randbytes(rng.randint(0, 16))
            yield bytes(b)
        else:
            junk = rng.choice([None, 1, "x", [], {}, [1, 2], {"a": [1]}, b"\x00", 2**63, -1.5])
            yield msgpack.packb(
                rng.choice(
                    [
                        junk,
                        ["kiln"],
                        ["kiln", "Episode", 1, junk],
                        ["kiln", "TaskRequest", junk, {"actor_id": "a"}],
                        ["kiln", junk, 1, {}],
                        ["kiln", "TaskReply", 1, {"status": "task", "task": junk}],
                    ]
                )
            )


def test_decode_raises_only_protocol_error():
    rng = random.Random(1234)
    outcomes = {"error": 0, "decoded": 0}
    for frame in mutated_frames(rng, N_FRAMES):
        for decoder in (P.decode, lambda f: P.decode_parts([f])):
            try:
                rec = decoder(frame)
            except P.ProtocolError as err:
                assert str(err)  # every error says something
                outcomes["error"] += 1
            else:
                assert isinstance(rec, P.Record)  # a mutation that still decodes is a valid record
                rec.check()
                outcomes["decoded"] += 1
    assert outcomes["error"] > N_FRAMES  # nearly all of the 2 x 10,000 attempts are rejected


@pytest.fixture
def raw():
    ctx = zmq.Context.instance()
    socks = []

    def make(kind, address):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        socks.append(s)
        return s

    yield make
    for s in socks:
        s.close(0)


def test_pull_channel_survives_garbage(raw):
    rng = random.Random(7)
    with PullChannel() as pull:
        push = raw(zmq.PUSH, pull.address)
        frames = list(mutated_frames(rng, N_FRAMES))
        decoded = []
        for start in range(0, N_FRAMES, 250):  # in rounds, so no queue reaches its high-water mark
            for f in frames[start : start + 250]:
                push.send_multipart([f] + ([rng.randbytes(5)] if rng.random() < 0.1 else []))
            while (rec := pull.recv(timeout_s=0.05)) is not None:
                decoded.append(rec)  # the few mutations that still decode are valid records
        good = P.Metrics(source="after-garbage", step=1, ts=0.0, values={})
        push.send_multipart(P.encode_parts(good))
        assert pull.recv(timeout_s=20) == good, "PULL channel stopped serving"
        assert all(isinstance(r, P.Record) for r in decoded)
        assert pull.stats.dropped + pull.stats.received == N_FRAMES + 1
        assert pull.stats.dropped > N_FRAMES * 0.9


def test_router_channel_answers_garbage_and_keeps_serving(raw):
    rng = random.Random(11)
    with ReplyServer() as server:
        dealer = raw(zmq.DEALER, server.address)
        sent = errors = 0
        frames = list(mutated_frames(rng, N_FRAMES))
        for start in range(0, N_FRAMES, 250):  # in rounds, so no queue reaches its high-water mark
            for f in frames[start : start + 250]:
                if rng.random() < 0.1:
                    dealer.send(f)  # no correlation frame at all
                else:
                    dealer.send_multipart([rng.randbytes(16), f])
                sent += 1
            # Undecodable requests were answered with ErrorReply (when they had an id); the few
            # mutations that still decode are valid requests, which the test answers.
            while (req := server.recv(timeout_s=0.1)) is not None:
                server.reply(req, P.EpisodeAck(episode_id="x", status="rejected", reason="fuzz"))
            while dealer.poll(100):
                errors += isinstance(P.decode_parts(dealer.recv_multipart()[1:]), P.ErrorReply)
        assert errors > N_FRAMES * 0.8
        assert server.stats.dropped + server.stats.received == sent
        # A well-behaved client is served after the storm.
        import threading

        stop = threading.Event()
        t = threading.Thread(
            target=server.serve, args=(lambda r: P.EpisodeAck(episode_id=r.actor_id, status="stored"), stop)
        )
        t.start()
        with RequestClient(server.address, timeout_s=5) as client:
            assert client.request(P.TaskRequest(actor_id="ok")).episode_id == "ok"
        stop.set()
        t.join()
