"""Parent side of sandboxed execution: a bounded pool of forked children with watchdogs.

`SandboxPool.session()` forks a fresh child from the zygote (one per candidate), watches its
resident memory (RssWatchdog; RLIMIT_AS would break CUDA contexts) and gives every request a
wall-clock deadline. A child that hangs is killed (its whole process group); one that crashes,
exits, or is killed for memory is reaped and described. Either way only that child is lost: the
next session forks a new one, and the zygote (which never runs candidate code) keeps serving.
Replies are read with `wire.recv` (no pickle) and must echo the request's nonce, so a candidate
cannot inject a result of its own into the channel without reading the verifier's memory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from actors.verifier import wire
from actors.verifier.isolation import RssWatchdog
from actors.verifier.legality import Violation
from actors.verifier.zygote import ExitStatus, Zygote

_SIGNAL_HINTS = {
    signal.SIGSEGV: "a segmentation fault (out-of-bounds pointer or index?)",
    signal.SIGBUS: "a bus error (misaligned or out-of-bounds access)",
    signal.SIGFPE: "a floating-point exception (integer division by zero?)",
    signal.SIGILL: "an illegal instruction",
    signal.SIGABRT: "an abort (a failed assertion or an uncaught C++ exception)",
    signal.SIGKILL: "SIGKILL (the system's out-of-memory killer?)",
}


class SandboxFailure(Exception):
    """The child could not answer a request."""

    error_class = "runtime"


class SandboxTimeout(SandboxFailure):
    error_class = "timeout"


class SandboxCrash(SandboxFailure):
    error_class = "runtime"

    def __init__(self, message: str, status: ExitStatus, exited_cleanly: bool) -> None:
        super().__init__(message)
        self.status = status
        self.exited_cleanly = exited_cleanly  # exit status 0 mid-request: os._exit / a forged finish


class SandboxForged(SandboxFailure):
    """The channel carried a message the child's verifier code did not send."""

    error_class = "cheating"


class ChildSession:
    """One forked child serving one candidate."""

    def __init__(self, pool: "SandboxPool", memory_limit_bytes: int) -> None:
        self.pool = pool
        self.scratch = Path(tempfile.mkdtemp(prefix="kiln-sandbox-", dir=pool.scratch_root))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.pid = pool.zygote.fork(theirs.fileno(), str(self.scratch), pool.device_type)
        finally:
            theirs.close()
        self.sock = ours
        self.alive = True
        self.status: ExitStatus | None = None
        self.watchdog = RssWatchdog(self.pid, memory_limit_bytes, self.kill)
        self.requests = 0
        self.waited_s = 0.0

    def request(self, op: str, body: dict, budget_s: float, max_reply_bytes: int = 8 << 30) -> dict:
        """Send one request and wait up to `budget_s` for its reply (raises SandboxFailure)."""
        if not self.alive:
            raise SandboxCrash("the sandbox child is gone", self.status or ExitStatus(None, None), False)
        nonce = secrets.token_hex(12)
        deadline = time.monotonic() + budget_s
        self.requests += 1
        try:
            self.sock.settimeout(max(budget_s, 0.001))
            wire.send(self.sock, {"op": op, "nonce": nonce, **body})
            reply = wire.recv(self.sock, deadline, max_reply_bytes)
        except (wire.PeerTimeout, socket.timeout):
            self.kill()
            self._reap()
            raise SandboxTimeout(f"no answer within {budget_s:.0f} s") from None
        except (wire.PeerClosed, BrokenPipeError, ConnectionResetError):
            raise self._crashed() from None
        except wire.WireError as err:
            self.kill()
            self._reap()
            raise SandboxForged(f"the sandbox channel carried a malformed message ({err})") from None
        if not isinstance(reply, dict) or reply.get("nonce") != nonce:
            self.kill()
            self._reap()
            raise SandboxForged("the sandbox channel carried a reply the verifier did not ask for "
                                "(a forged result?)")
        reply["findings"] = parse_findings(reply.get("findings"))
        return reply

    def _crashed(self) -> SandboxCrash:
        self._reap()
        st = self.status or ExitStatus(None, None)
        if self.watchdog.tripped:
            limit = self.watchdog.limit >> 20
            msg = f"the process exceeded the memory limit of {limit} MB and was killed (out of memory)"
        elif st.signal:
            hint = _SIGNAL_HINTS.get(st.signal, f"signal {st.signal}")
            msg = f"the process crashed with {hint}"
        elif st.code == 0:
            msg = "the process exited (status 0) in the middle of a request: os._exit/exit is not a way to finish"
        else:
            msg = f"the process exited with status {st.code}"
        tail = self.output_tail()
        if tail:
            msg += f"\nlast output:\n{tail}"
        return SandboxCrash(msg, st, exited_cleanly=(st.code == 0 and not st.signal and not self.watchdog.tripped))

    def output_tail(self, limit: int = 1500) -> str:
        log = self.scratch / "output.log"
        try:
            with open(log, "rb") as f:
                f.seek(max(os.path.getsize(log) - limit, 0))
                return f.read(limit).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def kill(self) -> None:
        if not self.alive:
            return
        for fn in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                fn()
            except (ProcessLookupError, PermissionError):
                pass

    def _reap(self) -> None:
        if not self.alive:
            return
        self.kill()
        try:
            self.status = self.pool.zygote.reap(self.pid)
        except Exception:  # the zygote went away: its children went with it (PDEATHSIG)
            self.status = ExitStatus(None, None)
        self.alive = False

    def close(self) -> None:
        """Ask the child to leave, make sure it is gone, and remove its scratch directory."""
        if self.alive:
            try:
                self.sock.settimeout(2.0)
                wire.send(self.sock, {"op": "close", "nonce": ""})
            except OSError:
                pass
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and os.path.exists(f"/proc/{self.pid}") and _running(self.pid):
                time.sleep(0.01)
            self._reap()
        self.watchdog.stop()
        self.sock.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def parse_findings(raw) -> list[Violation]:
    """Violations from a child's reply, validated (the child is untrusted: anything odd is dropped)."""
    out = []
    if not isinstance(raw, list):
        return out
    for item in raw[:200]:
        if isinstance(item, dict) and isinstance(item.get("kind"), str):
            out.append(Violation.from_json({k: str(item.get(k, ""))[:400] for k in ("kind", "what", "where", "via")}))
    return out


class SandboxPool:
    """At most `slots` children at a time (the `run_workers` setting), all forked from one zygote."""

    def __init__(self, device_type: str, slots: int, memory_limit_mb: int, scratch_root: str | None = None) -> None:
        self.device_type = device_type
        self.memory_limit_bytes = memory_limit_mb << 20
        self.scratch_root = scratch_root
        if scratch_root:
            Path(scratch_root).mkdir(parents=True, exist_ok=True)
        self.zygote = Zygote()
        self._slots = threading.BoundedSemaphore(slots)
        self.children = 0

    def warm(self) -> None:
        """Start the zygote now rather than on the first request (it imports torch: seconds)."""
        self.zygote.start()

    @contextmanager
    def session(self):
        asked = time.perf_counter()
        with self._slots:
            waited = time.perf_counter() - asked
            child = ChildSession(self, self.memory_limit_bytes)
            child.waited_s = waited  # time spent queueing for a free slot (run_workers)
            self.children += 1
            try:
                yield child
            finally:
                child.close()

    def close(self) -> None:
        self.zygote.close()
