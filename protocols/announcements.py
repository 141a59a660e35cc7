"""Announcements: `Publisher` (PUB + a sync ROUTER) -> `Subscriber` (SUB + a DEALER), the learner's
weight announcements to the engines (docs/architecture.md). Each published record carries a sequence
number and is kept in a bounded history; a subscriber's handshake replays what it missed, a ping on
the PUB socket proves its subscription is live, and its READY is the barrier `wait_ready(n)` counts.
A subscriber that sees a gap in the sequence fetches it from the history; what the history no longer
holds is counted in `Subscriber.lost`, never hidden.

The sockets and the decode-and-count of bad frames are the request/reply channels' own
(`protocols.channels`); this module adds only the announcement protocol.
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
import uuid

import zmq

from protocols.channels import DEFAULT_HWM, ChannelStats, ChannelTimeout, _Channel
from protocols.codec import encode_parts
from protocols.schema import Record

log = logging.getLogger(__name__)

_SEQ = struct.Struct("<Q")
_HELLO, _READY, _REPLAY, _WELCOME = b"HELLO", b"READY", b"REPLAY", b"WELCOME"
_PING_TOPIC = b"\x00ping:"


class Publisher:
    """PUB socket plus a sync ROUTER. Each published record gets a sequence number and is kept in a
    bounded history; a subscriber's HELLO is answered with everything after the sequence it has,
    then a ping on the PUB socket confirms its subscription is live, then it says READY.
    `wait_ready(n)` is the barrier that waits for n subscribers."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        transport: str = "tcp",
        advertise: str | None = None,
        *,
        history: int = 1024,
        hwm: int = DEFAULT_HWM,
        context: zmq.Context | None = None,
    ):
        ctx = context or zmq.Context.instance()
        self._pub = _Channel(zmq.PUB, hwm=hwm, context=ctx)
        # Replays are bounded by `history` and must never be dropped: no high-water mark on sync.
        self._sync = _Channel(zmq.ROUTER, hwm=0, context=ctx)
        self.address = self._pub._bind(host, transport, advertise)
        self.sync_address = self._sync._bind(host, transport, advertise)
        self.stats = ChannelStats()
        self._history: collections.deque[tuple[int, list]] = collections.deque(maxlen=history)
        self._seq = 0
        self._lock = threading.Lock()
        self._ready: set[bytes] = set()
        self._ready_cv = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_sync, name="kiln-pub-sync", daemon=True)
        self._thread.start()

    @property
    def ready_count(self) -> int:
        with self._lock:
            return len(self._ready)

    def publish(self, rec: Record) -> int:
        """Publish a record to every subscriber; returns its sequence number."""
        parts = encode_parts(rec)
        topic = type(rec).__name__.encode()
        with self._lock:
            self._seq += 1
            self._history.append((self._seq, parts))
            self._pub.sock.send_multipart([topic, _SEQ.pack(self._seq), *parts], copy=False)
            self.stats.sent += 1
            return self._seq

    def wait_ready(self, n: int, timeout_s: float | None = None) -> bool:
        """Block until at least n subscribers have completed the READY handshake."""
        with self._ready_cv:
            return self._ready_cv.wait_for(lambda: len(self._ready) >= n, timeout_s)

    def _serve_sync(self) -> None:
        sock = self._sync.sock
        while not self._stop.is_set():
            try:
                if not sock.poll(50, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return  # closed
            if len(frames) != 4 or frames[1] not in (_HELLO, _READY) or len(frames[3]) != 8:
                self.stats.drop("framing", "bad sync message")
                continue
            peer, verb, sub_id, have = frames
            with self._lock:
                if verb == _READY:
                    self._ready.add(sub_id)
                    self._ready_cv.notify_all()
                    continue
                (after,) = _SEQ.unpack(have)
                oldest = self._history[0][0] if self._history else self._seq + 1
                for seq, parts in self._history:
                    if seq > after:
                        sock.send_multipart([peer, _REPLAY, _SEQ.pack(seq), *parts], copy=False)
                # WELCOME carries the newest sequence and whether history had lost anything asked for
                lost = b"1" if after + 1 < oldest and after < self._seq else b"0"
                sock.send_multipart([peer, _WELCOME, _SEQ.pack(self._seq), lost])
                self._pub.sock.send_multipart([_PING_TOPIC + sub_id, _SEQ.pack(0)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pub.close()
        self._sync.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Subscriber:
    """SUB side: `connect()` performs the handshake (replaying missed history); `recv()` returns
    records in sequence order, fetching any gap from the publisher's history."""

    def __init__(self, address: str, sync_address: str, *, hwm: int = DEFAULT_HWM, context: zmq.Context | None = None):
        ctx = context or zmq.Context.instance()
        self.id = uuid.uuid4().hex.encode()
        self._sub = _Channel(zmq.SUB, hwm=hwm, context=ctx)
        self._dealer = _Channel(zmq.DEALER, hwm=0, context=ctx)  # replays must not be dropped
        self._sub.sock.setsockopt(zmq.SUBSCRIBE, b"")  # every record: sequence gaps must be visible
        self._sub.sock.connect(address)
        self._dealer.sock.connect(sync_address)
        self.stats = self._sub.stats
        self.last_seq = 0
        self.lost = 0  # messages the publisher's history no longer held when asked for (counted, logged)
        self._queue: collections.deque[Record] = collections.deque()
        self.connected = False

    def connect(self, timeout_s: float = 10.0) -> None:
        """Handshake: HELLO (replay from history) until our ping arrives on SUB, then READY."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._hello()
            ping_deadline = min(time.monotonic() + 0.2, deadline)
            while (left := ping_deadline - time.monotonic()) > 0:
                if not self._sub.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    break
                if self._take(self._sub.sock.recv_multipart(copy=False)) == "ping":
                    self._dealer.sock.send_multipart([_READY, self.id, _SEQ.pack(self.last_seq)])
                    self.connected = True
                    return
        raise ChannelTimeout("publisher did not answer the subscription handshake")

    def _hello(self) -> None:
        """Ask for everything after last_seq and wait for the WELCOME that ends the replay."""
        self._dealer.sock.send_multipart([_HELLO, self.id, _SEQ.pack(self.last_seq)])
        while self._dealer.sock.poll(2000, zmq.POLLIN):
            frames = self._dealer.sock.recv_multipart(copy=False)
            verb = frames[0].bytes
            if verb == _REPLAY and len(frames) >= 3:
                self._accept(_SEQ.unpack(frames[1].bytes)[0], frames[2:])
            elif verb == _WELCOME and len(frames) == 3:
                if frames[2].bytes == b"1":
                    log.warning("subscriber: publisher history no longer holds messages after %d", self.last_seq)
                # Everything up to `newest` that history still held was replayed; the rest is gone.
                newest = _SEQ.unpack(frames[1].bytes)[0]
                if newest > self.last_seq:
                    self.lost += newest - self.last_seq
                    self.last_seq = newest
                return

    def _accept(self, seq: int, parts) -> None:
        if seq <= self.last_seq:
            return  # already delivered (replay and live stream overlap)
        if seq > self.last_seq + 1:  # history no longer held these: count them, never hide them
            self.lost += seq - self.last_seq - 1
        rec = self._sub._decode(parts, "subscriber")
        self.last_seq = seq
        if rec is not None:
            self._queue.append(rec)

    def _take(self, frames) -> str:
        if len(frames) < 2 or len(frames[1].bytes) != 8:
            self.stats.drop("framing", "bad pub frame")
            return "bad"
        topic, seq = frames[0].bytes, _SEQ.unpack(frames[1].bytes)[0]
        if topic.startswith(_PING_TOPIC):
            return "ping" if topic == _PING_TOPIC + self.id else "other-ping"
        if seq > self.last_seq + 1:  # a gap: fetch what we missed from the publisher's history first
            self._hello()
        self._accept(seq, frames[2:])
        return "data"

    def recv(self, timeout_s: float | None = None) -> Record | None:
        """The next record in publish order, or None when none arrived in time."""
        if not self.connected:
            self.connect()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._queue:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ms = None if left is None else int(left * 1000)
            if not self._sub.sock.poll(ms, zmq.POLLIN):
                return None
            self._take(self._sub.sock.recv_multipart(copy=False))
        return self._queue.popleft()

    def close(self) -> None:
        self._sub.close()
        self._dealer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
