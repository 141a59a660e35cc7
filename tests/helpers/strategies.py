"""Hypothesis strategies for every Kiln record, derived from the records' annotations.

Records with cross-field rules (`check()`) get hand-written strategies that satisfy them; every
other record is built field by field from its wire types. `same(a, b)` compares records that hold
arrays (dataclass equality cannot).
"""

from __future__ import annotations

import typing

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import protocols as P
from protocols.schema import ArraySpec, JsonValue, Record, fields_of

_DTYPES = {
    "i": ["int32", "int64", "int8"],
    "u": ["uint8", "uint16"],
    "f": ["float32", "float64", "float16"],
    "b": ["bool"],
}
text = st.text(max_size=12)
ident = st.text(min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=8,
)


def array(spec: ArraySpec, size=None):
    dtypes = [d for k in spec.kinds for d in _DTYPES.get(k, [])]
    shape = (size,) if size is not None else hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=700)
    return st.sampled_from(dtypes).flatmap(lambda d: hnp.arrays(np.dtype(d), shape))


def for_type(tp):
    origin = typing.get_origin(tp)
    if tp is JsonValue:
        return json_values
    if origin is typing.Annotated:
        base, *meta = typing.get_args(tp)
        spec = next((m for m in meta if isinstance(m, ArraySpec)), None)
        return array(spec) if spec else for_type(base)
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin in (typing.Union, __import__("types").UnionType):
        return st.one_of(*[st.none() if a is type(None) else for_type(a) for a in typing.get_args(tp)])
    if origin is list:
        return st.lists(for_type(typing.get_args(tp)[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(text, for_type(typing.get_args(tp)[1]), max_size=3)
    if isinstance(tp, type) and issubclass(tp, Record):
        return record_strategy(tp)
    return {
        int: st.integers(-(2**63), 2**63 - 1),
        float: st.floats(allow_nan=False),
        bool: st.booleans(),
        str: text,
        bytes: st.binary(max_size=16),
    }[tp]


def generic(cls):
    return st.builds(cls, **{name: for_type(tp) for name, tp in fields_of(cls)})


@st.composite
def kernel_spec(draw):
    return P.KernelSpec(
        name=draw(text),
        reference=draw(ident.filter(str.strip)),
        backend=draw(st.sampled_from(["cuda", "cpu", "musa"])),
        level=draw(st.integers(0, 9)),
        source_path=draw(text),
    )


@st.composite
def task(draw):
    kernel = draw(st.booleans())
    return P.Task(
        task_id=draw(ident),
        kind="kernel" if kernel else draw(ident.filter(lambda k: k != "kernel")),
        split=draw(st.sampled_from(["train", "val"])),
        kernel=draw(kernel_spec()) if kernel else None,
        payload=draw(st.dictionaries(text, json_values, max_size=3)),
        repair=draw(st.none() | generic(P.RepairContext)),
    )


@st.composite
def task_reply(draw):
    status = draw(st.sampled_from(["task", "wait", "stop"]))
    has = status == "task"
    return P.TaskReply(
        status=status,
        task=draw(task()) if has else None,
        group_id=draw(ident) if has else "",
        group_size=draw(st.integers(1, 64)) if has else 0,
        retry_after_s=draw(st.floats(0, 60)),
    )


@st.composite
def verify_result(draw):
    passed = draw(st.booleans())
    return P.VerifyResult(
        request_id=draw(text),
        task_id=draw(text),
        passed=passed,
        stage=draw(st.sampled_from(P.Stage.__args__)),
        error_class=None if passed else draw(st.sampled_from(P.ERROR_CLASSES)),
        q=draw(st.floats(0, 1)),
        score=draw(st.floats(-1, 3)),
        speedup_eager=draw(st.none() | st.floats(0, 100)),
        speedup_compile=draw(st.none() | st.floats(0, 100)),
        feedback=draw(text),
        diagnostics=draw(st.dictionaries(text, json_values, max_size=3)),
        timings=draw(st.dictionaries(text, st.floats(0, 100), max_size=3)),
        source_hash=draw(text),
        cached=draw(st.booleans()),
    )


@st.composite
def turn(draw):
    n = draw(st.integers(0, 700))
    return P.Turn(
        prompt_ids=draw(array(ArraySpec("iu"))),
        response_ids=draw(array(ArraySpec("iu"), n)),
        logprobs=draw(array(ArraySpec("f"), n)),
        versions=draw(array(ArraySpec("iu"), n)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        text=draw(text),
        result=draw(st.none() | verify_result()),
    )


@st.composite
def episode(draw):
    turns = draw(st.lists(turn(), min_size=1, max_size=3))
    return P.Episode(
        episode_id=draw(ident),
        task=draw(task()),
        group_id=draw(ident),
        sample_index=draw(st.integers(0, 64)),
        turns=turns,
        rewards=draw(st.lists(st.floats(-1, 3), min_size=len(turns), max_size=len(turns))),
        is_retry=draw(st.booleans()),
        actor_id=draw(text),
    )


@st.composite
def train_batch(draw):
    lengths = draw(st.lists(st.integers(0, 300), max_size=5))
    n, s = sum(lengths), len(lengths)
    return P.TrainBatch(
        version=draw(st.integers(0, 2**31)),
        episode_ids=draw(st.lists(text, max_size=5)),
        tokens=draw(array(ArraySpec("iu"), n)),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        loss_mask=draw(array(ArraySpec("bu"), n)),
        behaviour_logprobs=draw(array(ArraySpec("f"), n)),
        advantages=draw(array(ArraySpec("f"), s)),
        versions=draw(array(ArraySpec("iu"), n)),
    )


@st.composite
def batch_reply(draw):
    status = draw(st.sampled_from(["batch", "wait", "stop"]))
    return P.BatchReply(
        status=status, batch=draw(train_batch()) if status == "batch" else None, retry_after_s=draw(st.floats(0, 60))
    )


@st.composite
def batch_request(draw):
    version = draw(st.integers(0, 2**31))
    return P.BatchRequest(learner_id=draw(text), version=version, discarded_above=draw(st.integers(-1, version - 1)))


@st.composite
def group_report(draw):
    n = draw(st.integers(0, 4))
    turns = [draw(st.integers(1, 3)) for _ in range(n)]
    return P.GroupReport(
        actor_id=draw(text),
        group_id=draw(text),
        task_id=draw(text),
        is_retry=draw(st.booleans()),
        turn_scores=[draw(st.lists(st.floats(-1, 3), min_size=t, max_size=t)) for t in turns],
        turn_passed=[draw(st.lists(st.booleans(), min_size=t, max_size=t)) for t in turns],
        stages=draw(st.lists(text, max_size=4)),
        error_classes=draw(st.lists(text, max_size=4)),
        source_hashes=draw(st.lists(text, max_size=4)),
        generated_tokens=draw(st.integers(0, 2**31)),
        seconds=draw(st.floats(0, 1e6)),
    )


@st.composite
def span(draw):
    start = draw(st.floats(0, 2e9))
    return P.Span(
        activity=draw(st.sampled_from(P.Activity.__args__)),
        start=start,
        end=start + draw(st.floats(0, 1e6)),
        units=draw(st.integers(0, 2**31)),
    )


@st.composite
def timeline(draw):
    return P.Timeline(actor_id=draw(text), spans=draw(st.lists(span(), max_size=4)))


CONSTRAINED = {
    P.Span: span,
    P.Timeline: timeline,
    P.KernelSpec: kernel_spec,
    P.Task: task,
    P.TaskReply: task_reply,
    P.VerifyResult: verify_result,
    P.Turn: turn,
    P.Episode: episode,
    P.TrainBatch: train_batch,
    P.BatchReply: batch_reply,
    P.BatchRequest: batch_request,
    P.GroupReport: group_report,
}


def record_strategy(cls):
    return CONSTRAINED[cls]() if cls in CONSTRAINED else generic(cls)


def same(a, b) -> bool:
    """Structural equality that understands arrays (dtype, shape and bytes must match)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, Record):
        return type(a) is type(b) and all(same(getattr(a, n), getattr(b, n)) for n, _ in fields_of(type(a)))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
