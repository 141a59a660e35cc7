"""Parent side of sandboxed execution: a bounded pool of jailed children with watchdogs.

`SandboxPool.session()` forks a fresh sandbox from the zygote (one per candidate), jailed as
isolation.run_jail says, watches the resident memory of its process tree (RssWatchdog; RLIMIT_AS
would break CUDA contexts) and gives every request a wall-clock deadline. The first request, `hello`,
is answered before any candidate code exists: its jail report is the one the verdict trusts. A
sandbox that hangs is killed (and with it its whole PID namespace); one that crashes, exits, or is
killed for memory is reaped and its own exit status recorded. Either way only that sandbox is lost:
the next session forks a new one, and the zygote (which never runs candidate code) keeps serving.
Replies are read with `wire.recv` (no pickle) and must echo the request's nonce. The evidence pipe
carries what the compute fence refused, written by the sandbox the moment it happened.
"""

from __future__ import annotations

import fcntl
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

from actors.verifier import isolation, wire
from actors.verifier.isolation import RssWatchdog
from actors.verifier.legality import Violation
from actors.verifier.zygote import ExitStatus, Zygote, ZygoteError

_SIGNAL_HINTS = {
    signal.SIGSEGV: "a segmentation fault (out-of-bounds pointer or index?)",
    signal.SIGBUS: "a bus error (misaligned or out-of-bounds access)",
    signal.SIGFPE: "a floating-point exception (integer division by zero?)",
    signal.SIGILL: "an illegal instruction",
    signal.SIGABRT: "an abort (a failed assertion or an uncaught C++ exception)",
    signal.SIGKILL: "SIGKILL (the system's out-of-memory killer?)",
    signal.SIGSYS: "SIGSYS (a forbidden system call)",
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


class SandboxInfra(SandboxFailure):
    """The sandbox could not be started (the system's fault)."""

    error_class = "infra"


class ChildSession:
    """One jailed sandbox serving one candidate."""

    def __init__(self, pool: "SandboxPool", memory_limit_bytes: int, check_cuda: bool = False) -> None:
        self.pool = pool
        self.scratch = Path(tempfile.mkdtemp(prefix="kiln-sandbox-", dir=pool.scratch_root))
        self.alive = False
        self.status: ExitStatus | None = None
        self.requests = 0
        self.waited_s = 0.0
        self.evidence: list[Violation] = []
        self.jail: dict = {}
        self.cuda_error: str | None = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ev_r, ev_w = os.pipe()
        fcntl.fcntl(ev_r, fcntl.F_SETFL, os.O_NONBLOCK)
        self._evidence_fd = ev_r
        self._evidence_buf = b""
        spec = isolation.run_jail(str(self.scratch / "work"), cuda=pool.device_type == "cuda",
                                  uid=pool.zygote.next_uid(), hidden=pool.hidden, visible=pool.visible)
        try:
            spawned = pool.zygote.spawn("run", spec, [theirs.fileno(), ev_w], str(self.scratch / "output.log"),
                                        {"device": pool.device_type})
        except ZygoteError as err:
            ours.close()
            os.close(ev_r)
            raise SandboxInfra(str(err)) from None
        finally:
            theirs.close()
            os.close(ev_w)
        self.spawned = spawned
        self.pid = spawned.pid
        self.sandbox_pid = spawned.sandbox or spawned.pid
        self.sock = ours
        self.alive = True
        self.watchdog = RssWatchdog(self.sandbox_pid, memory_limit_bytes, self.kill)
        try:
            hello = self.request("hello", {"check_cuda": check_cuda}, 120)
            self.jail = hello.get("jail") or {}
            self.cuda_error = hello.get("cuda")
        except SandboxFailure as err:
            tail = self.output_tail()
            self.close()
            raise SandboxInfra(f"the sandbox did not start: {err}" + (f"\n{tail}" if tail else "")) from None

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
        finally:
            self.drain_evidence()
        if not isinstance(reply, dict) or reply.get("nonce") != nonce:
            self.kill()
            self._reap()
            raise SandboxForged("the sandbox channel carried a reply the verifier did not ask for "
                                "(a forged result?)")
        reply["findings"] = parse_findings(reply.get("findings"))
        return reply

    def drain_evidence(self) -> None:
        """Read what the compute fence wrote to the evidence pipe (never blocks; nothing once closed:
        a closed descriptor's number may already belong to another session's socket)."""
        while self._evidence_fd >= 0 and len(self.evidence) < 200:
            try:
                chunk = os.read(self._evidence_fd, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._evidence_buf += chunk
        *lines, self._evidence_buf = self._evidence_buf.split(b"\n")
        for line in lines[:200]:
            parts = line.decode("utf-8", "replace").split("\t")
            if len(parts) >= 2 and parts[0] and len(self.evidence) < 200:
                self.evidence.append(Violation(parts[0][:40], parts[1][:200], (parts[2] if len(parts) > 2 else "")[:200],
                                               "recorded by the compute fence as it refused"))

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
        if self.alive:
            self.spawned.kill()

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
            while time.monotonic() < deadline and _running(self.pid):
                time.sleep(0.005)
            self._reap()
        self.watchdog.stop()
        self.spawned.close()
        self.drain_evidence()
        self.sock.close()
        os.close(self._evidence_fd)
        self._evidence_fd = -1
        shutil.rmtree(self.scratch, ignore_errors=True)
        shutil.rmtree(f"{self.scratch}/work.root", ignore_errors=True)

    def exit_status(self) -> dict:
        return (self.status or ExitStatus(None, None)).to_json()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
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
    """At most `slots` sandboxes at a time (the `run_workers` setting), all forked from one zygote.

    `hidden` and `visible` extend the jail's view: the verifier's cache directory is hidden, the
    directory of built extensions is visible (read-only) so the candidate can import its own."""

    def __init__(self, device_type: str, slots: int, memory_limit_mb: int, scratch_root: str | None = None, *,
                 zygote: Zygote | None = None, hidden: tuple[str, ...] = (), visible: tuple[str, ...] = ()) -> None:
        self.device_type = device_type
        self.memory_limit_bytes = memory_limit_mb << 20
        self.scratch_root = scratch_root
        if scratch_root:
            Path(scratch_root).mkdir(parents=True, exist_ok=True)
        self.own_zygote = zygote is None
        self.zygote = zygote or Zygote()
        self.hidden, self.visible = tuple(hidden), tuple(visible)
        self._slots = threading.BoundedSemaphore(slots)
        self.children = 0

    def warm(self) -> None:
        """Start the zygote now rather than on the first request (it imports torch: seconds)."""
        self.zygote.start()

    def probe(self) -> dict:
        """The jail report of a sandbox on this machine (start-up check): which layers hold. On cuda,
        a sandbox must also be able to create a CUDA context; if it cannot, the verifier cannot work
        here at all, and says why (SandboxInfra)."""
        with self._slots:
            child = ChildSession(self, self.memory_limit_bytes, check_cuda=self.device_type == "cuda")
            try:
                if child.cuda_error:
                    raise SandboxInfra(f"CUDA does not initialise inside the sandbox ({child.cuda_error}); "
                                       f"its jail shows /dev/nvidia*, /sys, /usr and the library path: is the "
                                       f"driver library elsewhere?")
                return dict(child.jail)
            finally:
                child.close()

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
        if self.own_zygote:
            self.zygote.close()
