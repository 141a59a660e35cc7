"""Where every actor of a run listens: one file, RUN_DIR/registry.json, that actors write their
endpoints to when they start and peers read addresses from.

    {"replay":     {"role": "replay",   "endpoints": {"replay": "tcp://10.0.0.5:40123"}, "pid": ..., ...},
     "learner":    {"role": "learner",  "endpoints": {"weights": ..., "announce": ..., "announce_sync": ...}},
     "verifier-0": {"role": "verifier", "endpoints": {"verifier": ...}},
     "driver":     {"role": "driver",   "endpoints": {"metrics": ...}}}

Why a file in the run directory rather than a Ray named actor: the same registry then serves a run
in one process (`cluster.use_ray=false`, the tests), a Ray run, and tools that attach to a run or
serve one actor on its own (`python -m actors.buffer`); it needs no process of its own that could die
and would itself have to be found; and people can read it. Its one requirement, a run directory
that every node sees, is one the run has anyway: a restarted replay recovers from its log there and
a restarted learner from its checkpoints.

Writes are read-modify-write under an exclusive `flock` on RUN_DIR/registry.lock, and replace the
file atomically (write a temporary file, fsync, rename), so a reader never sees a torn file and needs
no lock. A restarted actor registers again under its name, replacing the dead one's entry; peers
re-read the registry (the `ReconnectingClient` in protocols.channels does it after a timeout and at
most every second), so nobody is re-wired by hand. A registry that cannot be read reads as empty:
peers then wait, as they do for an actor that has not registered yet.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

REGISTRY_FILE = "registry.json"
LOCK_FILE = "registry.lock"


class NotRegistered(TimeoutError):
    """An awaited endpoint was not registered in time."""


@dataclass(frozen=True)
class Entry:
    """One actor's registration."""

    name: str  # unique in the run: "replay", "learner", "rollout-1", "verifier-0", "driver"
    role: str  # "replay", "learner", "rollout", "verifier", "driver"
    endpoints: dict[str, str] = field(default_factory=dict)  # endpoint name -> address
    pid: int = 0
    host: str = ""
    time: float = 0.0  # when it registered (seconds since the epoch)


class Registry:
    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.path = self.dir / REGISTRY_FILE

    # ---------------------------------------------------------------------------------- writes

    def register(self, name: str, role: str, endpoints: dict[str, str]) -> Entry:
        """Record (or replace) `name`'s endpoints."""
        entry = Entry(
            name=name,
            role=role,
            endpoints=dict(endpoints),
            pid=os.getpid(),
            host=socket.gethostname(),
            time=time.time(),
        )
        with self._locked() as entries:
            entries[name] = entry
        return entry

    def unregister(self, *names: str) -> None:
        """Forget these actors (dead ones, so that nobody resolves their old addresses)."""
        with self._locked() as entries:
            for name in names:
                entries.pop(name, None)

    def clear(self) -> None:
        """Forget every actor (a driver starting, or resuming, a run: what an earlier driver's actors
        registered is stale)."""
        with self._locked() as entries:
            entries.clear()

    # ----------------------------------------------------------------------------------- reads

    def entries(self) -> dict[str, Entry]:
        try:
            raw = json.loads(self.path.read_text())
            return {name: Entry(**value) for name, value in raw.items()}
        except (OSError, ValueError, TypeError):
            return {}

    def endpoints(self, name: str) -> dict[str, str]:
        """`name`'s endpoints ({} while it is not registered)."""
        entry = self.entries().get(name)
        return dict(entry.endpoints) if entry is not None else {}

    def address(self, name: str, endpoint: str) -> str:
        """One endpoint's address ('' while it is not registered)."""
        return self.endpoints(name).get(endpoint, "")

    def pool(self, role: str, endpoint: str) -> str:
        """The addresses of every registered actor of `role`, comma-separated in name order (the form
        a `RequestClient` connects to as a pool), '' when there is none."""
        entries = sorted((e for e in self.entries().values() if e.role == role), key=lambda e: e.name)
        return ",".join(e.endpoints[endpoint] for e in entries if endpoint in e.endpoints)

    def resolver(self, name: str, endpoint: str) -> Callable[[], str]:
        """A function that looks the address up each time it is called (for a `ReconnectingClient`)."""
        return lambda: self.address(name, endpoint)

    def pool_resolver(self, role: str, endpoint: str) -> Callable[[], str]:
        return lambda: self.pool(role, endpoint)

    def wait(self, name: str, endpoint: str, timeout_s: float, poll_s: float = 0.1) -> str:
        """The address once it is registered; raises NotRegistered after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not (address := self.address(name, endpoint)):
            if time.monotonic() > deadline:
                raise NotRegistered(f"{name} registered no '{endpoint}' endpoint in {self.path} within {timeout_s:g} s")
            time.sleep(poll_s)
        return address

    # -------------------------------------------------------------------------------- internals

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Entry]]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entries = self.entries()
                yield entries
                self._write(entries)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, entries: dict[str, Entry]) -> None:
        tmp = self.path.with_name(f"{REGISTRY_FILE}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({name: asdict(e) for name, e in sorted(entries.items())}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
