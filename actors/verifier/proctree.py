"""Watching and ending the process tree of one sandboxed process (Linux /proc, seen from the verifier).

The verifier polls a sandbox's descendants and their resident memory and kills the whole tree past
a limit. Killing goes by process group and by tree walk, so a descendant that left the group still
dies; inside its own PID namespace, every process dies with the sandbox anyway.
"""

from __future__ import annotations

import os
import signal
import time


def rss_bytes(pid: int) -> int:
    """Resident set of a process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out += [int(p) for p in f.read().split()]
            except OSError:
                continue
    except OSError:
        pass
    return out


def descendants(pid: int, limit: int = 100_000) -> list[int]:
    """`pid` and every process below it (breadth first, at most `limit`)."""
    seen, queue = [], [pid]
    while queue and len(seen) < limit:
        p = queue.pop(0)
        seen.append(p)
        queue += children(p)
    return seen


def tree_rss(pids: list[int]) -> int:
    return sum(rss_bytes(p) for p in pids)


def kill_tree(pid: int, timeout_s: float = 2.0) -> None:
    """SIGKILL the process group led by `pid` and every descendant, until none is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = descendants(pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False
