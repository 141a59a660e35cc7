"""msgpack codec for Kiln records.

A record encodes to *parts*: part 0 is a msgpack header `["kiln", record name, schema, fields]`;
arrays larger than INLINE_BYTES travel as further parts (out of band), referenced from the header by
a msgpack ext value (dtype, shape, part index). Channels send the parts as one ZMQ multipart message
without copying; `encode`/`decode` wrap them in one byte string:

    b"KLN\\x01" | u32 part count | u64 length per part | parts, each starting on a 16-byte boundary

Decoding validates everything (framing, record name, schema version, every field's type, each
record's own `check()`) and raises only `ProtocolError`. Decoded arrays are read-only views of the
received bytes (zero-copy); copy one before writing to it.
"""

from __future__ import annotations

import struct
import sys

import msgpack
import numpy as np

from protocols.schema import REGISTRY, ProtocolError, Record, convert, fields_of

HEADER_TAG = "kiln"
CONTAINER_MAGIC = b"KLN\x01"
ALIGN = 16
INLINE_BYTES = 2048  # arrays up to this size ride inside the header; larger ones go out of band
MAX_PARTS = 1 << 16
MAX_NDIM = 32
EXT_NUMPY, EXT_TORCH = 1, 2
DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bfloat16",
    }
)


# ------------------------------------------------------------------------------------------ encode


def encode_parts(rec: Record) -> list:
    """Validate `rec` and return its wire parts (header bytes, then out-of-band array buffers)."""
    if not isinstance(rec, Record) or type(rec).__name__ not in REGISTRY:
        raise ProtocolError(f"not a registered record: {type(rec).__name__}")
    cls = type(rec)
    clean = convert(rec, cls, cls.__name__)
    buffers: list = []

    def default(obj):
        if isinstance(obj, Record):
            return {name: getattr(obj, name) for name, _ in fields_of(type(obj))}
        if isinstance(obj, np.ndarray):
            return _array_ext(obj, EXT_NUMPY, buffers)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return _tensor_ext(obj, buffers)
        raise TypeError(f"cannot encode {type(obj).__name__}")

    try:
        header = msgpack.packb([HEADER_TAG, cls.__name__, cls.SCHEMA, clean], default=default)
    except (TypeError, ValueError, OverflowError) as err:
        raise ProtocolError(f"{cls.__name__}: cannot encode: {err}") from None
    return [header, *buffers]


def _array_ext(arr: np.ndarray, code: int, buffers: list, dtype_name: str | None = None):
    name = dtype_name or arr.dtype.name
    if name not in DTYPES:
        raise ProtocolError(f"array dtype {arr.dtype} cannot travel (allowed: {sorted(DTYPES)})")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    if arr.nbytes <= INLINE_BYTES:
        ref = arr.tobytes()
    else:
        buffers.append(arr.reshape(-1).view(np.uint8))
        ref = len(buffers)  # part index; part 0 is the header
    return msgpack.ExtType(code, msgpack.packb([name, list(arr.shape), ref]))


def _tensor_ext(t, buffers: list):
    torch = sys.modules["torch"]
    if t.device.type != "cpu":
        raise ProtocolError(f"only CPU tensors travel in messages, got one on {t.device}")
    t = t.detach().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
        return _array_ext(t.view(torch.int16).numpy(), EXT_TORCH, buffers, dtype_name=name)
    return _array_ext(t.numpy(), EXT_TORCH, buffers, dtype_name=name)


def encode(rec: Record) -> bytes:
    """Encode a record into one self-delimiting byte string."""
    parts = encode_parts(rec)
    lengths = [memoryview(p).nbytes for p in parts]
    head = CONTAINER_MAGIC + struct.pack(f"<I{len(parts)}Q", len(parts), *lengths)
    pieces, offset = [head], len(head)
    for part, n in zip(parts, lengths, strict=True):
        pad = -offset % ALIGN
        pieces.append(b"\x00" * pad)
        pieces.append(part)
        offset += pad + n
    return b"".join(pieces)


# ------------------------------------------------------------------------------------------ decode


def decode(data) -> Record:
    """Decode one byte string made by `encode`. Raises only ProtocolError."""
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise ProtocolError(f"expected bytes, got {type(data).__name__}") from None
    return decode_parts(_split_container(view))


def _split_container(view: memoryview) -> list[memoryview]:
    total = view.nbytes
    if total < 8:
        raise ProtocolError(f"truncated frame: {total} bytes, a frame has at least 8")
    if view[:4] != CONTAINER_MAGIC:
        raise ProtocolError(f"not a Kiln frame: bad magic {bytes(view[:4])!r}")
    (count,) = struct.unpack_from("<I", view, 4)
    if count < 1 or count > MAX_PARTS or 8 + 8 * count > total:
        raise ProtocolError(f"frame declares {count} parts, impossible in {total} bytes")
    lengths = struct.unpack_from(f"<{count}Q", view, 8)
    parts, offset = [], 8 + 8 * count
    for i, n in enumerate(lengths):
        offset += -offset % ALIGN
        if n > total - offset:
            raise ProtocolError(f"truncated frame: part {i} declares {n} bytes, {max(total - offset, 0)} remain")
        parts.append(view[offset : offset + n])
        offset += n
    if offset != total:
        raise ProtocolError(f"frame has {total - offset} trailing bytes after its last part")
    return parts


def decode_parts(parts) -> Record:
    """Decode a record from its wire parts (buffers). Raises only ProtocolError."""
    try:
        return _decode_parts(parts)
    except ProtocolError:
        raise
    except Exception as err:  # noqa: BLE001 - the contract: nothing but ProtocolError escapes, whatever the bytes
        raise ProtocolError(f"undecodable message: {type(err).__name__}: {err}") from None


def _decode_parts(parts) -> Record:
    if not parts:
        raise ProtocolError("empty message: no header part")
    views = [memoryview(p).cast("B") for p in parts]
    used: set[int] = set()

    def ext_hook(code, data):
        if code not in (EXT_NUMPY, EXT_TORCH):
            raise ProtocolError(f"unknown ext type {code}")
        return _array_from_ext(code, data, views, used)

    try:
        top = msgpack.unpackb(views[0], ext_hook=ext_hook, raw=False, strict_map_key=True)
    except ProtocolError:
        raise
    except (ValueError, msgpack.UnpackException, TypeError) as err:
        raise ProtocolError(f"bad msgpack header: {type(err).__name__}: {err}") from None
    if not (isinstance(top, list) and len(top) == 4 and top[0] == HEADER_TAG):
        raise ProtocolError("header is not a Kiln record header ['kiln', name, schema, fields]")
    _, name, schema, body = top
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown record type {name!r}")
    if schema != cls.SCHEMA or isinstance(schema, bool):
        raise ProtocolError(f"{name} schema version {schema!r} not supported (this build speaks {cls.SCHEMA})")
    if len(used) != len(views) - 1:
        raise ProtocolError(f"{len(views) - 1} out-of-band buffers sent, {len(used)} referenced")
    return convert(body, cls, name)


def _array_from_ext(code: int, data: bytes, views: list[memoryview], used: set[int]):
    meta = msgpack.unpackb(data, raw=False)
    if not (isinstance(meta, list) and len(meta) == 3):
        raise ProtocolError("array ext must hold [dtype, shape, data]")
    name, shape, ref = meta
    if name not in DTYPES:
        raise ProtocolError(f"array dtype {name!r} not allowed")
    if name == "bfloat16" and code != EXT_TORCH:
        raise ProtocolError("bfloat16 arrays travel only as torch tensors")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"bad array shape {shape!r}")
    if isinstance(ref, bytes):
        buf = memoryview(ref)
    elif isinstance(ref, int) and not isinstance(ref, bool) and 1 <= ref < len(views) and ref not in used:
        used.add(ref)
        buf = views[ref]
    else:
        raise ProtocolError(f"array refers to buffer {ref!r}, which is absent or already used")
    np_dtype = np.dtype("int16" if name == "bfloat16" else name)
    count = 1
    for d in shape:
        count *= d
    if count * np_dtype.itemsize != buf.nbytes:
        raise ProtocolError(f"array {name}{shape} needs {count * np_dtype.itemsize} bytes, buffer has {buf.nbytes}")
    arr = np.frombuffer(buf, dtype=np_dtype, count=count).reshape(shape)
    return arr if code == EXT_NUMPY else _tensor_from_array(arr, name, buf.readonly)


def _tensor_from_array(arr: np.ndarray, name: str, readonly: bool):
    import torch

    if readonly:  # torch tensors are writable by contract: share memory only when the buffer is
        arr = arr.copy()
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if name == "bfloat16" else t
