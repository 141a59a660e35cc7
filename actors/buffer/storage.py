"""Durable storage of the replay state in `<run_dir>/replay/`: a write-ahead log and snapshots.

* `wal-NNNNNN.log` — append-only frames of the inputs that changed the state (stored episodes,
  task and batch requests that changed something, expiry decisions). A frame is
  `magic "KW" | kind u8 | 0 u8 | length u32 | crc32 u32 | payload`; record payloads are
  `protocols.encode` bytes. `commit()` fsyncs, and the actor replies only after it, so an
  acknowledged episode is on disk. A kill -9 mid-write leaves at most a torn last frame, which
  recovery detects (short frame, bad magic or checksum) and truncates: it was never acknowledged.
* `snapshot.bin` — one frame holding the whole state (msgpack) and the generation of the log that
  continues it. Written to a temporary file, fsync'ed and renamed over the old one (atomic). Taking a
  snapshot starts a fresh log generation, and the old log is deleted once the snapshot is in place
  (compaction). A crash at any step leaves either the old snapshot with its complete log, or the new
  snapshot with its (empty) new log.
Restart = load the snapshot + re-apply its log's frames.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgpack

log = logging.getLogger(__name__)

FRAME = struct.Struct("<2sBBII")
MAGIC = b"KW"
SNAPSHOT = "snapshot.bin"
_WAL = re.compile(r"wal-(\d{6})\.log$")


class EntryKind(enum.IntEnum):
    RECORD = 1  # an encoded protocols record (Episode, TaskRequest, BatchRequest)
    EXPIRE = 2  # msgpack list of group ids abandoned by the expiry check
    SNAPSHOT = 3  # the whole state (only in snapshot.bin)


class StorageError(RuntimeError):
    """The replay directory cannot be read back consistently (not a torn tail: real damage)."""


def frame(kind: EntryKind, payload: bytes) -> bytes:
    return FRAME.pack(MAGIC, kind, 0, len(payload), zlib.crc32(payload)) + payload


def read_frames(data: bytes) -> tuple[list[tuple[EntryKind, bytes]], int]:
    """The intact frames at the start of `data` and the byte length they cover."""
    frames, pos = [], 0
    while pos + FRAME.size <= len(data):
        magic, kind, _, length, crc = FRAME.unpack_from(data, pos)
        end = pos + FRAME.size + length
        if magic != MAGIC or kind not in EntryKind._value2member_map_ or end > len(data):
            break
        payload = data[pos + FRAME.size : end]
        if zlib.crc32(payload) != crc:
            break
        frames.append((EntryKind(kind), payload))
        pos = end
    return frames, pos


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Recovered:
    snapshot: dict | None  # the state dump, None on a fresh directory
    entries: list[tuple[EntryKind, bytes]]  # log frames to re-apply, in order
    truncated_bytes: int  # torn tail dropped from the log


@dataclass
class StorageStats:
    appended: int = 0
    commits: int = 0
    snapshots: int = 0
    truncated_bytes: int = 0
    last_snapshot_s: float = 0.0
    last_snapshot_bytes: int = 0


class ReplayStore:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.generation = 0
        self.since_snapshot = 0  # frames appended since the last snapshot
        self.stats = StorageStats()
        self._fd: int | None = None
        self._dirty = False

    def _wal(self, generation: int) -> Path:
        return self.dir / f"wal-{generation:06d}.log"

    def recover(self) -> Recovered:
        """Read the directory back (creating it if new) and open the log for appending."""
        self.dir.mkdir(parents=True, exist_ok=True)
        snapshot = None
        snap_path = self.dir / SNAPSHOT
        if snap_path.exists():
            frames, _ = read_frames(snap_path.read_bytes())
            if len(frames) != 1 or frames[0][0] != EntryKind.SNAPSHOT:
                raise StorageError(
                    f"{snap_path} is damaged (snapshots are replaced atomically, so this is not a crash)"
                )
            body = msgpack.unpackb(frames[0][1], raw=False, strict_map_key=False)
            self.generation, snapshot = body["next_log"], body["state"]
        for path in self.dir.iterdir():
            m = _WAL.match(path.name)
            if m and int(m.group(1)) != self.generation:
                if int(m.group(1)) > self.generation and path.stat().st_size:
                    raise StorageError(f"{path} is newer than the snapshot and not empty")
                path.unlink()  # compacted into the snapshot, or an empty log of an interrupted snapshot
        wal = self._wal(self.generation)
        data = wal.read_bytes() if wal.exists() else b""
        entries, good = read_frames(data)
        truncated = len(data) - good
        if truncated:
            log.warning("replay: dropping a torn tail of %d bytes from %s (never acknowledged)", truncated, wal)
            with open(wal, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        self.stats.truncated_bytes += truncated
        self.since_snapshot = len(entries)
        self._open(self.generation)
        return Recovered(snapshot=snapshot, entries=entries, truncated_bytes=truncated)

    def _open(self, generation: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self._wal(generation), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fsync_dir(self.dir)  # the new file's directory entry must survive a crash too

    def append(self, kind: EntryKind, payload: bytes) -> None:
        """Write one frame (not yet durable: call `commit()` before acknowledging anything)."""
        data = frame(kind, payload)
        written = os.write(self._fd, data)
        if written != len(data):
            raise OSError(f"short write to the replay log ({written} of {len(data)} bytes)")
        self.stats.appended += 1
        self.since_snapshot += 1
        self._dirty = True

    def commit(self) -> None:
        """Make every appended frame durable (one fsync for a whole group of requests)."""
        if self._dirty:
            os.fdatasync(self._fd)
            self.stats.commits += 1
            self._dirty = False

    def snapshot(self, state: dict) -> None:
        """Atomically replace the snapshot with `state`, continue in a fresh log, drop the old log."""
        self.commit()
        start = time.perf_counter()
        old, new = self.generation, self.generation + 1
        with open(self._wal(new), "wb"):  # create (or empty) the log the new snapshot points at
            pass
        payload = frame(EntryKind.SNAPSHOT, msgpack.packb({"next_log": new, "state": state}, use_bin_type=True))
        tmp = self.dir / (SNAPSHOT + ".tmp")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / SNAPSHOT)
        _fsync_dir(self.dir)
        self.generation = new
        self._open(new)
        self._wal(old).unlink(missing_ok=True)
        self.since_snapshot = 0
        self.stats.snapshots += 1
        self.stats.last_snapshot_s = time.perf_counter() - start
        self.stats.last_snapshot_bytes = len(payload)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
