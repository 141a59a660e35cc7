"""Background work: what runs beside a timed window and must not slow it.

A forward that launches many small operators is timed by how fast the host launches them, so a
timed window needs its CPU as much as its GPU. The device lease keeps other GPU work out of the
window; this keeps the host's heavy CPU work out of its way. Compilers (a candidate's nvcc and g++
in the jailed build process, the precompiled headers) and torch.compile's own compilation of a
baseline run at BACKGROUND_NICE: the kernel's scheduler then gives a timing process (nice 0: the
sandbox, the baseline process, the verifier) its core within microseconds of asking, however many
compilers are running, and the compilers take every cycle the timing leaves. Without it, a reference of ~40 small operators
whose baseline was timed while candidates compiled read twice its quiet-host time
(docs/BENCHMARKS.md, timing fidelity).

Niceness is per thread on Linux and inherited by every process a thread starts, so a compile run on
a niced thread (`in_background`) makes its worker processes background work too.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

# The lowest priority: a nice-0 process gets about 70 times the CPU of one at 19 when they compete.
BACKGROUND_NICE = 19


def lower_priority(tid: int = 0) -> None:
    """Make the calling thread (or thread/process `tid`) background work; raising niceness needs no
    privilege. A system that refuses leaves the work at its priority: it runs, only less politely."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    except (OSError, AttributeError):
        pass


def niceness(tid: int = 0) -> int:
    """The niceness of the calling thread (or thread/process `tid`)."""
    return os.getpriority(os.PRIO_PROCESS, tid)


def in_background(fn, *args):
    """`fn(*args)` on a thread of its own at BACKGROUND_NICE (and every process it starts), waited
    for; returns its result or raises its exception here. The calling thread keeps its priority."""
    result: list = []
    error: list[BaseException] = []

    def body() -> None:
        lower_priority(threading.get_native_id())
        try:
            result.append(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the caller as is
            error.append(err)

    thread = threading.Thread(target=body, name="kiln-background", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def lower_children() -> int:
    """Make every process this one started (and theirs) background work; returns how many. A worker
    pool started earlier on a thread at normal priority (torch.compile keeps one) is then background
    work too."""
    done, seen = 0, set()
    todo = _children(os.getpid())
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            os.setpriority(os.PRIO_PROCESS, pid, BACKGROUND_NICE)
            done += 1
        except OSError:  # gone meanwhile
            continue
        todo.extend(_children(pid))
    return done


def _children(pid: int) -> list[int]:
    """The pids of `pid`'s children, from every one of its threads (Linux's /proc; none elsewhere)."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(x) for x in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found
