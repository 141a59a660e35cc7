"""CPU time of processes and their descendants, and of the whole machine, from Linux's /proc.

A stage of the loop is an actor's process and everything it started (the verifier's compile and
sandbox children, a launched engine server). `tree_cpu_s(pid)` adds up the user + system seconds of
the process and of every live descendant, each with the time of the children it has reaped, so a
compile child that ran and exited between two readings still counts (its parent reaped it). The
difference of two readings is the CPU time the stage used in between. `machine_busy_s()` is the CPU
time of everything on the machine (other users' work included), from /proc/stat.

Elsewhere than Linux there is no /proc: both return None and the benchmark reports no CPU shares.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system + reaped children's seconds) of one process; None when it is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after its closing one.
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / TICKS


def _processes() -> dict[int, tuple[int, float]]:
    out = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                out[int(entry.name)] = stat
    return out


def tree_cpu_s(pids: dict[str, int], alone: frozenset[str] = frozenset()) -> dict[str, float] | None:
    """CPU seconds so far of each named process with its descendants (one walk over /proc for all),
    or of the process alone for the names in `alone` (the driver, whose descendants are Ray's own
    processes and, through them, the actors); a process that is gone reads 0. None without /proc."""
    if not (PROC / "stat").is_file():
        return None
    table = _processes()
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    out = {}
    for name, root in pids.items():
        total, todo, seen = 0.0, [root], set()
        while todo:
            pid = todo.pop()
            if pid in seen or pid not in table:
                continue
            seen.add(pid)
            total += table[pid][1]
            if name not in alone:
                todo += children.get(pid, [])
        out[name] = total
    return out


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine spent not idle (all cores, all users) since boot; None without /proc."""
    try:
        first = (PROC / "stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    values = [int(x) for x in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    busy = sum(values[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return busy / TICKS


def cores() -> int:
    return os.cpu_count() or 1
