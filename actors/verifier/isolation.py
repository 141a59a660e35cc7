"""OS-level confinement for processes that run untrusted candidate code (compile capture and execution).

`confine()` is called first thing in a freshly started child process. It applies what this OS allows
and returns notes on what it could not apply, so verdicts can say how strong the sandbox was:
* a private, empty network namespace (unshare(CLONE_NEWNET); needs root or CAP_SYS_ADMIN),
* a scratch working directory that is also HOME and TMPDIR,
* no core dumps, a bounded number of open files, an optional CPU-time cap.
Memory is NOT limited with RLIMIT_AS, which breaks CUDA contexts (they reserve huge virtual ranges):
`RssWatchdog` polls the child's resident set from the parent and kills it past the limit instead.
"""

from __future__ import annotations

import ctypes
import os
import resource
import threading
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000
_SAFE_ENV = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "LD_LIBRARY_PATH",
             "PYTHONPATH", "TORCH_CUDA_ARCH_LIST", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
             "NVSHMEM_DISABLE_NVLS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "VIRTUAL_ENV")


def confine(scratch: Path, *, network: bool = False, cpu_seconds: int | None = None,
            open_files: int = 1024) -> list[str]:
    """Confine the calling process. Returns notes on protections that could not be applied."""
    notes = []
    scratch.mkdir(parents=True, exist_ok=True)
    os.chdir(scratch)
    keep = {k: v for k, v in os.environ.items() if k in _SAFE_ENV}
    os.environ.clear()
    os.environ.update(keep, HOME=str(scratch), TMPDIR=str(scratch))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(open_files, hard), hard))
    if cpu_seconds:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
    if not network:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            notes.append(f"network not isolated: unshare failed ({os.strerror(ctypes.get_errno())})")
    return notes


def rss_bytes(pid: int) -> int:
    """Resident set of a process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


class RssWatchdog:
    """Kills a process whose resident memory exceeds `limit_bytes`; `tripped` tells afterwards.
    Works with CUDA contexts, unlike RLIMIT_AS."""

    def __init__(self, pid: int, limit_bytes: int, kill, interval_s: float = 0.05):
        self.pid, self.limit, self._kill, self.interval = pid, limit_bytes, kill, interval_s
        self.tripped = False
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kiln-rss-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            rss = rss_bytes(self.pid)
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.tripped = True
                self._kill()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


def wait_deadline(deadline: float) -> float:
    """Seconds left until a monotonic deadline (never negative)."""
    return max(deadline - time.monotonic(), 0.0)
