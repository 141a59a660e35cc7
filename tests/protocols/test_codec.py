"""The codec: every record round-trips, arrays decode zero-copy, and bad bytes raise ProtocolError only."""

import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import protocols as P
from protocols.schema import REGISTRY
from tests.helpers.strategies import record_strategy, same

ALL_RECORDS = sorted(REGISTRY.values(), key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", ALL_RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_record_round_trips(cls, data):
    rec = data.draw(record_strategy(cls))
    assert rec.schema == cls.SCHEMA
    assert same(P.decode(P.encode(rec)), rec)
    assert same(P.decode_parts(P.encode_parts(rec)), rec)


def turn(n=5000, lp=None):
    return P.Turn(
        prompt_ids=np.arange(7, dtype=np.int32),
        response_ids=np.arange(n, dtype=np.int64),
        logprobs=np.linspace(-3, 0, n, dtype=np.float32) if lp is None else lp,
        versions=np.full(n, 3, np.int32),
        finish_reason="length",
    )


def test_large_arrays_decode_zero_copy_and_read_only():
    blob = P.encode(turn())
    out = P.decode(blob)
    assert np.shares_memory(out.response_ids, np.frombuffer(blob, np.uint8))
    assert not out.response_ids.flags.writeable  # a view of the received bytes: copy before writing
    parts = P.encode_parts(turn())
    assert len(parts) == 4  # header + three arrays above the inline threshold (prompt ids ride inline)


def test_torch_tensors_travel_as_tensors_including_bfloat16():
    lp = torch.linspace(-5, 0, 3000).to(torch.bfloat16)
    out = P.decode(P.encode(turn(3000, lp=lp)))
    assert isinstance(out.logprobs, torch.Tensor) and out.logprobs.dtype == torch.bfloat16
    assert torch.equal(out.logprobs, lp)
    parts = P.encode_parts(turn(3000, lp=torch.ones(3000)))
    writable = [bytearray(memoryview(p)) for p in parts]  # a writable buffer: shared, not copied
    t = P.decode_parts(writable).logprobs
    assert t.data_ptr() == np.frombuffer(writable[2], np.uint8).ctypes.data


def test_encode_validates_before_sending():
    bad = P.Turn(
        prompt_ids=np.zeros(2, np.int32),
        response_ids=np.zeros(3, np.int32),
        logprobs=np.zeros(2, np.float32),
        versions=np.zeros(3, np.int32),
        finish_reason="stop",
    )
    with pytest.raises(P.ProtocolError, match="differ in length"):
        P.encode(bad)
    with pytest.raises(P.ProtocolError, match=r"Turn.logprobs: dtype int32 not allowed"):
        P.encode(turn(lp=np.zeros(5000, np.int32)))
    with pytest.raises(P.ProtocolError, match="Task: invalid Task"):
        P.encode(P.Task(task_id="t", kind="kernel"))  # a kernel task without its KernelSpec
    with pytest.raises(P.ProtocolError, match="object"):
        P.encode(turn(lp=np.array([object()] * 5000)))


def header(name, schema, body):
    return [msgpack.packb(["kiln", name, schema, body])]


@pytest.mark.parametrize(
    "parts, message",
    [
        ([], "empty message"),
        ([b"\xc1"], "bad msgpack header"),
        (header("Nope", 1, {}), "unknown record type 'Nope'"),
        (header("TaskRequest", 2, {"actor_id": "a"}), "TaskRequest schema version 2 not supported"),
        (header("TaskRequest", 1, {}), "TaskRequest.actor_id: missing field"),
        (header("TaskRequest", 1, {"actor_id": 5}), "TaskRequest.actor_id: expected str, got int"),
        (header("TaskRequest", 1, {"actor_id": "a", "x": 1}), r"unknown field\(s\) \['x'\]"),
        (header("EpisodeAck", 1, {"episode_id": "e", "status": "maybe", "reason": ""}), "expected one of"),
        (
            [
                msgpack.packb(
                    [
                        "kiln",
                        "Turn",
                        1,
                        {
                            "prompt_ids": msgpack.ExtType(1, msgpack.packb(["int32", [10**12], 1])),
                            "response_ids": [],
                            "logprobs": [],
                            "versions": [],
                            "finish_reason": "stop",
                            "text": "",
                            "result": None,
                        },
                    ]
                )
            ],
            "absent or already used",
        ),
        (
            [
                msgpack.packb(
                    [
                        "kiln",
                        "Turn",
                        1,
                        {
                            "prompt_ids": msgpack.ExtType(1, msgpack.packb(["int32", [4], b"\x00" * 3])),
                        },
                    ]
                )
            ],
            "needs 16 bytes, buffer has 3",
        ),
        (
            [
                msgpack.packb(
                    ["kiln", "Turn", 1, {"prompt_ids": msgpack.ExtType(1, msgpack.packb(["object", [1], b"x"]))}]
                )
            ],
            "dtype 'object' not allowed",
        ),
        (P.encode_parts(P.TaskRequest(actor_id="a")) + [b"extra"], "1 out-of-band buffers sent, 0 referenced"),
    ],
)
def test_decode_says_what_was_wrong(parts, message):
    with pytest.raises(P.ProtocolError, match=message):
        P.decode_parts(parts)


def test_container_framing_errors():
    blob = P.encode(turn())
    cases = {
        b"": "truncated frame: 0 bytes",
        b"\x00garbage": "bad magic",
        blob[:100]: "truncated frame: part",
        blob + b"\x00": "trailing bytes",
        b"KLN\x01" + (2**32 - 1).to_bytes(4, "little"): "declares 4294967295 parts",
    }
    for data, message in cases.items():
        with pytest.raises(P.ProtocolError, match=message):
            P.decode(data)
    with pytest.raises(P.ProtocolError, match="expected bytes"):
        P.decode("not bytes")


def test_issue_one_liner():
    out = subprocess.run(
        [sys.executable, "-c", "import protocols; protocols.decode(b'\\x00garbage')"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1 and "protocols.schema.ProtocolError: not a Kiln frame" in out.stderr


def test_deeply_nested_json_is_refused_not_recursed():
    deep = "x"
    for _ in range(100):
        deep = [deep]
    task = {"task_id": "t", "kind": "echo", "split": "train", "kernel": None, "payload": {"a": deep}, "repair": None}
    with pytest.raises(P.ProtocolError, match="nested deeper"):
        P.decode_parts(header("Task", 1, task))
