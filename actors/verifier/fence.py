"""The compute fence: inside the window around forward, PyTorch computes nothing.

The dispatch-mode gate (gate.py) watches from the Python dispatch key, and Python code can step
around it (`_disable_current_modes()`, excluding the key, `OpOverload.redispatch`, another thread).
The fence sits where every dispatched op ends: the backend kernels themselves. At zygote start-up,
before any candidate exists, every ATen operator outside tensor plumbing (`legality.PLUMBING_OPS`)
gets a kernel at every backend key (CPU, CUDA, sparse, quantized, mkldnn, nested) that, while the
window is open, records the op and raises instead of computing; outside the window it calls the
kernel it replaced. Those kernels are C++ (build/fence_lib.py, built once per toolchain), so a call
outside the window reaches the original kernel with its arguments untouched. The same holds for the paths that hand tensor data to Python without any op
(`Tensor.apply_/map_/map2_/tolist/numpy`, DLPack, storage reads, `torch.save`'s writer) and for CUDA
graph replay. So a disabled mode stack, a redispatch below Python, a thread, or a Python loop
over elements gets no result at all, and the attempt is on record twice: in the reply's findings
and on the evidence pipe, written by this process the moment it happens and read by the verifier
(a pipe's contents cannot be taken back).

The window is process-wide (threads included) and open only around forward; module import,
`__init__` and the verifier's own checks run outside it. What the fence cannot stop: native code
that calls a kernel function through a pointer it found without importing a symbol (the built
library's imports are checked by `build/symbols.py`) or that rewrites this process's memory.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import warnings

import torch

from actors.verifier.legality import PLUMBING_OPS, Violation

BACKEND_KEYS = ("CPU", "SparseCPU", "SparseCsrCPU", "MkldnnCPU", "QuantizedCPU", "NestedTensorCPU",
                "CUDA", "SparseCUDA", "SparseCsrCUDA", "QuantizedCUDA", "NestedTensorCUDA")
# Methods that hand a tensor's (or storage's) data to Python without dispatching an op.
DATA_METHODS = {
    torch._C.TensorBase: ("apply_", "map_", "map2_", "tolist", "numpy"),
    torch._C.StorageBase: ("__getitem__", "_write_file"),
}
DATA_ATTRIBUTES = (("torch.Tensor", "__dlpack__"), ("torch.Tensor", "__array__"),
                   ("torch.storage._StorageBase", "tolist"), ("torch.storage._StorageBase", "__getitem__"),
                   ("torch.storage._StorageBase", "__iter__"), ("torch.UntypedStorage", "__getitem__"),
                   ("torch._C", "_to_dlpack"), ("torch.PyTorchFileWriter", "write_record"),
                   ("torch._C._CUDAGraph", "replay"), ("torch._C._CUDAGraph", "capture_begin"))
# Constructors of tensors over memory that Python code can read without torch (a bytearray, an mmap,
# a memoryview). Refused whenever a candidate is armed, not only inside forward: a buffer aliased in
# `__init__` would carry the inputs' bytes to Python in forward through plumbing copies alone.
# (`asarray` only when handed a buffer; file-backed shared tensors, `torch.from_file` and storages
# moved to shared memory, are caught by the sandbox's shared-mapping check, whatever route made them.)
ALIAS_CONSTRUCTORS = ("frombuffer", "asarray")
ALIAS_STORAGE_METHODS = ("from_buffer",)


class _State:
    def __init__(self) -> None:
        self.open = False
        self.candidate_file = ""
        self.findings = None  # gate.Findings of the current child
        self.site = None  # gate.candidate_site: (candidate file, frame) -> "line N: `code`"
        self.evidence_fd = -1  # write end of the evidence pipe (the verifier holds the read end)
        self.ops = 0  # operator kernels fenced (0: the native half is missing)
        self.installed = False


_STATE = _State()
_LIBRARY = None  # the native half (ctypes handle), held only here


def install(library: str | None) -> int:
    """Register the fence (once, in the zygote, before any candidate exists). `library` is the native
    half (build/fence_lib.py), built by the service for this toolchain; None leaves the operator
    kernels unfenced (the sandbox then reports the layer missing). Returns how many kernels it fenced."""
    global _LIBRARY
    if _STATE.installed:
        return _STATE.ops
    _STATE.installed = True
    _fence_data_paths()
    _fence_aliasing()
    if not library:
        return 0
    lib = ctypes.CDLL(library)
    lib.kiln_fence_install.restype = ctypes.c_int
    lib.kiln_fence_install.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
    lib.kiln_fence_window.argtypes = [ctypes.c_int]
    lib.kiln_fence_evidence.argtypes = [ctypes.c_int]
    lib.kiln_fence_take.argtypes = [ctypes.c_char_p, ctypes.c_int]
    ops = [full[len("aten::"):].encode() for full in torch._C._dispatch_get_all_op_names()
           if full.startswith("aten::") and full[len("aten::"):].split(".")[0] not in PLUMBING_OPS]
    keys = [k.encode() for k in BACKEND_KEYS if k in torch._C.DispatchKey.__members__]
    op_arr = (ctypes.c_char_p * len(ops))(*ops)
    key_arr = (ctypes.c_char_p * len(keys))(*keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _STATE.ops = int(lib.kiln_fence_install(op_arr, len(ops), key_arr, len(keys)))
    _LIBRARY = lib
    return _STATE.ops


def _refuse(kind: str, what: str, why: str, message: str = ""):
    site = _STATE.site(_STATE.candidate_file, sys._getframe(2)) if _STATE.site else ""
    if _STATE.findings is not None:
        _STATE.findings.add(Violation(kind, what, site, why))
    if _STATE.evidence_fd >= 0:
        try:
            os.write(_STATE.evidence_fd, f"{kind}\t{what}\t{site[:200]}\n".encode("utf-8", "replace"))
        except OSError:
            pass
    raise RuntimeError(message or f"{what} is not allowed inside forward: only tensor plumbing "
                       f"(empty/view/reshape/contiguous/copy_) may run in PyTorch; compute in your own kernel")


def _fence_aliasing() -> None:
    functions = type(torch._C._VariableFunctions)
    table = _type_dict(functions)
    for name in ALIAS_CONSTRUCTORS:
        if name in table:
            table[name] = _alias_guard(f"torch.{name}", table[name], buffers_only=name == "asarray")
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(functions))
    for name in ALIAS_CONSTRUCTORS:
        original = torch.__dict__.get(name)
        if original is not None:
            wrapped = _alias_guard(f"torch.{name}", original, buffers_only=name == "asarray")
            setattr(torch, name, wrapped)
            _replace_references(original, wrapped)
    for tp in (torch._C.StorageBase, torch.UntypedStorage, torch.TypedStorage):
        for name in ALIAS_STORAGE_METHODS:
            original = tp.__dict__.get(name)
            if original is None:
                continue
            raw = original.__func__ if isinstance(original, classmethod) else original
            guard = _alias_guard(f"{tp.__name__}.{name}", raw, buffers_only=False)
            wrapped = classmethod(guard) if isinstance(original, classmethod) else guard
            if isinstance(tp.__dict__, dict) or tp.__module__ != "torch._C":
                setattr(tp, name, wrapped)
            else:
                _type_dict(tp)[name] = wrapped
                ctypes.pythonapi.PyType_Modified(ctypes.py_object(tp))


def _is_buffer(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return False
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def _alias_guard(what: str, original, *, buffers_only: bool):
    def guarded(*args, **kwargs):
        if _STATE.candidate_file and (not buffers_only or _is_buffer(args[0] if args else kwargs.get("obj"))):
            _refuse("python_compute", what, "a tensor over memory Python can read (the call refused)",
                    message=f"{what} over a Python buffer is not allowed: tensor memory must be torch's own")
        return original(*args, **kwargs)

    guarded.__name__ = getattr(original, "__name__", what)
    return guarded


def _fence_data_paths() -> None:
    for tp, names in DATA_METHODS.items():
        table = _type_dict(tp)
        for name in names:
            original = table.get(name)
            if original is not None:
                table[name] = _method(tp.__name__, name, original)
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(tp))
    for owner_path, name in DATA_ATTRIBUTES:
        owner = _resolve(owner_path)
        if owner is None or name not in getattr(owner, "__dict__", {}):
            continue
        original = owner.__dict__[name]
        if isinstance(original, property):
            continue
        wrapped = _method(owner_path, name, original) if isinstance(owner, type) else _function(owner_path, name,
                                                                                                 original)
        setattr(owner, name, wrapped)
        _replace_references(original, wrapped)


def _method(owner: str, name: str, original):
    what = f"{owner.rsplit('.', 1)[-1]}.{name}"

    def fenced(self, *args, **kwargs):
        if _STATE.open:
            _refuse("python_compute", what, "tensor data handed to Python inside forward (the call refused)")
        return original(self, *args, **kwargs)

    fenced.__name__ = name
    return fenced


def _function(owner: str, name: str, original):
    what = f"{owner}.{name}"

    def fenced(*args, **kwargs):
        if _STATE.open:
            _refuse("python_compute", what, "tensor data handed to Python inside forward (the call refused)")
        return original(*args, **kwargs)

    fenced.__name__ = name
    return fenced


def _type_dict(tp: type) -> dict:
    """The dict behind a (possibly immutable, C-defined) type's mappingproxy."""
    return gc.get_referents(tp.__dict__)[0]


def _resolve(path: str):
    parts = path.split(".")
    obj = sys.modules.get(parts[0])
    for p in parts[1:]:
        obj = getattr(obj, p, None)
    return obj


def _replace_references(original, wrapped) -> None:
    """Module-level aliases of a fenced function (torch.utils.dlpack.to_dlpack = torch._C._to_dlpack)."""
    for module in list(sys.modules.values()):
        space = getattr(module, "__dict__", None)
        if not isinstance(space, dict):
            continue
        for key, value in list(space.items()):
            if value is original:
                space[key] = wrapped


# --------------------------------------------------------------------------- the sandbox's side


def arm(candidate_file: str, findings, evidence_fd: int, site) -> None:
    """Point the fence at this child's candidate (called once, before the candidate is imported)."""
    _STATE.candidate_file = candidate_file
    _STATE.findings = findings
    _STATE.evidence_fd = evidence_fd
    _STATE.site = site
    if _LIBRARY is not None:
        _LIBRARY.kiln_fence_evidence(evidence_fd)


def active() -> bool:
    """True when the operator kernels are fenced (the native half was loaded)."""
    return _STATE.ops > 0


def take_refused() -> list[str]:
    """Ops the native half refused since the last call (for the reply's findings)."""
    if _LIBRARY is None:
        return []
    buf = ctypes.create_string_buffer(65536)
    n = _LIBRARY.kiln_fence_take(buf, len(buf))
    return [line for line in buf.raw[:n].decode("utf-8", "replace").splitlines() if line]


class Window:
    """`with Window():` around a forward call: PyTorch computes nothing inside."""

    __slots__ = ()

    def __enter__(self):
        _STATE.open = True
        if _LIBRARY is not None:
            _LIBRARY.kiln_fence_window(1)
        return self

    def __exit__(self, *exc):
        if _LIBRARY is not None:
            _LIBRARY.kiln_fence_window(0)
        _STATE.open = False
        return False


def is_open() -> bool:
    return _STATE.open
