"""The capture process: runs a candidate's module-level code with load_inline recording its calls.

Runs in a process forked by the zygote and jailed like any process that runs candidate code
(jail.py; Kiln's own modules are gone from it, isolation.hide_kiln_modules). It builds nothing
itself: each `load_inline(...)` call becomes a build request to the trusted service on this
process's socket, which compiles it in a separate jailed build process, checks what the library
imports, publishes it, and answers with its path (read-only here), which the call then imports, so
module-level code that calls into the extension works. The libraries it gets are the ones the service built for this job alone, seen at a neutral path
(jail.LIBDIR), the only directory native extensions may load from once it is sealed. Events, one
message each (wire.py):
  start {jail}, build {spec} (answered {ok, so} or {ok: False, message}), unsupported {message},
  exception {type, message, traceback}, done {seconds, compile_seconds, findings}.
A failed build raises `BuildAborted` into the candidate's code. It derives from BaseException, so
an `except Exception:` fallback in the candidate (e.g. "if the kernel fails, use torch") does not
hide the failure; the service knows about it either way.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
import types
from pathlib import Path

from actors.verifier import fence, isolation, native, seccomp, wire

from .devices import install as install_device_answers
from .prebuilt import import_extension, refuse_load
from .spec import UnsupportedCall, spec_from_call

CANDIDATE_FILE = "candidate.py"
CANDIDATE_MODULE = "candidate"
MAX_MESSAGE = 1000  # an exception's or refusal's text, as sent to the service


class BuildAborted(BaseException):
    """Raised into candidate code when its load_inline call cannot be built."""


class Channel:
    """This process's side of the conversation with the build service."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.t0 = time.monotonic()

    def event(self, event: str, **fields) -> None:
        wire.send(self.sock, {"event": event, "t": time.monotonic() - self.t0, **fields})

    def ask(self, event: str, **fields) -> dict:
        self.event(event, **fields)
        reply = wire.recv(self.sock)
        return reply if isinstance(reply, dict) else {}


def recorder(channel: Channel):
    """(load_inline, load, seconds): the stand-ins for torch's during capture. load_inline asks the
    service to build the call and imports the result; `seconds()` is the time spent waiting for builds.
    Closures, so the candidate holding `load_inline` holds no channel object (code from Kiln's tree:
    its closure cells refuse once armed). The socket itself is in the process, and a candidate may
    still write to it: the service bounds everything it reads from it."""
    waited = [0.0]
    event, ask = channel.event, channel.ask

    def load(*args, **kwargs):
        """Stands in for cpp_extension.load (building from files), which the verifier refuses."""
        try:
            refuse_load(*args, **kwargs)
        except UnsupportedCall as e:
            event("unsupported", message=str(e))
            raise BuildAborted(str(e)) from None

    def load_inline(*args, **kwargs):
        try:
            spec = spec_from_call(*args, **kwargs)
        except (UnsupportedCall, TypeError) as e:
            message = str(e).replace("spec_from_call()", "load_inline()")[:MAX_MESSAGE]
            event("unsupported", message=message)
            raise BuildAborted(message) from None
        t0 = time.monotonic()
        reply = ask("build", spec=spec.to_dict())
        waited[0] += time.monotonic() - t0
        if not reply.get("ok"):
            raise BuildAborted(f"load_inline(name={spec.name[:100]!r}) failed to build") from None
        try:
            return import_extension(str(reply["so"]))
        except ImportError as e:
            event("import_error", name=spec.name[:100], message=str(e)[:500])
            raise BuildAborted(f"load_inline(name={spec.name[:100]!r}) built a module that does not import") from None

    return load_inline, load, lambda: waited[0]


def run_job(channel: Channel, scratch: Path, evidence_fd: int, libdir: str = "", device: dict | None = None) -> None:
    """Capture one candidate (its source is scratch/candidate.py, written by the service). The process
    is sealed (fence.py) before the candidate's first line runs, as the execution sandbox is: module-level
    code computes nothing with ATen and reaches nothing of this process's. What this process reports
    can only cost the candidate: the service builds what it asks for, checks what it built, and the
    execution stage imports the module afresh. `libdir`: where the service puts the libraries it
    built for this job (only those): the one directory its extensions may load from. `device`: the
    verifier's GPU, described, that module-level device queries are answered about (devices.py)."""
    load_inline, load, compile_seconds = recorder(channel)
    from torch.utils import cpp_extension

    cpp_extension.load_inline = load_inline
    cpp_extension.load = load
    if device:  # the verifier's GPU, described: module-level device queries are answered (devices.py)
        install_device_answers(device)

    path = scratch / CANDIDATE_FILE
    source = path.read_text()
    module = types.ModuleType(CANDIDATE_MODULE)
    module.__file__ = str(path)
    sys.modules[CANDIDATE_MODULE] = module
    t0 = time.monotonic()
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as e:
        channel.event(
            "exception", type="SyntaxError", message=f"{e.msg} ({CANDIDATE_FILE}, line {e.lineno})", traceback=""
        )
        channel.event("done", seconds=time.monotonic() - t0, compile_seconds=0.0)
        return
    kn = native.loaded()
    fence.install_refusers(kn)
    own = (libdir.rstrip("/") + "/",) if libdir else ()
    native.arm(kn, evidence_fd, str(path), source, seccomp.armed_seccomp_program(), own_libraries=own)
    site_of = kn.traceback_site
    try:
        exec(code, module.__dict__)  # noqa: S102 - by design: candidate code runs here, inside the sandbox
    except BuildAborted:
        pass  # the service already knows why
    except BaseException as e:  # noqa: BLE001 - candidate code may raise anything, SystemExit included
        where = site_of(e.__traceback__)
        channel.event(
            "exception",
            type=type(e).__name__,
            message=str(e)[:MAX_MESSAGE],
            traceback=where.replace(str(path), CANDIDATE_FILE),
        )
    channel.event("done", seconds=time.monotonic() - t0, compile_seconds=compile_seconds())


def child_main(fds: list[int], spec, report, args: dict) -> int:
    """Entry point in the jailed capture process (called by the zygote)."""
    isolation.hide_kiln_modules()
    import faulthandler

    faulthandler.enable(file=sys.stderr)
    # RLIMIT_AS is safe here: a capture process never creates a CUDA context. It bounds address
    # space, and a CUDA build of torch maps gigabytes of libraries at import, so the limit is what
    # the process already has plus the budget.
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + int(args.get("memory_limit_bytes", 8 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    channel = Channel(socket.socket(fileno=fds[0]))
    channel.event("start", jail=report.to_json())
    try:
        libs = spec.mounts[0][0] if spec.mounts else ""
        libdir = spec.seen_at(libs, report) if libs else ""
        run_job(channel, Path(spec.inside(report)), fds[1] if len(fds) > 1 else -1, libdir, args.get("device"))
    except wire.WireError:
        return 3
    return 0
