"""The zygote: a long-lived process that imports torch once and forks one sandbox child per candidate.

Starting Python and importing torch costs seconds; forking a process that already has them costs
milliseconds. The zygote never initialises CUDA and never runs candidate code, so each fork starts
clean: the child creates its own CUDA context, and whatever a candidate does to its process (patches,
threads, a corrupted context after an illegal memory access, a crash) dies with that child.

Control protocol (SOCK_SEQPACKET, one JSON message per packet; `fork` carries the child's socket):
    {"op": "fork", "scratch": dir, "device": "cpu"|"cuda"} + fd  ->  {"pid": n}
    {"op": "reap", "pid": n}                                       ->  {"pid": n, "code": c, "signal": s}
    {"op": "ping"}                                                 ->  {"pong": true}
The zygote exits when its control socket closes (the verifier is gone) and kills its children;
a child also dies with the zygote (PR_SET_PDEATHSIG; the zygote is single-threaded).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
_MAX_MSG = 64 * 1024


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# ----------------------------------------------------------------------------------- the server


def _child(fd: int, scratch: str, device: str) -> None:
    """In the forked child: own process group, stdio to scratch files, then the sandbox loop."""
    code = 6
    try:
        os.setsid()
        _die_with_parent()
        Path(scratch).mkdir(parents=True, exist_ok=True)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(os.path.join(scratch, "output.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        from actors.verifier.sandbox import child_main  # preloaded by the zygote

        code = child_main(fd, scratch, device)
    finally:
        os._exit(code)


def serve(ctrl: socket.socket) -> None:
    statuses: dict[int, tuple[int, int]] = {}

    def collect(block_for: int | None = None, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid:
                statuses[pid] = (os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1,
                                 os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0)
                continue
            if block_for is None or block_for in statuses or time.monotonic() > deadline:
                return
            time.sleep(0.005)

    children: set[int] = set()

    def kill_children() -> None:
        for pid in children - set(statuses):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, _MAX_MSG, 1)
        except OSError:
            msg = b""
        if not msg:  # the verifier is gone: so are its sandboxes
            kill_children()
            return
        req = json.loads(msg)
        op = req.get("op")
        if op == "fork" and fds:
            pid = os.fork()
            if pid == 0:
                ctrl.close()
                _child(fds[0], req["scratch"], req["device"])
            os.close(fds[0])
            children.add(pid)
            reply = {"pid": pid}
        elif op == "reap":
            collect(block_for=req["pid"], timeout_s=float(req.get("timeout_s", 10.0)))
            code, sig = statuses.pop(req["pid"], (None, None))
            children.discard(req["pid"])
            reply = {"pid": req["pid"], "code": code, "signal": sig}
        elif op == "ping":
            collect()
            reply = {"pong": True}
        else:
            for fd in fds:
                os.close(fd)
            reply = {"error": f"unknown request {op!r}"}
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
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - imported lazily by dispatch modes, and it re-binds torch.manual_seed
    import torch.utils.cpp_extension  # noqa: F401

    import actors.verifier.sandbox  # noqa: F401

    try:
        import actors.verifier.build  # noqa: F401
    except ImportError:
        pass
    if torch.cuda.is_initialized() or _forks_are_poisoned():  # fail loudly once, not per candidate
        print("kiln zygote: CUDA was initialised while preloading; sandbox children cannot be forked",
              file=sys.stderr)
        return 3
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
    code: int | None  # exit status when the child exited; -1 when it was killed; None if unknown
    signal: int | None  # the signal that killed it, 0 if none


class Zygote:
    """Parent-side handle: starts the zygote lazily and restarts it if it died."""

    def __init__(self, start_timeout_s: float = 120.0) -> None:
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ctrl: socket.socket | None = None
        self.starts = 0

    def _ensure(self) -> socket.socket:
        if self._proc is not None and self._proc.poll() is None and self._ctrl is not None:
            return self._ctrl
        self._shutdown()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._proc = subprocess.Popen([sys.executable, "-m", "actors.verifier.zygote", str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], env=env, cwd=root, stdin=subprocess.DEVNULL)
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

    def _ask(self, req: dict, fds: list[int] = (), timeout_s: float = 30.0) -> dict:
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

    def fork(self, child_fd: int, scratch: str, device: str) -> int:
        return int(self._ask({"op": "fork", "scratch": scratch, "device": device}, [child_fd])["pid"])

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
            self._shutdown()


if __name__ == "__main__":
    sys.exit(main())
