"""The warm fork server of compile children: `python -m actors.verifier.build.zygote`.

Importing torch costs ~1.5 s; the zygote pays it once, then forks one fresh child per candidate,
so a capture starts in milliseconds. It stays single-threaded (forking a threaded process is
unsafe) and never runs torch ops, so no thread pool exists at fork time.

Protocol, one JSON object per line: the service writes {"job", ...request} on stdin; the zygote
answers {"job", "pid"} after the fork and {"job", "status": {"exit": n} | {"signal": n}} when the
child is reaped. EOF on stdin (the service went away) kills every child and exits.

The zygote is a child subreaper: descendants of a child that outlive it (a daemonised process, a
fork bomb that left its process group) are re-parented here and killed at once.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _children_of_self() -> list[int]:
    pids = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def main() -> None:
    import torch  # noqa: F401  the reason the zygote exists: children start with torch imported

    from actors.verifier.build import capture

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    jobs: dict[int, str] = {}
    stdin = sys.stdin.buffer
    _emit({"ready": True, "pid": os.getpid()})
    buf = b""
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        if readable:
            chunk = os.read(stdin.fileno(), 1 << 16)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    request = json.loads(line)
                    job = str(request["job"])
                except (ValueError, KeyError, TypeError):
                    _emit({"error": "bad request line"})
                    continue
                pid = os.fork()
                if pid == 0:
                    capture.child_main(request)  # never returns
                jobs[pid] = job
                _emit({"job": job, "pid": pid})
        _reap(jobs)
    for pid in list(jobs) + _children_of_self():
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _reap(jobs: dict[int, str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        job = jobs.pop(pid, None)
        if job is not None:
            result = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                      else {"exit": os.WEXITSTATUS(status)})
            _emit({"job": job, "status": result})
    # Anything else parented here is an orphan of a finished or killed child: end it.
    for pid in _children_of_self():
        if pid not in jobs:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    main()
