"""ZMQ channels that carry Kiln records (docs/architecture.md).

Patterns:
* `PushChannel` -> `PullChannel`: one-way streams (metrics).
* `RequestClient` (DEALER) -> `ReplyServer` (ROUTER): request/reply with timeout and resend. A
  request carries a correlation id; the server keeps recent replies and answers a resent request
  from that cache instead of handling it twice, so resends are safe for any handler.
  `ReconnectingClient` is the client every actor uses to reach a peer that may restart: it looks the
  address up (in the run's registry) and follows the peer to its new address.
* `Publisher` (PUB) -> `Subscriber` (SUB) live in `protocols.announcements`: announcements with
  sequence numbers, a READY barrier and catch-up from the publisher's history, built on the socket
  wrapper (`_Channel`) defined here.

Every binding channel binds on an OS-chosen port (or a fresh ipc:// path) and exposes `.address`.
Every receiving channel counts, logs and drops a frame it cannot decode, and keeps serving; a
request/reply server also answers such a frame with an `ErrorReply` so the caller learns why.
All sockets close with linger 0.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from protocols.codec import decode_parts, encode_parts
from protocols.records import ErrorReply
from protocols.schema import ProtocolError, Record

log = logging.getLogger(__name__)

DEFAULT_HWM = 1000
_SEQ = struct.Struct("<Q")


class ChannelTimeout(TimeoutError):
    """No reply arrived within the timeout, after every resend."""


class RemoteError(RuntimeError):
    """The server answered a request with an ErrorReply."""


class NoServer(ChannelTimeout):
    """No server address is known yet (the peer has not registered); a caller treats it as a timeout."""


class ServerMoved(ChannelTimeout):
    """The server was replaced (restarted on a new address) while a request waited to be sent or
    answered: the old one will never answer."""


@dataclass
class ChannelStats:
    sent: int = 0
    received: int = 0
    dropped: int = 0  # frames that could not be decoded (or were stale/duplicate), counted and skipped
    resent: int = 0
    last_error: str = ""
    errors: collections.Counter = field(default_factory=collections.Counter)

    def drop(self, reason: str, detail: str) -> None:
        self.dropped += 1
        self.errors[reason] += 1
        self.last_error = detail


def bind_address(host: str = "127.0.0.1", transport: str = "tcp") -> str:
    """A bind address on an OS-chosen port (tcp) or a fresh socket path (ipc)."""
    if transport == "tcp":
        return f"tcp://{host}:*"
    if transport == "ipc":
        return f"ipc://{tempfile.gettempdir()}/kiln-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock"
    raise ValueError(f"unknown transport {transport!r} (tcp or ipc)")


class _Channel:
    def __init__(self, kind: int, *, hwm: int = DEFAULT_HWM, context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        self.sock = self._ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.stats = ChannelStats()
        self.address = ""

    def _bind(self, host: str, transport: str, advertise: str | None) -> str:
        self.sock.bind(bind_address(host, transport))
        addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise and transport == "tcp":  # bound on 0.0.0.0: tell peers a reachable host
            addr = f"tcp://{advertise}:{addr.rsplit(':', 1)[1]}"
        self.address = addr
        return addr

    def _recv_within(self, deadline: float | None):
        """The next multipart message, or None once the monotonic deadline passed."""
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return self.sock.recv_multipart(copy=False) if self._poll(left) else None

    def _poll(self, timeout_s: float | None) -> bool:
        ms = None if timeout_s is None else max(int(timeout_s * 1000), 0)
        return bool(self.sock.poll(ms, zmq.POLLIN))

    def _decode(self, frames, what: str) -> Record | None:
        try:
            rec = decode_parts(frames)
        except ProtocolError as err:
            self.stats.drop("decode", str(err))
            log.warning("%s: dropped undecodable frame: %s", what, err)
            return None
        self.stats.received += 1
        return rec

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------------- push / pull


class PushChannel(_Channel):
    def __init__(self, address: str, **kw):
        super().__init__(zmq.PUSH, **kw)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live peer, never to a dead address
        self.sock.connect(address)
        self.address = address

    def send(self, rec: Record, timeout_s: float | None = None) -> None:
        """Queue a record; blocks while the high-water mark is reached (up to `timeout_s`)."""
        parts = encode_parts(rec)
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise ChannelTimeout(f"push to {self.address}: peer not taking messages")
        self.sock.send_multipart(parts, copy=False)
        self.stats.sent += 1


class PullChannel(_Channel):
    def __init__(self, host: str = "127.0.0.1", transport: str = "tcp", advertise: str | None = None, **kw):
        super().__init__(zmq.PULL, **kw)
        self._bind(host, transport, advertise)

    def recv(self, timeout_s: float | None = None) -> Record | None:
        """The next valid record, or None when none arrived in time. Bad frames are skipped."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            frames = self._recv_within(deadline)
            if frames is None:
                return None
            rec = self._decode(frames, f"pull {self.address}")
            if rec is not None:
                return rec


# ------------------------------------------------------------------------------ request / reply


class RequestClient(_Channel):
    """DEALER side of request/reply: `request()` sends, waits, resends, and returns the reply.

    `address` may list several servers separated by commas (a verifier pool): the DEALER spreads
    requests over the connected ones, and a resend may go to another server."""

    def __init__(self, address: str, *, timeout_s: float = 5.0, retries: int = 3, **kw):
        super().__init__(zmq.DEALER, **kw)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no backlog of stale resends for a server that is down
        for one in filter(None, (a.strip() for a in address.split(","))):
            self.sock.connect(one)
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self._nonce = uuid.uuid4().bytes[:8]
        self._ids = itertools.count(1)

    def request(
        self,
        rec: Record,
        timeout_s: float | None = None,
        retries: int | None = None,
        *,
        moved: Callable[[], bool] | None = None,
        check_s: float = 1.0,
    ) -> Record:
        """`moved()`, asked every `check_s` while waiting, says the server was replaced (a restart on a
        new address): the wait ends at once with `ServerMoved` instead of at the timeout. That holds for
        both waits: for the reply, and for a connection to send on (a request made after the server
        died, while its address is still registered, would otherwise wait out the whole timeout for a
        connection that never comes back)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        retries = self.retries if retries is None else retries
        corr = self._nonce + _SEQ.pack(next(self._ids))
        parts = encode_parts(rec)
        for attempt in range(retries + 1):
            deadline = time.monotonic() + timeout_s
            if not self._send_within([corr, *parts], deadline, moved, check_s):
                continue  # no live connection to the server within this try
            if attempt:
                self.stats.resent += 1
            self.stats.sent += 1
            while (left := deadline - time.monotonic()) > 0:
                if not self._poll(left if moved is None else min(left, check_s)):
                    if moved is not None and time.monotonic() < deadline and moved():
                        raise ServerMoved(f"{self.address} was replaced while a {type(rec).__name__} waited")
                    continue
                frames = self.sock.recv_multipart(copy=False)
                if len(frames) < 2 or frames[0].bytes != corr:
                    self.stats.drop("stale", "reply to an earlier request")  # e.g. a resend's answer
                    continue
                reply = self._decode(frames[1:], f"request {self.address}")
                if reply is None:
                    continue
                if isinstance(reply, ErrorReply):
                    raise RemoteError(reply.message)
                return reply
        raise ChannelTimeout(
            f"no reply from {self.address} to {type(rec).__name__} after {retries + 1} tries of {timeout_s:g}s"
        )

    def _send_within(self, frames: list, deadline: float, moved: Callable[[], bool] | None, check_s: float) -> bool:
        """Send once a connection can take the frames; False at the deadline. With IMMEDIATE a DEALER
        has no connection to send on while its server is down, so `moved()` is asked here too."""
        try:  # fast path: a live connection with room in its queue
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            pass
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(1000 * (left if moved is None else min(left, check_s))), zmq.POLLOUT):
                self.sock.send_multipart(frames, copy=False)
                return True
            if moved is not None and time.monotonic() < deadline and moved():
                raise ServerMoved(f"{self.address} was replaced while a request waited to be sent")
        return False


class ReconnectingClient:
    """A request/reply client that follows its server across restarts.

    The address comes from `resolve()` (a registry lookup; '' while the server is not registered).
    It is looked up again after every timeout, every `watch_s` while a request waits (a replaced
    server gets the request again on its new address at once), and otherwise at most every
    `recheck_s` seconds; a changed address closes the old connection and opens one to the new. `request` raises
    `ChannelTimeout` (`NoServer` when no address is known) and `RemoteError` like `RequestClient`;
    the caller decides what a timeout means for it. One thread at a time, like the socket beneath."""

    def __init__(
        self,
        resolve: str | Callable[[], str],
        *,
        timeout_s: float = 5.0,
        retries: int = 0,
        recheck_s: float = 1.0,
        watch_s: float = 0.1,
    ) -> None:
        """`watch_s`: how often a waiting request looks the address up (one small file read), so a
        request to a server that died is re-sent to its replacement within `watch_s` of its start."""
        self._resolve = resolve if callable(resolve) else (lambda: resolve)
        self.timeout_s, self.retries, self.recheck_s, self.watch_s = timeout_s, retries, recheck_s, watch_s
        self._client: RequestClient | None = None
        self.address = ""  # the address connected to ('' when none)
        self._checked = 0.0
        self.connects = 0

    def request(self, rec: Record, timeout_s: float | None = None, retries: int | None = None) -> Record:
        """A server replaced while the request waited gets it again at once, on its new address (the
        caller would ask again anyway; replies to a resent request are the server's business, as for
        any resend). Any other timeout is the caller's to handle."""
        for last in (False, True):
            client = self._connected()
            try:  # a restarted server ends the wait at once (the registry names its new address)
                return client.request(rec, timeout_s=timeout_s, retries=retries, moved=self.moved, check_s=self.watch_s)
            except ServerMoved:
                self.close()  # connect to the new address now
                if last:
                    raise
            except ChannelTimeout:
                self.close()  # the server may be restarting on a new address: look it up again next time
                raise
        raise AssertionError("unreachable")

    def moved(self) -> bool:
        """Look the address up now: True when it names a server other than the one connected to."""
        address = self._lookup()
        return bool(address) and address != self.address

    def _connected(self) -> RequestClient:
        now = time.monotonic()
        if self._client is None or now >= self._checked + self.recheck_s:
            self._checked = now
            address = self._lookup()
            if not address:
                self.close()
                raise NoServer("no server address is registered yet")
            if address != self.address or self._client is None:
                self.close()
                self._client = RequestClient(address, timeout_s=self.timeout_s, retries=self.retries)
                self.address = address
                self.connects += 1
        return self._client

    def _lookup(self) -> str:
        try:
            return self._resolve() or ""
        except Exception as err:  # noqa: BLE001 - a lookup that fails reads as "not registered yet"
            log.warning("looking up a server address failed: %s", err)
            return ""

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None
        self.address = ""


@dataclass
class Request:
    """A request received by a ReplyServer; answer it with `server.reply(req, record)`."""

    record: Record
    peer: bytes
    corr: bytes


class ReplyServer(_Channel):
    """ROUTER side of request/reply."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        transport: str = "tcp",
        advertise: str | None = None,
        *,
        reply_cache: int = 4096,
        **kw,
    ):
        super().__init__(zmq.ROUTER, **kw)
        self._bind(host, transport, advertise)
        self._cache: collections.OrderedDict[tuple[bytes, bytes], list] = collections.OrderedDict()
        self._cache_size = reply_cache

    def recv(self, timeout_s: float | None = None) -> Request | None:
        """The next valid request, or None when none arrived in time. Resent requests that were
        already answered get the cached reply again and are not returned."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            frames = self._recv_within(deadline)
            if frames is None:
                return None
            if len(frames) < 3:
                self.stats.drop("framing", f"{len(frames)} frames, need identity, id, payload")
                log.warning("reply %s: dropped malformed request (%d frames)", self.address, len(frames))
                continue
            peer, corr = frames[0].bytes, frames[1].bytes
            cached = self._cache.get((peer, corr))
            if cached is not None:
                self.sock.send_multipart([peer, corr, *cached], copy=False)
                self.stats.drop("duplicate", "resent request answered from cache")
                continue
            try:
                rec = decode_parts(frames[2:])
            except ProtocolError as err:
                self.stats.drop("decode", str(err))
                log.warning("reply %s: dropped undecodable request: %s", self.address, err)
                self._send(peer, corr, ErrorReply(message=f"undecodable request: {err}"))
                continue
            self.stats.received += 1
            return Request(rec, peer, corr)

    def reply(self, req: Request, rec: Record) -> None:
        self._send(req.peer, req.corr, rec)

    def _send(self, peer: bytes, corr: bytes, rec: Record) -> None:
        parts = encode_parts(rec)
        self._cache[(peer, corr)] = parts
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        self.sock.send_multipart([peer, corr, *parts], copy=False)
        self.stats.sent += 1

    def serve(self, handler, stop: threading.Event, poll_s: float = 0.1) -> None:
        """Answer requests with `handler(record) -> record` until `stop` is set. A handler that raises
        answers with an ErrorReply; the server keeps serving."""
        while not stop.is_set():
            req = self.recv(poll_s)
            if req is None:
                continue
            try:
                answer = handler(req.record)
            except Exception as err:  # a handler bug must not take the server down
                log.exception("reply %s: handler failed", self.address)
                answer = ErrorReply(message=f"{type(err).__name__}: {err}")
            self.reply(req, answer)
