"""The compile child: run a candidate's module-level code with load_inline recording and building.

Runs in a fresh process forked by the zygote, already confined. Every step is appended to an
event log (one JSON object per line, flushed at once), so the parent can tell how far a child got
even when candidate code crashes the process, calls os._exit, or is killed at the deadline:
  start, spec (what a call asked for), built (key, .so, phases, ...), compile_error, unsupported,
  exception (module-level code raised), done.
A failed build raises `BuildAborted` into the candidate's code. It derives from BaseException, so
an `except Exception:` fallback in the candidate (e.g. "if the kernel fails, use torch") does not
hide the failure; the failure is in the log either way.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

from .cache import ArtifactCache
from .compiler import CompileFailed, ExtensionBuilder
from .preludes import PchStore
from .prebuilt import import_extension, refuse_load
from .spec import UnsupportedCall, spec_from_call
from .toolchain import Toolchain

CANDIDATE_FILE = "candidate.py"
CANDIDATE_MODULE = "candidate"


class BuildAborted(BaseException):
    """Raised into candidate code when its load_inline call cannot be built."""


class EventLog:
    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", buffering=1)
        self.t0 = time.monotonic()

    def emit(self, event: str, **fields) -> None:
        self._f.write(json.dumps({"event": event, "t": time.monotonic() - self.t0, **fields}) + "\n")
        self._f.flush()


class Recorder:
    """Stands in for load_inline during capture: record the call, build it, return the module."""

    def __init__(self, builder: ExtensionBuilder, log: EventLog, toolchain_id: str) -> None:
        self.builder = builder
        self.log = log
        self.toolchain_id = toolchain_id
        self.compile_seconds = 0.0

    def refuse_load(self, *args, **kwargs):
        """Stands in for cpp_extension.load (building from files), which the verifier refuses."""
        try:
            refuse_load(*args, **kwargs)
        except UnsupportedCall as e:
            self.log.emit("unsupported", message=str(e))
            raise BuildAborted(str(e)) from None

    def __call__(self, *args, **kwargs):
        try:
            spec = spec_from_call(*args, **kwargs)
        except (UnsupportedCall, TypeError) as e:
            message = str(e).replace("spec_from_call()", "load_inline()")
            self.log.emit("unsupported", message=message)
            raise BuildAborted(message) from None
        key = spec.key(self.toolchain_id)
        self.log.emit("spec", key=key, spec=spec.to_dict())
        t0 = time.monotonic()
        try:
            built = self.builder.build(spec)
        except CompileFailed as e:
            self.compile_seconds += time.monotonic() - t0
            self.log.emit("compile_error", key=key, name=spec.name, message=e.message, infra=e.infra,
                          unit=e.unit, phases=e.phases)
            raise BuildAborted(f"load_inline(name={spec.name!r}) failed to compile") from None
        except Exception as e:  # a bug or an unusable machine, not the candidate's fault
            self.compile_seconds += time.monotonic() - t0
            self.log.emit("compile_error", key=key, name=spec.name, infra=True, unit="builder",
                          message=f"{type(e).__name__}: {e}", phases={})
            raise BuildAborted(f"load_inline(name={spec.name!r}) could not be built") from None
        t1 = time.monotonic()
        try:
            module = import_extension(built.so_path)
        except ImportError as e:
            self.compile_seconds += time.monotonic() - t0
            self.log.emit("compile_error", key=key, name=spec.name, infra=False, unit="import",
                          message=_import_error_text(str(e), built.so_path), phases=built.phases)
            raise BuildAborted(f"load_inline(name={spec.name!r}) built a module that does not import") from None
        phases = {**built.phases, "import": time.monotonic() - t1}
        self.compile_seconds += time.monotonic() - t0
        self.log.emit("built", key=key, so=built.so_path, prelude=built.prelude, phases=phases,
                      vendor_libs=built.vendor_libs, cached=built.cached, notes=built.notes,
                      pch_wanted=[[p, list(prof)] for p, prof in built.pch_wanted])
        return module


def _import_error_text(message: str, so_path: str) -> str:
    message = message.replace(so_path, "<extension>")
    if "undefined symbol" in message:
        sym = message.rsplit("undefined symbol:", 1)[-1].strip()
        try:
            import subprocess
            sym = subprocess.run(["c++filt", sym], capture_output=True, text=True, timeout=10).stdout.strip() or sym
        except OSError:
            pass
        return (f"the extension does not import: undefined symbol {sym}. A function is declared (or bound) "
                f"but never defined with exactly that signature.")
    return f"the extension does not import: {message}"


def run_job(request: dict, confinement_notes: list[str]) -> None:
    """Capture one candidate. `request` comes from the service (trusted); the candidate is not."""
    scratch = Path(request["scratch"])
    log = EventLog(scratch / "events.jsonl")
    log.emit("start", confinement=confinement_notes)
    toolchain = Toolchain.from_dict(request["toolchain"])
    cache = ArtifactCache(Path(request["cache_dir"]), toolchain.digest, tmp_dir=scratch)
    pch = PchStore(Path(request["pch_dir"]), toolchain)
    builder = ExtensionBuilder(toolchain, cache, pch, request.get("prelude_policy", "auto"))
    recorder = Recorder(builder, log, toolchain.id)

    from torch.utils import cpp_extension
    cpp_extension.load_inline = recorder
    cpp_extension.load = recorder.refuse_load

    source = (scratch / CANDIDATE_FILE).read_text()
    module = types.ModuleType(CANDIDATE_MODULE)
    module.__file__ = str(scratch / CANDIDATE_FILE)
    sys.modules[CANDIDATE_MODULE] = module
    t0 = time.monotonic()
    try:
        code = compile(source, CANDIDATE_FILE, "exec")
        exec(code, module.__dict__)
    except BuildAborted:
        pass  # the log already says why
    except SyntaxError as e:
        log.emit("exception", type="SyntaxError", message=f"{e.msg} ({CANDIDATE_FILE}, line {e.lineno})",
                 traceback="")
    except BaseException as e:  # noqa: BLE001 - candidate code may raise anything, SystemExit included
        log.emit("exception", type=type(e).__name__, message=str(e)[:1000], traceback=_candidate_traceback(e))
    log.emit("done", seconds=time.monotonic() - t0, compile_seconds=recorder.compile_seconds)


def _candidate_traceback(e: BaseException) -> str:
    """The traceback frames that are in the candidate's file (ours are noise to the model)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == CANDIDATE_FILE]
    return "".join(traceback.format_list(frames[-5:]))


def child_main(request: dict) -> None:
    """Entry point in the freshly forked child (called by the zygote; never returns)."""
    code = 0
    try:
        _enter_sandbox(request)
        notes = _confine(request)
        run_job(request, notes)
    except BaseException:  # noqa: BLE001 - report and leave; the parent reads the event log
        traceback.print_exc()
        code = 70
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _enter_sandbox(request: dict) -> None:
    """New session (the parent kills the whole group), quiet stdio, die with the zygote."""
    import ctypes
    import signal

    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    scratch = Path(request["scratch"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(scratch / "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(scratch / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, 65536)  # the zygote's pipes to the service stay out of the candidate's reach
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the zygote gone means the service is gone
    import faulthandler
    faulthandler.enable(file=sys.stderr)


def _confine(request: dict) -> list[str]:
    import resource

    from actors.verifier.isolation import confine

    notes = confine(Path(request["scratch"]), network=False)
    if not request.get("gpu_visible", False):
        # The compile stage must never touch a GPU (a timing window may be open on it).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # RLIMIT_AS is safe here: a compile child never creates a CUDA context. It bounds address
    # space, and a CUDA build of torch maps gigabytes of libraries at import, so the limit is what
    # the child already has plus the budget (compilers exec'd from here start from scratch).
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + int(request["memory_limit_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return notes
