"""The runtime legality gate, active in the sandbox child around every execution of the candidate.

Everything here is imported (and every function it relies on is captured) before the candidate's
module is, and Kiln's modules are gone from `sys.modules` and from the sandbox's filesystem by then
(isolation.hide_kiln_modules), so candidate code cannot import this module to switch it off:
* the compute fence (fence.py) is what enforces "no PyTorch compute in forward": every ATen kernel
  outside tensor plumbing refuses to run while forward runs. The parts below add attribution
  (which line, through which API) and catch what is not an ATen op.
* `ForwardGate`: an ATen dispatch mode around each `ModelNew.forward` call in correctness trials.
  Every op outside `PLUMBING_OPS` is recorded with the candidate line that reached it and how (a torch
  Python API, or native code). A device-to-host copy on cuda is a host round-trip. A profile hook on
  the calling thread catches a tensor handed to numpy or back.
* `AuditMonitor`: a `sys.addaudithook` hook (irremovable) that flags, while armed and when the
  candidate's own code is the caller, introspection (frames, gc, code objects), process and network
  access, ctypes, exec; and from any caller, imports of Kiln's packages or of the task's reference,
  and opens of process memory (/proc/*/mem).
* `Integrity`: identities of the functions the verifier relies on (torch.allclose, the timers,
  torch.cuda.Event, Tensor methods, builtins) and the contents of the sandbox's own modules and
  classes, re-checked after every phase; any change is a patch attempt.
* thread and output-settle checks: work that is still running after forward returned.
Whatever this process reports is a finding against the candidate, never evidence for it: the
verdict, the comparison and the clock that counts live in the verifier (runner.py).
"""

from __future__ import annotations

import builtins
import linecache
import os
import sys
import sysconfig
import threading
import types

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from actors.verifier import fence
from actors.verifier.legality import COPY_OPS, PLUMBING_OPS, Violation

_TB = torch._C.TensorBase
_getframe = sys._getframe
_listdir = os.listdir
_enumerate_threads = threading.enumerate
_equal = torch.equal
_from_numpy = torch.from_numpy
# The interpreter's own library (where `os` lives); site-packages below it is not "stdlib".
_STDLIB = os.path.realpath(os.path.dirname(os.__file__)) + os.sep
_SITE = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})
_HERE = os.path.dirname(os.path.realpath(__file__)) + os.sep
_HOST_NAMES = frozenset({"numpy", "tolist"})


_STDLIB_CACHE: dict[str, bool] = {}


def _is_stdlib(filename: str) -> bool:
    known = _STDLIB_CACHE.get(filename)
    if known is None:
        real = os.path.realpath(filename)
        known = filename.startswith("<frozen") or (real.startswith(_STDLIB) and not real.startswith(_SITE)
                                                   and "site-packages" not in real)
        _STDLIB_CACHE[filename] = known
    return known


def candidate_site(candidate_file: str, start: types.FrameType | None = None) -> str:
    """'line N: `code`' of the innermost candidate frame on the stack, or ''."""
    frame = start or _getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == candidate_file:
            return format_site(candidate_file, frame.f_lineno)
        frame = frame.f_back
    return ""


def format_site(filename: str, lineno: int) -> str:
    text = linecache.getline(filename, lineno).strip()
    return f"line {lineno}: `{text[:120]}`" if text else f"line {lineno}"


class Findings:
    """Violations of one execution phase, deduplicated, with a count per distinct finding."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str, str], tuple[Violation, int]] = {}
        self.lock = threading.Lock()

    def add(self, v: Violation) -> None:
        """Record `v`; a repeat keeps the first record (the dispatch gate's, which says which API was
        used, comes before the fence's for the same op) and counts."""
        key = (v.kind, v.what, v.where)
        with self.lock:
            old = self.items.get(key)
            self.items[key] = (old[0] if old else v, (old[1] if old else 0) + 1)

    def drain(self) -> list[dict]:
        with self.lock:
            out = [dict(v.to_json(), count=n) for v, n in self.items.values()]
            self.items.clear()
        return out


# ------------------------------------------------------------------------------ dispatch gate


class _PythonApiTracker(TorchFunctionMode):
    """Remembers which torch Python API call is in progress, to tell Python-level ops from native ones."""

    def __init__(self) -> None:
        super().__init__()
        self.current: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.current.append(_api_name(func))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current.pop()


def _api_name(func) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    if name.startswith("_VariableFunctionsClass.") or (module.startswith("torch._C") and "." not in name):
        return "torch." + name.split(".")[-1]
    if module.startswith("torch._C") or module == "torch._tensor" or name.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name.split(".")[-1]
    return f"{module}.{name}" if module else name


class ForwardGate(TorchDispatchMode):
    """ATen dispatch mode: records every non-plumbing op (and device->host copies on cuda)."""

    def __init__(self, findings: Findings, candidate_file: str, device_type: str) -> None:
        super().__init__()
        self.findings = findings
        self.candidate_file = candidate_file
        self.device_type = device_type
        self.api: _PythonApiTracker | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        namespace = getattr(packet, "_qualified_op_name", "aten::").split("::")[0]
        name = packet.__name__
        if namespace != "aten":
            self._record("custom_op", f"{namespace}::{name}")
        elif name not in PLUMBING_OPS:
            self._record("forbidden_op", f"aten::{name}")
        out = func(*args, **kwargs)
        if name in COPY_OPS:
            if self.device_type != "cpu" and self._leaves_device(args, kwargs, out):
                self._record("host_roundtrip", f"aten::{name} from {self.device_type} to the host")
            elif self.device_type == "cpu" and _foreign_source(name, args):
                self._record("host_roundtrip", f"aten::{name} from memory torch did not allocate (numpy?)")
        return out

    def _leaves_device(self, args, kwargs, out) -> bool:
        sources = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        on_device = any(t.device.type == self.device_type for t in sources)
        if isinstance(out, torch.Tensor):
            return on_device and out.device.type == "cpu"
        return False

    def _record(self, kind: str, what: str) -> None:
        if self.api is None:
            via = ""
        else:
            via = self.api.current[-1] if self.api.current else "native code (a C++/CUDA extension function)"
        self.findings.add(Violation(kind, what, candidate_site(self.candidate_file), via))


def foreign_memory(t: torch.Tensor) -> bool:
    """True for CPU tensors over memory torch did not allocate (torch.from_numpy, frombuffer)."""
    return t.device.type == "cpu" and not _TB.untyped_storage(t).resizable()


def _foreign_source(name: str, args) -> bool:
    sources = args[1:2] if name == "copy_" else args[:1]
    return any(isinstance(a, torch.Tensor) and foreign_memory(a) for a in sources)


class HostRoundTripHook:
    """Profile hook for the forward thread: a tensor handed to numpy or Python lists (`np.asarray(t)`
    goes through Tensor.numpy too), or a tensor built from numpy. Only C calls are inspected, and
    without touching frame attributes, so the hook stays cheap inside timed runs."""

    def __init__(self, findings: Findings, candidate_file: str) -> None:
        self.findings, self.candidate_file = findings, candidate_file

    def __call__(self, frame, event, arg):
        if event != "c_call":
            return
        if arg is _from_numpy or (getattr(arg, "__name__", "") in _HOST_NAMES and isinstance(
                getattr(arg, "__self__", None), _TB)):
            self.findings.add(Violation("host_roundtrip", f"{getattr(arg, '__name__', 'from_numpy')}()",
                                        candidate_site(self.candidate_file, frame), "tensor data left torch"))


class GateSession:
    """Enter around one forward call: the compute fence's window, and in correctness trials the dispatch
    gate, API tracker and host round-trip hook; threads are noted before, for the check after."""

    def __init__(self, findings: Findings, candidate_file: str, device_type: str, *, detailed: bool) -> None:
        self.findings = findings
        self.candidate_file = candidate_file
        self.gate = ForwardGate(findings, candidate_file, device_type)
        # Detailed mode (correctness trials) adds attribution (which line, via which API) and the numpy
        # profile hook, which cost a Python call per op / per C call; timed runs keep the fence only
        # (no cost per plumbing op), so the timer measures the candidate, not the gate.
        self.detailed = detailed
        self.hook = HostRoundTripHook(findings, candidate_file)
        self.window = fence.Window()

    def watch_threads(self) -> "GateSession":
        """Note the threads alive now (call before the timed window, not inside it)."""
        self._py_before = {t.ident for t in _enumerate_threads()}
        self._native_before = set(_listdir("/proc/self/task"))
        return self

    def __enter__(self):
        if self.detailed:
            self.gate.api = _PythonApiTracker()
            self.gate.api.__enter__()
            self.gate.__enter__()
            self._old_profile = sys.getprofile()
            sys.setprofile(self.hook)
        self.window.__enter__()
        return self

    def __exit__(self, *exc):
        self.window.__exit__(*exc)
        if not self.detailed:
            return False
        current_profile = sys.getprofile()
        sys.setprofile(self._old_profile)
        if current_profile is not self.hook:
            self.findings.add(Violation("gate_disabled", "the host round-trip hook was removed", "",
                                        "sys.setprofile"))
        if _get_current_dispatch_mode() is not self.gate:
            self.findings.add(Violation("gate_disabled", "the ATen dispatch gate was popped or replaced", "",
                                        "torch dispatch mode stack"))
            _drop_mode(self.gate)
        else:
            self.gate.__exit__(*exc)
        if self.gate.api is not None:
            self.gate.api.__exit__(*exc)
            self.gate.api = None
        return False

    def new_threads(self, *, native_too: bool) -> list[str]:
        """Threads started during the call that are still alive now."""
        late = [t.name for t in _enumerate_threads() if t.ident not in self._py_before and t.is_alive()]
        if native_too:
            late += [f"native thread {tid}" for tid in set(_listdir("/proc/self/task")) - self._native_before
                     if os.path.exists(f"/proc/self/task/{tid}")]
        return late


def _drop_mode(mode) -> None:
    """Best effort to leave the mode stack consistent after a candidate tampered with it."""
    try:
        mode.__exit__(None, None, None)
    except Exception:
        pass


# ------------------------------------------------------------------------------- audit hooks

_ALWAYS_FLAGGED = {
    "sys._getframe": "introspection", "sys._current_frames": "introspection", "gc.get_objects": "introspection",
    "gc.get_referrers": "introspection", "gc.get_referents": "introspection", "object.__getattr__": "introspection",
    "sys.settrace": "introspection", "sys.setprofile": "introspection", "sys.addaudithook": "introspection",
    "code.__new__": "dynamic_code", "function.__new__": "dynamic_code", "exec": "dynamic_code",
    "subprocess.Popen": "process", "os.system": "process", "os.exec": "process", "os.posix_spawn": "process",
    "os.spawn": "process", "os.fork": "process", "os.forkpty": "process", "os.kill": "process",
    "os.killpg": "process", "socket.connect": "network", "socket.bind": "network", "socket.getaddrinfo": "network",
    "ctypes.dlopen": "native_escape", "ctypes.dlsym": "native_escape", "ctypes.cdata": "native_escape",
    "ctypes.call_function": "native_escape", "ctypes.string_at": "native_escape", "ctypes.addressof": "native_escape",
    "ctypes.PyObj_FromPtr": "native_escape",
}


_KILN_PACKAGES = frozenset({"actors", "protocols", "configs", "launch", "tasks", "tests"})


def _PROCESS_MEMORY(path: str) -> bool:
    """/proc/<pid>/mem, /proc/<pid>/task/<tid>/mem, /dev/mem, /proc/kcore: memory of a process or of the machine."""
    parts = path.split("/")
    return path in ("/dev/mem", "/dev/kmem", "/proc/kcore") or (
        len(parts) >= 4 and parts[1] == "proc" and parts[-1] in ("mem", "map_files", "pagemap"))


class AuditMonitor:
    """Flags sensitive runtime events raised by the candidate's own code while armed."""

    def __init__(self, findings: Findings, candidate_file: str, reference_paths: list[str]) -> None:
        self.findings = findings
        self.candidate_file = candidate_file
        self.scratch = os.path.dirname(os.path.realpath(candidate_file)) + os.sep if candidate_file else ""
        self.reference_paths = tuple(os.path.realpath(p) for p in reference_paths if p)
        self.reference_dirs = tuple({os.path.dirname(p) + os.sep for p in self.reference_paths})
        self.armed = False
        self._busy = threading.local()

    def install(self) -> None:
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if getattr(self._busy, "on", False):
            return
        kind = _ALWAYS_FLAGGED.get(event)
        # Processes and sockets count whenever the candidate's code asks (a destructor or a thread
        # runs outside any armed phase); the rest only while candidate code is running.
        if not self.armed and kind not in ("process", "network"):
            return
        if kind is None and event not in ("open", "import"):
            return
        self._busy.on = True
        try:
            if event in ("open", "import"):
                self._check_reference_access(event, args)
            elif self._caller_is_candidate(2):
                detail = f"{event}{_brief(args)}"
                self.findings.add(Violation(kind, detail, candidate_site(self.candidate_file), "runtime audit"))
        finally:
            self._busy.on = False

    def _check_reference_access(self, event: str, args: tuple) -> None:
        path = args[0] if event == "open" else (args[1] if len(args) > 1 else None)
        if event == "import" and args and isinstance(args[0], str) and args[0].split(".")[0] in _KILN_PACKAGES:
            top = args[0].split(".")[0]
            kind, why = (("reference_access", "importing the task set (the reference)") if top == "tasks"
                         else ("verifier_access", "reaching into the verifier"))
            self.findings.add(Violation(kind, f"import {args[0]}", candidate_site(self.candidate_file), why))
            return
        if not isinstance(path, (str, bytes, os.PathLike)):
            return
        real = os.path.realpath(os.fsdecode(path))
        if event == "open" and _writes(args) and self.scratch and not real.startswith(self.scratch) \
                and not real.startswith("/dev/") and self._caller_is_candidate(3):
            self.findings.add(Violation("fs_escape", f"open {real} for writing", candidate_site(self.candidate_file),
                                        "writing outside the sandbox's scratch directory"))
            return
        if real in self.reference_paths or (real.endswith(".py") and real.startswith(self.reference_dirs)):
            self.findings.add(Violation("reference_access", f"{event} {real}", candidate_site(self.candidate_file),
                                        "reading or importing the reference"))
        elif event == "open" and _PROCESS_MEMORY(real):
            self.findings.add(Violation("memory_access", f"open {real}", candidate_site(self.candidate_file),
                                        "reading or patching process memory"))

    def _caller_is_candidate(self, depth: int) -> bool:
        """Whether the code that raised the event (`depth` frames up from here) is the candidate's,
        looking through standard-library frames (os.fork called via subprocess, say)."""
        frame = _getframe(depth)
        while frame is not None and _is_stdlib(frame.f_code.co_filename):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename == self.candidate_file


def _writes(args: tuple) -> bool:
    """An `open` audit event that asks for writing (builtins.open's mode, or os.open's flags)."""
    mode = args[1] if len(args) > 1 else None
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else (mode if isinstance(mode, int) else 0)
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))


def _brief(args: tuple) -> str:
    text = ", ".join(repr(a)[:60] for a in args[:2] if not isinstance(a, types.FrameType))
    return f"({text})" if text else ""


# -------------------------------------------------------------------------------- integrity

_WATCHED: list[tuple[str, str]] = [
    ("torch", n) for n in ("allclose", "isclose", "equal", "Tensor", "manual_seed", "no_grad", "from_numpy",
                           "empty_like", "zeros_like")
] + [
    ("torch.cuda", n) for n in ("synchronize", "Event", "current_stream", "Stream", "empty_cache", "is_available")
] + [
    ("torch.cuda.Event", n) for n in ("record", "elapsed_time", "synchronize", "query")
] + [
    ("time", n) for n in ("perf_counter", "perf_counter_ns", "time", "monotonic", "monotonic_ns", "sleep")
] + [
    ("torch.Tensor", n) for n in ("__eq__", "__sub__", "cpu", "cuda", "to", "numpy", "clone", "copy_",
                                  "contiguous", "detach", "view", "reshape", "float", "double", "abs", "sub",
                                  "max", "sum", "data_ptr", "untyped_storage", "__torch_function__",
                                  "__torch_dispatch__", "__class__")
] + [
    ("torch.nn.Module", n) for n in ("__call__", "_call_impl", "load_state_dict", "to")
] + [
    ("torch.testing", "assert_close"), ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._python_dispatch", "_get_current_dispatch_mode"), ("torch.overrides", "TorchFunctionMode"),
    ("sys", "exit"), ("sys", "setprofile"), ("sys", "getprofile"), ("os", "_exit"), ("os", "listdir"),
] + [
    ("builtins", n) for n in ("isinstance", "type", "id", "len", "print", "open", "getattr", "setattr",
                              "hasattr", "__import__", "max", "min", "sum", "abs", "range", "iter", "next",
                              "float", "int", "bool", "str", "list", "tuple", "dict", "repr", "sorted", "any", "all")
]
_PROTECTED_MODULES = ("actors.verifier.gate", "actors.verifier.sandbox", "actors.verifier.timing",
                      "actors.verifier.wire", "actors.verifier.legality", "actors.verifier.fence",
                      "actors.verifier.build.prebuilt", "actors.verifier.build.spec")


def _lookup(owner: str, name: str):
    """The object bound to `owner.name`; for classes the raw attribute from the MRO (a classmethod
    would otherwise give a fresh bound method on every access)."""
    obj = builtins if owner == "builtins" else None
    if obj is None:
        parts = owner.split(".")
        obj = sys.modules.get(parts[0])
        for p in parts[1:]:
            obj = getattr(obj, p, None)
    if obj is None:
        return _MISSING
    if isinstance(obj, type):
        for klass in type.__getattribute__(obj, "__mro__"):
            if name in klass.__dict__:
                return klass.__dict__[name]
        return _MISSING
    return getattr(obj, name, _MISSING)


_MISSING = object()


class Integrity:
    """Identity snapshot of what the verifier relies on; `check()` lists what changed since.

    The sandbox's own modules are held here by reference (they leave sys.modules before the candidate
    is imported), and so are the classes they define: a patched method (`Findings.add = ...`) shows up
    as a changed class dict, not only a changed module dict."""

    def __init__(self) -> None:
        self.watched = {(o, n): _lookup(o, n) for o, n in _WATCHED}
        self.modules = {m: sys.modules[m] for m in _PROTECTED_MODULES if m in sys.modules}
        self.module_dicts = {m: dict(vars(mod)) for m, mod in self.modules.items()}
        self.classes = {f"{m}.{k}": (v, dict(vars(v))) for m, mod in self.modules.items()
                        for k, v in vars(mod).items() if isinstance(v, type) and v.__module__ == m}

    def check(self) -> list[Violation]:
        out = []
        for (owner, name), obj in self.watched.items():
            if _lookup(owner, name) is not obj:
                out.append(Violation("patched", f"{owner}.{name}", "", "monkey-patching"))
        for mod, snapshot in self.module_dicts.items():
            out += _changed(mod, snapshot, vars(self.modules[mod]))
        for name, (klass, snapshot) in self.classes.items():
            out += _changed(name, snapshot, type.__getattribute__(klass, "__dict__"))
        return out


def _changed(name: str, snapshot: dict, live) -> list[Violation]:
    changed = [k for k, v in snapshot.items() if live.get(k, _MISSING) is not v]
    added = set(live) - set(snapshot)
    if not changed and not added:
        return []
    names = ", ".join(sorted(set(changed) | added)[:5])
    return [Violation("patched", f"{name} ({names})", "", "tampering with the verifier")]
