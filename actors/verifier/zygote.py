"""The zygote: one fork server for every sandboxed process of the verifier.

Starting Python and importing torch costs seconds; forking a process that already has them costs
milliseconds. The zygote imports torch and the verifier's sandbox code once, never initialises CUDA
and never runs candidate code, then forks one fresh, jailed process per job (`jail.enter`):

    kind      entry                               runs
    run       actors.verifier.sandbox.child_main   the candidate: import, __init__, forward (execution)
    capture   actors.verifier.build.capture        the candidate's module-level code (compile stage)
    build     actors.verifier.build.worker         the compilers for one extension (trusted code,
                                                   untrusted input: jailed, may run programs)
    reference actors.verifier.reference_child      a reference a client sent: its module, draws,
                                                   forward and baselines (untrusted code, unsealed:
                                                   it computes with ATen; jailed_reference.py)

Control protocol (SOCK_SEQPACKET, one JSON message per packet; `fork` carries the job's socket and,
for `run`, the write end of its evidence pipe):
    {"op": "fork", "kind": k, "jail": JailSpec, "log": path} + fds -> {"pid": warden, "sandbox": pid}
    {"op": "reap", "pid": warden, "timeout_s": t}                  -> {"pid", "code", "signal"}
    {"op": "ping"}                                                 -> {"pong": true}
The zygote is a child subreaper. It exits when its control socket closes (the verifier is gone), even
in the middle of a fork or a reap, and kills its wardens; each warden dies with the zygote
(PR_SET_PDEATHSIG, armed first thing after the fork, then the parent checked, so a zygote that died
in between is seen); each sandbox dies with its warden (PR_SET_PDEATHSIG, set again after the sandbox
changes uid, which clears it), and with the sandbox, its whole PID namespace (docs/verifier.md, P10).

What the zygote's interpreter loads, every sandbox has: it loads the sandbox's native parts
(actors/verifier/native: kiln_native first, then torch, then the compute fence) and never ctypes,
numpy or any other module that hands Python raw memory (native/shim.py).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
_MAX_MSG = 256 * 1024
KINDS = ("run", "capture", "build", "reference")
# Kinds whose processes never run a timed window: background work (background.py), so compilers and
# a candidate's module-level code do not take the CPU a sandbox or a baseline is timed on.
BACKGROUND_KINDS = ("capture", "build")
# One sequence per verifier process (every Zygote in it): two sandboxes alive at once never share a uid.
_JOBS = itertools.count(1)


# ----------------------------------------------------------------------------------- the server


class _VerifierGone(Exception):
    """The control socket closed while the zygote waited on a child: the verifier is gone."""


def _child(kind: str, fds: list[int], req: dict, zygote: int) -> None:
    """In the forked child: tied to the zygote's life, own process group, stdio to the job's log, the
    jail, then the job."""
    code = 6
    try:
        from actors.verifier import jail

        # Before anything else: a child that outlived a SIGKILLed zygote would be reparented to init and
        # run (and, jailed, spin under a uid nobody watches) with no one left to reap or kill it.
        jail.die_with_parent(zygote)
        os.setsid()
        if kind in BACKGROUND_KINDS:
            from actors.verifier.background import lower_priority

            lower_priority()  # before the jail: its seccomp filter need not allow setpriority
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        report_fd = fds[-1]
        keep = set(fds[:-1])
        _BEFORE_JAIL.get(kind, _nothing)()

        def report_pid(pid: int) -> None:
            os.write(report_fd, f"{pid}\n".encode())
            os.close(report_fd)

        spec = jail.JailSpec.from_json(req["jail"])
        report = jail.enter(spec, report_pid)
        for fd in range(3, 1024):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        code = _ENTRIES[kind](fds[:-1], spec, report, req.get("args") or {})
    except BaseException:  # noqa: BLE001 - report and leave; the parent reads the log
        import traceback

        traceback.print_exc()
    finally:
        # A plain try, not contextlib.suppress: candidate code ran in this process and could have replaced
        # that; nothing may keep the child from reaching os._exit.
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001, S110
            pass
        os._exit(code)


def _run_entry(fds, spec, report, args) -> int:
    from actors.verifier.sandbox import child_main

    return child_main(fds, spec, report, args)


def _capture_entry(fds, spec, report, args) -> int:
    from actors.verifier.build.capture import child_main

    return child_main(fds, spec, report, args)


def _build_entry(fds, spec, report, args) -> int:
    from actors.verifier.build.worker import child_main

    return child_main(fds, spec, report, args)


def _reference_entry(fds, spec, report, args) -> int:
    from actors.verifier.reference_child import child_main  # imported before the jail (_BEFORE_JAIL)

    return child_main(fds, spec, report, args)


def _reference_imports() -> None:
    """A reference's process imports what it serves while Kiln's tree is still visible (the jail hides
    it). It runs no candidate code and is never sealed, so it gets back the ordinary ctypes and numpy
    that the zygote keeps out of every sandbox (native/shim.py): a reference may use them, as it may in
    the verifier's own process."""
    from actors.verifier.native import shim

    shim.lift()
    import actors.verifier.reference_child  # noqa: F401


def _nothing() -> None:
    return None


_ENTRIES = {"run": _run_entry, "capture": _capture_entry, "build": _build_entry, "reference": _reference_entry}
# Work a kind does in its forked child before the jail is entered (still single-threaded).
_BEFORE_JAIL = {"reference": _reference_imports}


def _fork(req: dict, fds: list[int], ctrl: socket.socket) -> dict:
    kind = req.get("kind")
    if kind not in KINDS or not fds:
        for fd in fds:
            os.close(fd)
        return {"error": f"cannot fork a {kind!r} job"}
    r, w = os.pipe()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(kind, fds + [w], req, zygote)
    os.close(w)
    for fd in fds:
        os.close(fd)
    try:
        sandbox = _read_pid(r, timeout_s=30.0, ctrl=ctrl)
    except _VerifierGone:
        os.kill(pid, signal.SIGKILL)  # not yet among the wardens that end() kills
        raise
    finally:
        os.close(r)
    return {"pid": pid, "sandbox": sandbox}


def _read_pid(fd: int, timeout_s: float, ctrl: socket.socket) -> int | None:
    data = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in data:
        left = deadline - time.monotonic()
        ready = select.select([fd, ctrl], [], [], max(left, 0))[0] if left > 0 else []
        if ctrl in ready:
            raise _VerifierGone
        if fd not in ready:
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            return None
        data += chunk
    try:
        return int(data.split(b"\n", 1)[0])
    except ValueError:
        return None


def serve(ctrl: socket.socket) -> None:
    statuses: dict[int, tuple[int, int]] = {}
    wardens: set[int] = set()

    def collect(block_for: int | None = None, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid:
                if pid in wardens:  # orphans re-parented to this subreaper are reaped silently
                    statuses[pid] = (
                        os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1,
                        os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                    )
                continue
            if block_for is None or block_for in statuses or block_for not in wardens or time.monotonic() > deadline:
                return
            # The client waits for this reply and sends nothing meanwhile: a readable socket is its EOF.
            if select.select([ctrl], [], [], 0.002)[0]:
                raise _VerifierGone

    def end() -> None:  # the verifier is gone: so are its sandboxes
        for pid in wardens - set(statuses):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, _MAX_MSG, 4)
        except OSError:
            msg, fds = b"", []
        if not msg:
            end()
            return
        try:
            req = json.loads(msg)
            op = req.get("op")
        except ValueError:
            req, op = {}, None
        try:
            if op == "fork":
                reply = _fork(req, list(fds), ctrl)
                if "pid" in reply:
                    wardens.add(reply["pid"])
            elif op == "reap":
                pid = int(req.get("pid", -1))
                collect(block_for=pid, timeout_s=float(req.get("timeout_s", 10.0)))
                code, sig = statuses.pop(pid, (None, None))
                if code is not None or sig is not None:
                    wardens.discard(pid)
                reply = {"pid": pid, "code": code, "signal": sig}
            elif op == "ping":
                collect()
                reply = {"pong": True}
            else:
                for fd in fds:
                    os.close(fd)
                reply = {"error": f"unknown request {op!r}"}
        except _VerifierGone:  # seen mid-fork or mid-reap: a wait of up to 30 s is not waited out
            end()
            return
        ctrl.send(json.dumps(reply).encode())


def main() -> int:
    fd = int(sys.argv[1])
    ctrl = socket.socket(fileno=fd)
    # No PR_SET_PDEATHSIG here: it fires when the *thread* that started us exits, and verifiers start
    # the zygote from whichever thread needs it first. The control socket's EOF is the signal instead.
    # Preload everything a child needs, so a fork is all it costs. CUDA stays uninitialised here, and
    # so does the CUDA driver: torch.cuda.is_available() normally asks the driver for the device count,
    # which marks every later fork "bad" (children then cannot use CUDA); asking NVML instead does not.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from actors.verifier import native
    from actors.verifier.native import shim

    kn = native.load(native.NATIVE, sys.argv[2])
    shim.install(kn)  # before torch: ctypes and numpy never load in this interpreter
    import torch

    # The children's own modules, preloaded. Not torch.utils.cpp_extension: importing it asks for the
    # device count, which without ctypes NVML cannot answer, so torch asks the CUDA driver, and every
    # fork would then be unable to use CUDA. Each child imports it (before any candidate code), which
    # costs a few tenths of a second.
    import actors.verifier.build.capture
    import actors.verifier.build.worker
    import actors.verifier.jail
    import actors.verifier.sandbox  # noqa: F401 - preloaded, so a fork is all a child costs
    from actors.verifier import fence

    fence.install(sys.argv[3] if len(sys.argv) > 3 else None)  # inherited by every child
    if torch.cuda.is_initialized() or _forks_are_poisoned():  # fail loudly once, not per candidate
        print("kiln zygote: CUDA was initialised while preloading; sandbox children cannot be forked", file=sys.stderr)
        return 3
    kn.prctl(PR_SET_CHILD_SUBREAPER, 1)
    ctrl.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    serve(ctrl)
    return 0


def _forks_are_poisoned() -> bool:
    """True when a forked child could not initialise CUDA (torch's bad-fork flag is set in children
    once the parent touched the CUDA driver, even without initialising torch.cuda)."""
    import torch

    probe = getattr(torch._C, "_cuda_isInBadFork", None)
    if probe is None:  # a CPU-only build of torch: there is no CUDA to poison
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(1 if probe() else 0)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 1


# ----------------------------------------------------------------------------------- the client


class ZygoteError(RuntimeError):
    """The zygote could not be started or stopped answering: an infrastructure failure."""


@dataclass(frozen=True)
class ExitStatus:
    code: int | None  # exit status when the process exited; -1 when it was killed; None if unknown
    signal: int | None  # the signal that killed it, 0 if none

    def describe(self) -> str:
        if self.signal:
            try:
                return f"killed by {signal.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        return "unknown" if self.code is None else f"exit status {self.code}"

    def to_json(self) -> dict:
        return {"code": self.code, "signal": self.signal, "text": self.describe()}


@dataclass
class Spawned:
    """A jailed process and its warden, with pidfds: a signal sent through them can never reach a
    process that reused a pid after the jailed one exited."""

    pid: int  # the warden (reap and kill this one)
    sandbox: int | None  # the jailed process itself (watch its memory and process tree)
    _fds: list = None

    def __post_init__(self) -> None:
        self._fds = []
        for p in {self.pid, self.sandbox or self.pid}:
            try:
                self._fds.append(os.pidfd_open(p))
            except OSError:  # already gone
                pass

    def kill(self) -> None:
        """SIGKILL the jailed process (PID 1 of its namespace: all of it goes) and its warden."""
        for fd in self._fds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class Zygote:
    """Parent-side handle: starts the zygote lazily and restarts it if it died. Thread-safe."""

    def __init__(
        self, start_timeout_s: float = 120.0, native_library: str | None = None, fence_library: str | None = None
    ) -> None:
        self.start_timeout_s = start_timeout_s
        # The sandbox's native parts (actors/verifier/native), set before the first start: kiln_native
        # is required (the jail's system calls); without the fence, the "fence" layer is reported missing.
        self.native_library = native_library
        self.fence_library = fence_library
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ctrl: socket.socket | None = None
        self.starts = 0
        self._closed = False  # close() is final: a call still in flight then (a reap) starts no new zygote

    def _ensure(self) -> socket.socket:
        if self._proc is not None and self._proc.poll() is None and self._ctrl is not None:
            return self._ctrl
        self._shutdown()
        if self._closed:
            raise ZygoteError("the sandbox zygote was closed (its verifier stopped)")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")
        if not self.native_library:
            theirs.close()
            ours.close()
            raise ZygoteError("the sandbox's native module (kiln_native) was not built")
        argv = [sys.executable, "-m", "actors.verifier.zygote", str(theirs.fileno()), self.native_library]
        if self.fence_library:
            argv.append(self.fence_library)
        self._proc = subprocess.Popen(
            argv, pass_fds=[theirs.fileno()], env=env, cwd=root, stdin=subprocess.DEVNULL, start_new_session=True
        )
        theirs.close()
        ours.settimeout(self.start_timeout_s)
        try:
            hello = json.loads(ours.recv(_MAX_MSG) or b"{}")
        except (OSError, ValueError) as err:
            self._proc.kill()
            raise ZygoteError(f"the sandbox zygote did not start: {err}") from None
        if not hello.get("ready"):
            self._proc.kill()
            raise ZygoteError("the sandbox zygote exited during start-up (see its stderr)")
        self._ctrl = ours
        self.starts += 1
        return ours

    def _ask(self, req: dict, fds: list[int] = (), timeout_s: float = 60.0) -> dict:
        with self._lock:
            ctrl = self._ensure()
            try:
                ctrl.settimeout(timeout_s)
                socket.send_fds(ctrl, [json.dumps(req).encode()], list(fds))
                raw = ctrl.recv(_MAX_MSG)
            except OSError as err:
                self._shutdown()
                raise ZygoteError(f"the sandbox zygote stopped answering: {err}") from None
            if not raw:
                self._shutdown()
                raise ZygoteError("the sandbox zygote exited")
            return json.loads(raw)

    def start(self) -> None:
        with self._lock:
            self._ensure()

    @property
    def started(self) -> bool:
        return self._proc is not None

    def next_uid(self) -> int:
        """A fresh sandbox uid (jail.sandbox_uid) for the next job of this verifier process."""
        from actors.verifier.jail import sandbox_uid

        return sandbox_uid(next(_JOBS) + 7919 * os.getpid())

    def spawn(self, kind: str, jail_spec, fds: list[int], log: str, args: dict | None = None) -> Spawned:
        reply = self._ask(
            {"op": "fork", "kind": kind, "jail": jail_spec.to_json(), "log": log, "args": args or {}}, fds
        )
        if "pid" not in reply:
            raise ZygoteError(f"the sandbox zygote could not start a {kind} process: {reply.get('error')}")
        return Spawned(int(reply["pid"]), reply.get("sandbox"))

    def reap(self, pid: int, timeout_s: float = 10.0) -> ExitStatus:
        reply = self._ask({"op": "reap", "pid": pid, "timeout_s": timeout_s}, timeout_s=timeout_s + 30)
        return ExitStatus(reply.get("code"), reply.get("signal"))

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _shutdown(self) -> None:
        if self._ctrl is not None:
            self._ctrl.close()
            self._ctrl = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._shutdown()


if __name__ == "__main__":
    sys.exit(main())
