"""The rollout actor's front to the verifier pool: one load-balancing dispatcher, on the episode loop's
event loop, in front of every registered verifier (docs/verifier.md, docs/rollout.md).

Each attempt's verification is sent the moment its generation ends (`await pool.verify(request)`).
The front holds one DEALER per verifier and knows each one's queue depth as the requests it has
outstanding there; a request goes to the connected verifier with the fewest (ties in turn).

A dead verifier's requests go to a live one at once. Death is seen without waiting for a timeout:
a socket monitor reports the dropped connection (a killed process's sockets are closed by its
kernel), and the registry no longer lists the dead actor's address (the supervisor removes it before
starting the replacement, which registers a new one). Moving a request counts as no resend: the
candidate did nothing wrong. Only silence from a connected verifier uses the reply timeout:
`rollout.verify_reply_timeout_s`, then `rollout.verify_retries` resends, then an `infra` result.

A request answered twice (it was moved, and the first verifier answered after all) resolves once: the
first answer goes into the episode, later ones are dropped. Request ids are the episode's
`<episode_id>/t<turn>`, so a verifier's own cache sees a resend as the same request.

The front lives inside each rollout actor, so it cannot die apart from the attempts it carries: a
rollout actor's death is already handled (its groups are released and re-issued by replay).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocols import ErrorReply, ProtocolError, VerifyRequest, VerifyResult, infra_result
from protocols.codec import decode_parts, encode_parts

log = logging.getLogger(__name__)

REFRESH_S = 0.5  # how often the registry is read for verifiers that joined, moved or left
WATCH_S = 0.05  # granularity of the reply-timeout watch
_SEQ = struct.Struct(">Q")


@dataclass
class _Pending:
    request: VerifyRequest
    future: asyncio.Future
    parts: list
    corr: bytes
    resends: int = 0  # resends after a timeout (moves off a dead verifier are not counted)
    link: _Link | None = None
    deadline: float = 0.0


@dataclass
class _Link:
    """One verifier: its DEALER, the monitor on it, and what it has outstanding (its queue depth)."""

    address: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    connected: bool = False
    outstanding: dict[bytes, _Pending] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)


def _sent(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("sending a verify request failed: %s", future.exception())


class VerifierPool:
    """`resolve()` returns the pool's addresses, comma-separated (`Registry.pool`), or pass a fixed
    string. Build and use it on one event loop; `close()` on the same loop."""

    def __init__(
        self, resolve: str | Callable[[], str], *, timeout_s: float, retries: int, stats: dict[str, int] | None = None
    ) -> None:
        self._resolve = resolve if callable(resolve) else (lambda: resolve)
        self.timeout_s, self.retries = timeout_s, retries
        self.stats = stats if stats is not None else {}
        for key in ("sent", "infra", "moved", "resent", "late"):
            self.stats.setdefault(key, 0)
        self._ctx = zmq.asyncio.Context.instance()
        self._links: dict[str, _Link] = {}
        self._waiting: list[_Pending] = []  # no connected verifier to take them yet
        self._turn = itertools.count()
        self._nonce = uuid.uuid4().bytes[:8]
        self._ids = itertools.count(1)
        self._background: list[asyncio.Task] = []
        self._refreshed = 0.0

    # ------------------------------------------------------------------------------ interface

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        if not self._background:
            self._background = [asyncio.create_task(self._refresh_loop()), asyncio.create_task(self._watch())]
        self._refresh()
        corr = self._nonce + _SEQ.pack(next(self._ids))
        pending = _Pending(
            request=request, future=asyncio.get_running_loop().create_future(), parts=encode_parts(request), corr=corr
        )
        self.stats["sent"] += 1
        self._dispatch(pending)
        return await pending.future

    def depths(self) -> dict[str, int]:
        """Each verifier's queue depth as this front sees it (requests outstanding there)."""
        return {address: len(link.outstanding) for address, link in self._links.items()}

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        for address in list(self._links):
            self._drop(address, move=False)
        for pending in self._waiting:
            if not pending.future.done():
                pending.future.cancel()
        self._waiting.clear()

    # ------------------------------------------------------------------------------ dispatch

    def _dispatch(self, pending: _Pending) -> None:
        """Send to the connected verifier with the fewest outstanding requests; wait when none is."""
        live = [link for link in self._links.values() if link.connected]
        start = next(self._turn)
        live = live[start % len(live) :] + live[: start % len(live)] if live else live
        if live:
            link = min(live, key=lambda l: len(l.outstanding))
            # Sent through the event loop (a connected pipe takes it at once); a send that fails leaves
            # the request to the disconnect that caused it, or to the reply timeout.
            link.sock.send_multipart([pending.corr, *pending.parts], copy=False).add_done_callback(_sent)
            pending.link = link
            pending.deadline = time.monotonic() + self.timeout_s
            link.outstanding[pending.corr] = pending
            return
        pending.link = None
        pending.deadline = time.monotonic() + self.timeout_s
        self._waiting.append(pending)

    def _resolve_with(self, pending: _Pending, result: VerifyResult) -> None:
        for link in self._links.values():
            link.outstanding.pop(pending.corr, None)
        if pending.future.done():
            self.stats["late"] += 1  # answered twice (moved, then the first verifier answered too)
            return
        pending.future.set_result(result)

    def _infra(self, pending: _Pending, message: str) -> None:
        self.stats["infra"] += 1
        r = pending.request
        log.warning("attempt %s turn %d marked infra: %s", r.episode_id, r.turn, message)
        self._resolve_with(pending, infra_result(r, message))

    def _move(self, link: _Link) -> None:
        """Every request outstanding at `link` goes to another verifier now."""
        moved = [p for p in link.outstanding.values() if not p.future.done()]
        link.outstanding.clear()
        for pending in moved:
            self.stats["moved"] += 1
            self._dispatch(pending)
        if moved:
            log.warning("verifier %s is gone: %d requests moved to the rest of the pool", link.address, len(moved))

    # ------------------------------------------------------------------------------ links

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_S:
            return
        self._refreshed = now
        try:
            addresses = [a.strip() for a in (self._resolve() or "").split(",") if a.strip()]
        except Exception as err:  # noqa: BLE001 - a failed lookup keeps the pool as it was
            log.warning("looking up the verifier pool failed: %s", err)
            return
        for address in addresses:
            if address not in self._links:
                self._open(address)
        for address in [a for a in self._links if a not in addresses]:
            self._drop(address, move=True)  # unregistered: dead, or restarted on a new address
        self._flush_waiting()

    def _open(self, address: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # a send never queues for a verifier that is not connected
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        link = _Link(address=address, sock=sock, monitor=monitor)
        link.tasks = [asyncio.create_task(self._receive(link)), asyncio.create_task(self._observe(link))]
        self._links[address] = link

    def _drop(self, address: str, *, move: bool) -> None:
        link = self._links.pop(address)
        for task in link.tasks:
            task.cancel()
        try:
            link.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        link.monitor.close(linger=0)
        link.sock.close(linger=0)
        if move:
            self._move(link)

    def _flush_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for pending in waiting:
            if not pending.future.done():
                self._dispatch(pending)

    async def _observe(self, link: _Link) -> None:
        """Connection events: connected → take waiting requests; disconnected → move its requests."""
        while True:
            event = parse_monitor_message(await link.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                link.connected = True
                self._flush_waiting()
            elif event == zmq.EVENT_DISCONNECTED:
                link.connected = False
                self._move(link)

    async def _receive(self, link: _Link) -> None:
        while True:
            frames = await link.sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            pending = link.outstanding.get(frames[0].bytes)
            if pending is None:  # moved elsewhere and already answered, or a stale answer
                pending = next(
                    (p for l in self._links.values() for p in l.outstanding.values() if p.corr == frames[0].bytes), None
                )
                if pending is None:
                    self.stats["late"] += 1
                    continue
            try:
                reply = decode_parts(frames[1:])
            except ProtocolError as err:
                self._infra(pending, f"undecodable verifier answer: {err}")
                continue
            if isinstance(reply, ErrorReply):
                self._infra(pending, f"verifier refused the request: {reply.message}")
            elif not isinstance(reply, VerifyResult) or reply.request_id != pending.request.request_id:
                self._infra(pending, f"unexpected verifier answer {type(reply).__name__}")
            else:
                self._resolve_with(pending, reply)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            self._refresh(force=True)

    async def _watch(self) -> None:
        """Silence from a connected verifier: resend after the reply timeout, then infra."""
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            late = [p for link in self._links.values() for p in link.outstanding.values() if p.deadline <= now]
            late += [p for p in self._waiting if p.deadline <= now]
            for pending in late:
                if pending.future.done():
                    continue
                if pending.link is not None:
                    pending.link.outstanding.pop(pending.corr, None)
                elif pending in self._waiting:
                    self._waiting.remove(pending)
                if pending.resends >= self.retries:
                    what = "no verifier answer" if pending.link is not None else "no verifier registered"
                    self._infra(pending, f"{what} after {pending.resends + 1} tries of {self.timeout_s:g}s")
                    continue
                pending.resends += 1
                self.stats["resent"] += 1
                self._dispatch(pending)
