"""An episode's ways out of a rollout actor: to replay, resent until acknowledged (`EpisodeSender`, the
rollout side of the episode contract), and to disk in rollout-only mode (`EpisodeLog`, which offline
replay reads back).

`EpisodeSender` holds unacknowledged episodes in submission order. `pump()` offers each to replay
once; an ack ("stored" or "duplicate") releases it, a "rejected" ack releases it into `rejected`
(resending cannot fix it), and a timeout or an error reply keeps it for the next pump. Replay drops
duplicates by episode id, so resending after a lost ack is always safe. The address may be a
callable (a registry lookup), which the `ReconnectingClient` re-reads after a timeout, so a sender
follows a replay that restarted on a new port.
Single-threaded: call it from the thread that produces episodes.

`EpisodeLog` is an append-only file: a sequence of length-prefixed `encode(Episode)` frames, one file
per actor.
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from protocols.channels import ChannelTimeout, NoServer, ReconnectingClient, RemoteError
from protocols.codec import decode, encode
from protocols.records import Episode, EpisodeAck
from protocols.schema import ProtocolError
from protocols.witness import WitnessLog

log = logging.getLogger(__name__)


@dataclass
class SenderStats:
    stored: int = 0
    duplicate: int = 0
    timeouts: int = 0
    errors: int = 0
    rejected: dict[str, str] = field(default_factory=dict)  # episode id -> replay's reason


class EpisodeSender:
    def __init__(
        self, address: str | Callable[[], str], *, timeout_s: float = 5.0, witness: WitnessLog | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.witness = witness  # the actor's own account of each id replay acknowledged (protocols/witness.py)
        self._unacked: collections.OrderedDict[str, Episode] = collections.OrderedDict()
        self.client = ReconnectingClient(address, timeout_s=timeout_s, retries=0)
        self.stats = SenderStats()
        self.acked: list[str] = []  # ids replay confirmed holding, in ack order

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def submit(self, episode: Episode) -> None:
        """Take responsibility for an episode until replay acknowledges it."""
        self._unacked[episode.episode_id] = episode

    def pump(self) -> int:
        """Offer every unacknowledged episode once, oldest first; stop at the first timeout (replay is
        down or busy: the rest would time out too). Returns how many were acknowledged."""
        done = 0
        for episode_id, episode in list(self._unacked.items()):
            try:
                ack = self.client.request(episode)
            except NoServer:  # replay has not registered (yet)
                break
            except ChannelTimeout:  # the client looks replay up again next time: it may have moved
                self.stats.timeouts += 1
                break
            except RemoteError as err:  # replay refused (e.g. storage failure): keep it, try later
                self.stats.errors += 1
                log.warning("episode %s: replay answered an error: %s", episode_id, err)
                break
            if not isinstance(ack, EpisodeAck) or ack.episode_id != episode_id:
                self.stats.errors += 1
                log.warning("episode %s: unexpected answer %r", episode_id, ack)
                break
            del self._unacked[episode_id]
            done += 1
            if ack.status == "rejected":
                self.stats.rejected[episode_id] = ack.reason
                log.error("episode %s rejected by replay: %s", episode_id, ack.reason)
                continue
            setattr(self.stats, ack.status, getattr(self.stats, ack.status) + 1)
            self.acked.append(episode_id)
            if self.witness is not None:
                self.witness.write([episode_id])
        return done

    def flush(self, timeout_s: float) -> bool:
        """Pump until nothing is unacknowledged or `timeout_s` passes. True when all were acked."""
        deadline = time.monotonic() + timeout_s
        while self._unacked and time.monotonic() < deadline:
            if not self.pump():
                time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        return not self._unacked

    def close(self) -> None:
        self.client.close()
        if self.witness is not None:
            self.witness.close()


_LEN = struct.Struct("<Q")


class EpisodeLog:
    """Append-only file of encoded episodes (a torn last frame, from a kill, is ignored on read)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open for appends; close() closes it
        self._lock = threading.Lock()

    def append(self, episode: Episode) -> None:
        frame = encode(episode)
        with self._lock:
            self._file.write(_LEN.pack(len(frame)) + frame)
            self._file.flush()

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(path: str | Path) -> list[Episode]:
        data = Path(path).read_bytes()
        out, pos = [], 0
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            frame = data[pos + _LEN.size : pos + _LEN.size + n]
            if len(frame) < n:
                log.warning("%s: torn last frame ignored", path)
                break
            try:
                rec = decode(frame)
            except ProtocolError as err:
                log.warning("%s: undecodable frame skipped: %s", path, err)
            else:
                if isinstance(rec, Episode):
                    out.append(rec)
            pos += _LEN.size + n
        return out
