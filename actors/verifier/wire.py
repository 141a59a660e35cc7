"""Framed messages between the trusted verifier and a sandboxed execution child.

A message is a small msgpack header (plain maps, lists and scalars) plus raw tensor buffers that
follow it on the socket, so a 100 MB output crosses as one memcpy-sized read instead of a pickle.
The direction that matters is child -> parent: the child runs untrusted code, so the parent decodes
with `decode_untrusted`, which never executes anything (msgpack, no pickle), bounds every size
before reading it, and rebuilds tensors only from a fixed list of dtypes.

    frame := u64 header length | header (msgpack) | buffer 0 | buffer 1 | ...
    header := {"body": <value>, "buffers": [length, ...]}
    tensor (inside body) := {"__tensor__": buffer index, "dtype": name, "shape": [int, ...]}
    tuple  (inside body) := {"__tuple__": [value, ...]}
"""

from __future__ import annotations

import socket
import struct
import time

import msgpack
import torch

_LEN = struct.Struct("<Q")
_TB = torch._C.TensorBase
_numpy = _TB.numpy  # captured at import, before the sandbox's compute fence wraps Tensor.numpy
# torch.frombuffer, captured at import: the fence refuses it once a candidate is armed. Held in a
# tuple, not as a module attribute, so the fence's rebinding of module-level aliases leaves it be.
_ORIGINAL = (torch.frombuffer,)
MAX_HEADER = 16 << 20  # header bytes (tracebacks, op lists); tensors travel as buffers
MAX_DEPTH = 16

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(RuntimeError):
    """The peer sent something malformed, too large, or nothing at all before the deadline."""


class PeerClosed(WireError):
    """The peer closed the connection (for a child: it exited or crashed)."""


class PeerTimeout(WireError):
    """No complete message arrived before the deadline."""


# ------------------------------------------------------------------------------------- encode


def encode(body) -> list:
    """The frame parts of `body` (header first, then raw buffers as memoryviews)."""
    buffers: list = []
    tree = _pack(body, buffers, 0)
    header = msgpack.packb({"body": tree, "buffers": [b.nbytes for b in buffers]}, use_bin_type=True)
    return [_LEN.pack(len(header)) + header, *buffers]


def _pack(value, buffers: list, depth: int):
    if depth > MAX_DEPTH:
        raise WireError("message nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return _pack_tensor(value, buffers)
    if isinstance(value, tuple):
        return {"__tuple__": [_pack(v, buffers, depth + 1) for v in value]}
    if isinstance(value, list):
        return [_pack(v, buffers, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _pack(v, buffers, depth + 1) for k, v in value.items()}
    raise WireError(f"cannot send a {type(value).__name__}")


def _pack_tensor(t: torch.Tensor, buffers: list) -> dict:
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise WireError(f"tensors of dtype {t.dtype} cannot be sent")
    # Methods of the C base class: a candidate in the sending process cannot patch these. A copy on
    # the cpu: numpy() marks the storage it shares as not resizable, and the tensor is the candidate's.
    flat = _TB.reshape(_TB.contiguous(_TB.to(_TB.detach(t), "cpu")), (-1,))
    if t.device.type == "cpu":
        flat = _TB.clone(flat)
    raw = _TB.view(flat, torch.uint8) if _TB.numel(flat) else torch.empty(0, dtype=torch.uint8)
    buffers.append(memoryview(_numpy(raw)))
    return {"__tensor__": len(buffers) - 1, "dtype": name, "shape": list(t.shape)}


def send(sock: socket.socket, body) -> None:
    for part in encode(body):
        sock.sendall(part)


# ------------------------------------------------------------------------------------- decode


def recv(sock: socket.socket, deadline: float | None = None, max_bytes: int = 8 << 30):
    """Read one message. `deadline` is a time.monotonic() value; None waits forever."""
    (n,) = _LEN.unpack(_read(sock, _LEN.size, deadline))
    if n > MAX_HEADER:
        raise WireError(f"message header of {n} bytes exceeds {MAX_HEADER}")
    try:
        header = msgpack.unpackb(_read(sock, n, deadline), raw=False, strict_map_key=True,
                                 max_bin_len=MAX_HEADER, max_str_len=MAX_HEADER)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
        raise WireError(f"undecodable message header: {err}") from None
    if not isinstance(header, dict) or set(header) != {"body", "buffers"}:
        raise WireError("message header is not {body, buffers}")
    sizes = header["buffers"]
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise WireError("buffer sizes must be non-negative integers")
    if sum(sizes) > max_bytes:
        raise WireError(f"message carries {sum(sizes)} bytes of tensors, more than the {max_bytes} allowed")
    buffers = [_read(sock, s, deadline) for s in sizes]
    return _unpack(header["body"], buffers, 0)


def _read(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout("no complete message before the deadline")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise PeerTimeout("no complete message before the deadline") from None
        except OSError as err:
            raise PeerClosed(f"connection lost: {err}") from None
        if k == 0:
            raise PeerClosed("the peer closed the connection")
        got += k
    return buf


def _unpack(value, buffers: list, depth: int):
    if depth > MAX_DEPTH:
        raise WireError("message nested too deeply")
    if isinstance(value, list):
        return [_unpack(v, buffers, depth + 1) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return _unpack_tensor(value, buffers)
        if "__tuple__" in value:
            items = value["__tuple__"]
            if not isinstance(items, list):
                raise WireError("malformed tuple")
            return tuple(_unpack(v, buffers, depth + 1) for v in items)
        return {k: _unpack(v, buffers, depth + 1) for k, v in value.items()}
    return value


def _unpack_tensor(spec: dict, buffers: list) -> torch.Tensor:
    idx, name, shape = spec.get("__tensor__"), spec.get("dtype"), spec.get("shape")
    if not isinstance(idx, int) or not 0 <= idx < len(buffers):
        raise WireError("tensor refers to a missing buffer")
    if name not in DTYPES:
        raise WireError(f"tensor dtype {name!r} is not allowed")
    if not isinstance(shape, list) or len(shape) > 32 or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise WireError(f"bad tensor shape {shape!r}")
    dtype = DTYPES[name]
    numel = 1
    for s in shape:
        numel *= s
    raw = buffers[idx]
    if len(raw) != numel * dtype.itemsize:
        raise WireError(f"tensor of shape {shape} and dtype {name} needs {numel * dtype.itemsize} bytes, got {len(raw)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return _ORIGINAL[0](raw, dtype=torch.uint8).view(dtype).reshape(shape)
