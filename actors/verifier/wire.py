"""Framed msgpack messages between the trusted verifier and its jailed compile-stage processes.

    frame := u32 length | msgpack body

The direction that matters is child -> parent: a capture process runs candidate code. So `recv`
checks the announced length against what the receiver expects (`max_bytes`) before it allocates
anything, reads in bounded chunks (a peer that announces much and sends little costs nothing),
counts the objects the body would decode to before decoding it (`max_items`: a megabyte of empty
arrays would otherwise decode to 64 MB of Python objects), and decodes with msgpack's own limits:
no pickle, no object hooks, nothing executed. Tensors never travel
here (the execution sandbox's outputs go through its I/O arena: executor.py).
"""

from __future__ import annotations

import socket
import struct
import time

import msgpack

_LEN = struct.Struct("<I")
DEFAULT_MAX = 1 << 20
CHUNK = 1 << 16
MAX_ITEMS = 1 << 16  # objects one message may decode to (its strings may be long: each is one object)


class WireError(RuntimeError):
    """The peer sent something malformed, too large, or nothing at all before the deadline."""


class PeerClosed(WireError):
    """The peer closed the connection (for a child: it exited or crashed)."""


class PeerTimeout(WireError):
    """No complete message arrived before the deadline."""


def encode(body) -> bytes:
    try:
        payload = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise WireError(f"cannot send: {err}") from None
    return _LEN.pack(len(payload)) + payload


def send(sock: socket.socket, body) -> None:
    sock.sendall(encode(body))


def recv(sock: socket.socket, deadline: float | None = None, max_bytes: int = DEFAULT_MAX):
    """Read one message of at most `max_bytes`. `deadline` is a time.monotonic() value; None waits forever."""
    return recv_counted(sock, deadline, max_bytes)[0]


def recv_counted(
    sock: socket.socket, deadline: float | None = None, max_bytes: int = DEFAULT_MAX, max_items: int = MAX_ITEMS
) -> tuple[object, int]:
    """(one message, the bytes it took on the wire): at most `max_bytes` of body decoding to at most
    `max_items` objects."""
    (n,) = _LEN.unpack(_read(sock, _LEN.size, deadline))
    if n > max_bytes:
        raise WireError(f"a message of {n} bytes is more than the {max_bytes} allowed here")
    payload = _read(sock, n, deadline)
    items = count_items(payload, max_items)
    if items > max_items:
        raise WireError(f"a message of more than {max_items} objects")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True), _LEN.size + n
    except Exception as err:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise WireError(f"undecodable message: {err}") from None


# msgpack's type bytes: (first, last, length of the size field or payload, what follows: 0 nothing,
# 1 that many payload bytes, 2 that many items, 3 twice that many items (a map), 4 a fixed payload).
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_FIXED.update({0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17})
_SIZED = {0xC4: (1, 1), 0xC5: (2, 1), 0xC6: (4, 1), 0xD9: (1, 1), 0xDA: (2, 1), 0xDB: (4, 1)}
_SIZED.update({0xC7: (1, 5), 0xC8: (2, 5), 0xC9: (4, 5), 0xDC: (2, 2), 0xDD: (4, 2), 0xDE: (2, 3), 0xDF: (4, 3)})


def count_items(data: bytes, limit: int) -> int:
    """How many objects the msgpack `data` holds, walked from its type bytes (no object is made);
    stops counting past `limit` (so the walk costs at most `limit` steps). Malformed data counts
    what it can: the decoder rejects it afterwards."""
    pos, pending, count, n = 0, 1, 0, len(data)
    while pending and pos < n and count <= limit:
        pending -= 1
        count += 1
        b = data[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0:
            continue
        if 0x80 <= b <= 0x8F:
            pending += 2 * (b & 0x0F)
        elif 0x90 <= b <= 0x9F:
            pending += b & 0x0F
        elif 0xA0 <= b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width, kind = _SIZED[b]
            size = int.from_bytes(data[pos : pos + width], "big")
            pos += width
            if kind == 1:
                pos += size
            elif kind == 5:  # ext: a type byte, then the payload
                pos += 1 + size
            else:
                pending += size * (2 if kind == 3 else 1)
        else:
            break  # 0xC1 is never used: nothing valid follows, and the decoder says so
    return count


def _read(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """Exactly `n` bytes, allocated as they arrive (never more than one chunk ahead of the data)."""
    parts: list[bytes] = []
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
            chunk = sock.recv(min(CHUNK, n - got))
        except TimeoutError:
            raise PeerTimeout("no complete message before the deadline") from None
        except OSError as err:
            raise PeerClosed(f"connection lost: {err}") from None
        if not chunk:
            raise PeerClosed("the peer closed the connection")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
