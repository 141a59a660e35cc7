"""The build service's view of a jailed process from outside: the watch on its process tree, the
evidence its seal wrote, the tail of its log.

A capture or build process is untrusted, so nothing it says about itself decides anything: the
watch polls its whole process tree from the service (wall-clock deadline, process count, resident
memory) and kills it past a limit, remembering which (`TreeWatch.verdict`); the evidence is read
from a pipe its seal wrote as it refused, bounded, once the process is gone; its log only from its
end (`read_tail`), however much it wrote.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from actors.verifier import native, proctree

POLL_S = 0.1  # how often a capture or build process tree is checked against its limits
MAX_EVIDENCE = 200


class TreeWatch:
    """Polls one sandbox's process tree from the service: kills it past the deadline, the process
    count or the memory limit, and remembers why (`verdict`)."""

    def __init__(self, pid: int, deadline: float, max_processes: int, memory_limit: int, kill) -> None:
        self.pid, self.deadline, self.max_processes, self.memory_limit = pid, deadline, max_processes, memory_limit
        self._kill = kill
        self.verdict: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-build-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            pids = proctree.descendants(self.pid, limit=self.max_processes + 1)
            if not pids or not os.path.exists(f"/proc/{self.pid}"):
                return
            if time.monotonic() > self.deadline:
                self.verdict = "timeout"
            elif len(pids) > self.max_processes:
                self.verdict = "processes"
            elif proctree.tree_rss(pids) > self.memory_limit:
                self.verdict = "memory"
            if self.verdict:
                self._kill()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def read_evidence(fd: int) -> list[dict]:
    """What the capture process's seal refused, as it happened (read once the process is gone; at most
    MAX_EVIDENCE lines, each cut short)."""
    data = b""
    try:
        while len(data) < (1 << 20):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    finally:
        os.close(fd)
    return [
        {"kind": kind, "what": what, "where": where, "via": "refused at module level (recorded as it happened)"}
        for _, kind, what, where in native.evidence_records(data)[:MAX_EVIDENCE]
    ]


def log_tail(path: Path, n: int = 800) -> str:
    text = read_tail(path, n).strip()
    return f":\n{text}" if text else ""


def read_tail(path: Path, n: int) -> str:
    """The last `n` bytes of a file, read from its end: a log of gigabytes costs `n` bytes to read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - n, 0))
            return f.read(n).decode("utf-8", "replace")
    except OSError:
        return ""
