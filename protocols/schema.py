"""The typed-record machinery behind every Kiln message.

A record is a keyword-only dataclass registered under its class name. Its fields are annotated with
a small vocabulary of wire types (int, float, bool, str, bytes, Literal, Optional, list, dict[str, _],
nested records, `Json` and arrays) so that one walk over the annotations both validates a record
before it is sent and rebuilds it, validated, from untrusted bytes. Cross-field rules live in a
record's `check()`.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

import numpy as np


class ProtocolError(ValueError):
    """A message could not be encoded or decoded; the text says what was wrong and where."""


class JsonValue:
    """Marker type: a JSON-like value (None, bool, int, float, str, list, dict with str keys)."""


JsonDict = dict[str, JsonValue]


@dataclass(frozen=True)
class ArraySpec:
    """Constraints on an array field: allowed dtype kinds (numpy `dtype.kind` letters) and rank."""

    kinds: str  # e.g. "iu" for integer arrays, "f" for float arrays, "b" for bool
    ndim: int | None = 1


IntArray = Annotated[np.ndarray, ArraySpec("iu")]
FloatArray = Annotated[np.ndarray, ArraySpec("f")]
MaskArray = Annotated[np.ndarray, ArraySpec("bu")]
AnyArray = Annotated[np.ndarray, ArraySpec("biuf", None)]

MAX_DEPTH = 32  # nesting depth of Json values; deeper input is refused, not recursed into

REGISTRY: dict[str, type[Record]] = {}


class Record:
    """Base of every message record. Subclasses are created with the `@record` decorator."""

    SCHEMA: ClassVar[int] = 1

    @property
    def schema(self) -> int:
        return self.SCHEMA

    def check(self) -> None:
        """Cross-field validation; raise ValueError with a readable message when violated."""


def record(cls=None, *, schema: int = 1):
    """Make `cls` a registered, slotted, keyword-only dataclass record with schema version `schema`."""

    def wrap(c):
        if c.__name__ in REGISTRY:
            raise TypeError(f"record {c.__name__} registered twice")
        c = dataclass(c, kw_only=True, slots=True, eq=True)
        c.SCHEMA = schema
        REGISTRY[c.__name__] = c
        _FIELDS[c] = None  # resolved lazily: annotations may name records defined later
        return c

    return wrap if cls is None else wrap(cls)


_FIELDS: dict[type, list[tuple[str, Any]] | None] = {}


def fields_of(cls: type) -> list[tuple[str, Any]]:
    """(name, resolved type) pairs of a record class, cached."""
    resolved = _FIELDS.get(cls)
    if resolved is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        resolved = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
        _FIELDS[cls] = resolved
    return resolved


# ---------------------------------------------------------------------------------------------
# Validation walk. `convert(value, tp, path)` returns the value in its Python form (records rebuilt
# from maps, floats from ints) or raises ProtocolError naming the path. Used on encode (records in,
# records out) and on decode (plain msgpack objects in, records out).


def _is_torch_tensor(value) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _type_name(value) -> str:
    if isinstance(value, np.ndarray):
        return f"array[{value.dtype}]"
    return type(value).__name__


def convert(value, tp, path: str):
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is JsonValue:
        _check_json(value, path, 0)
        return value
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        spec = next((m for m in meta if isinstance(m, ArraySpec)), None)
        if spec is not None:
            return _check_array(value, spec, path)
        return convert(value, base, path)
    if origin is Literal:
        options = typing.get_args(tp)
        if not isinstance(value, str) or value not in options:
            raise ProtocolError(f"{path}: expected one of {list(options)}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ProtocolError(f"{path}: must not be null")
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return convert(value, opt, path)
            except ProtocolError as err:
                errors.append(str(err))
        raise ProtocolError(errors[0] if len(errors) == 1 else f"{path}: matches none of {errors}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{path}: expected a list, got {_type_name(value)}")
        return [convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ProtocolError(f"{path}: expected a map, got {_type_name(value)}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(f"{path}: map keys must be strings, got {_type_name(k)}")
            out[k] = convert(v, val_tp, f"{path}[{k!r}]")
        return out
    if isinstance(tp, type) and issubclass(tp, Record):
        return _convert_record(value, tp, path)
    if tp is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise ProtocolError(f"{path}: expected bool, got {_type_name(value)}")
    if tp is int:
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            return int(value)
        raise ProtocolError(f"{path}: expected int, got {_type_name(value)}")
    if tp is float:
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            return float(value)
        raise ProtocolError(f"{path}: expected float, got {_type_name(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ProtocolError(f"{path}: expected str, got {_type_name(value)}")
    if tp is bytes:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        raise ProtocolError(f"{path}: expected bytes, got {_type_name(value)}")
    raise TypeError(f"{path}: unsupported wire type {tp!r}")  # a bug in a record definition


def _convert_record(value, cls: type[Record], path: str) -> Record:
    if isinstance(value, cls):
        items = {name: getattr(value, name) for name, _ in fields_of(cls)}
    elif isinstance(value, dict):
        items = value
        unknown = set(items) - {name for name, _ in fields_of(cls)}
        if unknown:
            raise ProtocolError(f"{path}: unknown field(s) {sorted(map(str, unknown))} for {cls.__name__}")
    else:
        raise ProtocolError(f"{path}: expected a {cls.__name__} map, got {_type_name(value)}")
    kwargs = {}
    for name, tp in fields_of(cls):
        if name not in items:
            raise ProtocolError(f"{path}.{name}: missing field of {cls.__name__}")
        kwargs[name] = convert(items[name], tp, f"{path}.{name}")
    rec = cls(**kwargs)
    try:
        rec.check()
    except ValueError as err:
        raise ProtocolError(f"{path}: invalid {cls.__name__}: {err}") from None
    return rec


def _check_json(value, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"{path}: JSON value nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(f"{path}: JSON keys must be strings, got {_type_name(k)}")
            _check_json(v, f"{path}[{k!r}]", depth + 1)
        return
    raise ProtocolError(f"{path}: not a JSON value: {_type_name(value)}")


def _check_array(value, spec: ArraySpec, path: str):
    if _is_torch_tensor(value):
        if value.device.type != "cpu":
            raise ProtocolError(f"{path}: only CPU tensors travel in messages, got {value.device}")
        kind = "f" if value.dtype.is_floating_point else ("b" if value.dtype == sys.modules["torch"].bool else "i")
        if value.dtype.is_complex:
            kind = "c"
        ndim = value.dim()
    elif isinstance(value, np.ndarray):
        kind, ndim = value.dtype.kind, value.ndim
    else:
        raise ProtocolError(f"{path}: expected an array, got {_type_name(value)}")
    if kind not in spec.kinds:
        raise ProtocolError(f"{path}: dtype {value.dtype} not allowed here (kinds {spec.kinds!r})")
    if spec.ndim is not None and ndim != spec.ndim:
        raise ProtocolError(f"{path}: expected a {spec.ndim}-D array, got shape {tuple(value.shape)}")
    return value
