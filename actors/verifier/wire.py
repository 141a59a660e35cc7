"""Framed msgpack messages between the trusted verifier and its jailed compile-stage processes.

    frame := u32 length | msgpack body

The direction that matters is child -> parent: a capture process runs candidate code. So `recv`
checks the announced length against what the receiver expects (`max_bytes`) before it allocates
anything, reads in bounded chunks (a peer that announces much and sends little costs nothing), and
decodes with msgpack's own limits: no pickle, no object hooks, nothing executed. Tensors never travel
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
    (n,) = _LEN.unpack(_read(sock, _LEN.size, deadline))
    if n > max_bytes:
        raise WireError(f"a message of {n} bytes is more than the {max_bytes} allowed here")
    payload = _read(sock, n, deadline)
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as err:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise WireError(f"undecodable message: {err}") from None


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
