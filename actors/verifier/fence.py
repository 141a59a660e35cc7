"""The seal: what a process does before the first byte of candidate code runs in it, and never undoes.

Once a process has loaded candidate code, everything in it is the candidate's to use, so the
guarantees below hold from the moment of sealing until the process exits, in every thread, for
every caller (there is no window, no switch and no attribution to a "trusted" frame):

1. ATen computes nothing. The compute fence (kiln_fence, installed here in the zygote before any
   fork) puts a kernel in front of every operator outside tensor plumbing and random initialisation (`legality.ALLOWED_OPS`)
   at every backend key (CPU, CUDA, sparse, quantized, mkldnn, nested); once the process is armed
   that kernel refuses and records the op. A disabled mode stack, an excluded dispatch key,
   `OpOverload.redispatch`, another thread or a sparse tensor all end at it.
2. Python gets no tensor data and no raw memory. torch's routes from tensor memory to Python objects
   (`Tensor.tolist/numpy/apply_/map_`, DLPack, storage indexing, `torch.save`'s writer), from Python
   buffers or files to tensor memory (`frombuffer`, `asarray`, `from_file`, shared storages), from
   integers to tensors or allocations (`_construct_storage_from_data_pointer`, raw allocators) are
   replaced by refusers (`install_refusers`); ctypes, numpy and cffi are not in the interpreter at
   all (native/shim.py) and their import is refused.
3. Nothing computes around the dispatcher: TorchScript cannot be compiled or loaded (its fusers run
   kernels of their own), tensor expressions (`torch._C._te`) are gone, operators cannot be
   registered (`torch.library` would put Python kernels under the sandbox's own copies). CUDA graphs
   are allowed: what a replay runs is on the device's record of the call (provenance.py).
4. None of the sandbox's own state: its frames are not on the candidate's stack (`f_back` ends where
   the sandbox's code begins, `sys._getframe` refuses to go past it), its functions' globals,
   closures and code and its tracebacks' frames refuse; gc's object walks, tracing and profiling
   hooks, eval-frame hooks (refused here) and code-object construction (marshal included) refuse
   for everyone; and so do processes, signals, sockets and shared mappings.
5. Data does not leave the device: a copy from a CUDA tensor to host memory made by candidate code
   refuses (the sandbox's own reads of the outputs are its own copies).
6. Native code loads only from the candidate's own build: a native extension whose file is neither
   in the process's artifact table nor a standard extension module refuses (`_imp.create_dynamic`,
   and so importlib's ExtensionFileLoader, `imp` and any hand-made spec: kiln_native's audit hook
   judges the load itself, whoever asked for it), and so does `sys.setdlopenflags` (global symbols
   would let one library's symbols stand in for another's).
7. The kernel refuses, from the seal on, signal handlers, timers, new processes and memfd (a seccomp
   filter stacked on the jail's: `seccomp.armed_seccomp_program`).
Every refusal is numbered into kiln_native's log, which every signed reply carries, and written at
once to the evidence pipe (for a process that dies before replying); a refusal that the candidate
catches and hides is still on record, and so is a closed or replaced pipe.

What this cannot stop: native code of the candidate's own extension can do anything in its process
(call a kernel through an address it computed, rewrite memory). docs/verifier.md states that
residual and what bounds it (the symbol check of every built library, the verifier's own clock and
output comparison, the plausibility bound).
"""

from __future__ import annotations

import gc
import sys

import torch

from actors.verifier import native
from actors.verifier.legality import ALLOWED_OPS

BACKEND_KEYS = (
    "CPU",
    "SparseCPU",
    "SparseCsrCPU",
    "MkldnnCPU",
    "QuantizedCPU",
    "NestedTensorCPU",
    "CUDA",
    "SparseCUDA",
    "SparseCsrCUDA",
    "QuantizedCUDA",
    "NestedTensorCUDA",
)

# Copies between the host and these devices made by candidate code refuse once armed (a host round-trip).
DEVICE_KEYS = ("CUDA",)
COPY_OPS = ("copy_", "_copy_from", "_copy_from_and_resize")
_fenced = 0  # operator kernels fenced in this process (0: the fence library is missing)


def install(library: str | None) -> int:
    """In the zygote, before any fork: register the compute fence (every child inherits it, disarmed
    until it seals). None leaves ATen unfenced; the sandbox then reports the layer missing."""
    global _fenced
    if not library or _fenced:
        return _fenced
    module = native.load(native.FENCE, library)
    ops = [
        full[len("aten::") :]
        for full in torch._C._dispatch_get_all_op_names()
        if full.startswith("aten::") and full[len("aten::") :].split(".")[0] not in ALLOWED_OPS
    ]
    keys = [k for k in BACKEND_KEYS if k in torch._C.DispatchKey.__members__]
    _fenced = int(module.install(ops, keys))
    module.guard_copies(list(COPY_OPS), [k for k in DEVICE_KEYS if k in torch._C.DispatchKey.__members__])
    return _fenced


def active() -> bool:
    """True when the operator kernels are fenced here."""
    return _fenced > 0


def data_movement():
    """The fence module's plumbing for the sandbox's own code (kiln_fence.copy, empty, bytes_view,
    meta, plain), or None without the fence library."""
    return sys.modules.get(native.FENCE)


# ------------------------------------------------------------------------------------- refusers

# TensorBase methods that hand tensor data to Python.
TENSOR_DATA = ("tolist", "numpy", "apply_", "map_", "map2_")
# torch.Tensor's Python-level ones.
TENSOR_PY_DATA = ("__dlpack__", "__array__", "__array_wrap__", "__array_priority__")
# What a candidate may still do with a storage (sizes, pointers as integers, plumbing copies).
STORAGE_KEPT = frozenset(
    {
        "data_ptr",
        "nbytes",
        "size",
        "element_size",
        "device",
        "is_cuda",
        "is_hpu",
        "is_sparse",
        "is_sparse_csr",
        "is_pinned",
        "is_shared",
        "resizable",
        "resize_",
        "copy_",
        "fill_",
        "new",
        "type",
        "_cdata",
        "dtype",
        "untyped",
        "_untyped_storage",
        "__len__",
        "__sizeof__",
    }
)
# torch functions over memory Python can read (a buffer, a file) or given by an integer.
TORCH_ALIASES = ("frombuffer", "from_file", "asarray", "from_numpy", "from_dlpack")
# torch._C functions: data to Python, memory by address, allocators, operator registration,
# TorchScript compilation and loading, eval-frame hooks.
TORCH_C_REFUSED = (
    "_to_dlpack",
    "_to_dlpack_versioned",
    "_from_dlpack",
    "_dlpack_exchange_api",
    "_construct_storage_from_data_pointer",
    "_unsafe_reset_storage",
    "_dispatch_library",
    "_cuda_cudaCachingAllocator_raw_alloc",
    "_cuda_cudaCachingAllocator_raw_delete",
    "_cuda_cudaHostAllocator",
    "_cuda_customAllocator",
    "_cuda_changeCurrentAllocator",
    "CompilationUnit",
    "import_ir_module",
    "import_ir_module_from_buffer",
    "_load_for_lite_interpreter",
    "_load_for_lite_interpreter_from_buffer",
    "_load_jit_module_from_file",
    "_load_jit_module_from_bytes",
    "_load_mobile_module_from_file",
    "_load_mobile_module_from_bytes",
)
TORCH_C_REFUSED_PATTERNS = ("script_compile", "from_trace", "_jit_set_", "_jit_override_")
# Signal handlers, timers and signals to threads.
SIGNAL_FUNCTIONS = (
    "signal",
    "setitimer",
    "alarm",
    "set_wakeup_fd",
    "siginterrupt",
    "pthread_kill",
    "pidfd_send_signal",
)


def install_refusers(kn) -> list[str]:
    """Replace torch's data paths with kiln_native refusers (C functions that hold no Python state:
    nothing of the sandbox's is reachable through them). In the process about to load candidate
    code, before it arms; returns what was replaced."""
    r = _Refusers(kn)
    storages = _refuse_tensor_data(r)
    functions = _refuse_torch_internals(r)
    writer = _refuse_writers(r)
    _refuse_signals_and_hooks(r)
    _refuse_loader_flags(r)
    _replace_aliases(r.aliases)
    for tp in {torch._C.TensorBase, torch.Tensor, functions, *storages, writer} - {None}:
        if _is_static(tp):
            kn.type_modified(tp)
    return r.done


class _Refusers:
    """What install_refusers replaced so far (`done`), the module-level objects it replaced (each
    alias of them is replaced too, in one pass at the end), and how one more is replaced."""

    def __init__(self, kn) -> None:
        self.kn = kn
        self.done: list[str] = []
        self.aliases: dict[int, tuple[object, object]] = {}  # id(original) -> (original, refuser)

    def refuser(self, what: str, kind: str = "python_compute", why: str = "tensor data handed to Python"):
        return self.kn.refuser(what, kind, why)

    def in_type(self, tp: type, name: str, what: str, kind: str, why: str) -> None:
        table = tp.__dict__
        if name not in table:
            return
        replacement = self.refuser(what, kind, why)
        if _is_static(tp):
            _type_dict(tp)[name] = replacement
        else:
            setattr(tp, name, replacement)
        self.done.append(what)

    def in_module(self, module, name: str, what: str, kind: str, why: str) -> None:
        _replace_module_attribute(module, name, self.refuser(what, kind, why), self.done, self.aliases)


def _refuse_tensor_data(r: _Refusers) -> list[type]:
    """Tensor and storage methods that hand data or memory to Python; returns the storage types."""
    tb = torch._C.TensorBase
    for name in TENSOR_DATA:
        r.in_type(tb, name, f"Tensor.{name}", "python_compute", "tensor data handed to Python")
    for name in TENSOR_PY_DATA:
        r.in_type(torch.Tensor, name, f"Tensor.{name}", "python_compute", "tensor data handed to Python")
    storages = [torch._C.StorageBase, torch.storage._StorageBase, torch.UntypedStorage, torch.TypedStorage]
    for tp in storages:
        for name in list(tp.__dict__):
            if name in STORAGE_KEPT or (
                name.startswith("__")
                and name not in ("__getitem__", "__iter__", "__reduce__", "__reduce_ex__", "__array__")
            ):
                continue
            if callable(tp.__dict__[name]) or isinstance(tp.__dict__[name], (classmethod, staticmethod)):
                r.in_type(
                    tp, name, f"{tp.__name__}.{name}", "python_compute", "storage data or memory handed to Python"
                )
    r.kn.refuse_subscript(torch._C.StorageBase, "UntypedStorage[i]")
    return storages


def _refuse_torch_internals(r: _Refusers) -> type:
    """torch's alias constructors, torch._C's memory, allocator, registration and TorchScript entry
    points, tensor expressions; returns the type of torch's function table."""
    functions = type(torch._C._VariableFunctions)
    for name in TORCH_ALIASES:
        what = f"torch.{name}"
        why = "a tensor over memory Python can read, or memory given by address"
        r.in_type(functions, name, what, "python_compute", why)
        r.in_module(torch, name, what, "python_compute", why)
    refused_c = set(TORCH_C_REFUSED) | {n for n in dir(torch._C) if any(p in n for p in TORCH_C_REFUSED_PATTERNS)}
    for name in sorted(refused_c):
        if hasattr(torch._C, name):
            r.in_module(
                torch._C,
                name,
                f"torch._C.{name}",
                "torch_internals",
                "memory by address, allocators, operator registration or TorchScript",
            )
    for name in ("_te",):  # tensor expressions compute with kernels of their own
        if hasattr(torch._C, name):
            delattr(torch._C, name)
            sys.modules.pop(f"torch._C.{name}", None)
            r.done.append(f"torch._C.{name}")
    return functions


def _refuse_writers(r: _Refusers) -> type | None:
    """torch.save's record writer; returns its type (or None). CUDA graphs are not refused: a graph
    of the candidate's own kernels is its own work, and what any graph replays is on the device's
    record of the call (provenance.py), whoever captured it and whenever."""
    writer = getattr(torch._C, "PyTorchFileWriter", None)
    if writer is not None:
        r.in_type(
            writer, "write_record", "PyTorchFileWriter.write_record", "python_compute", "tensor data handed to Python"
        )
    return writer


def _refuse_signals_and_hooks(r: _Refusers) -> None:
    """Signal handlers and timers, the ctypes stand-in, and eval-frame hooks."""
    import _signal
    import signal

    for name in SIGNAL_FUNCTIONS:  # the kernel refuses them anyway once armed; this puts the attempt on record
        for module in (signal, _signal):
            if name in vars(module):
                r.in_module(
                    module,
                    name,
                    f"signal.{name}",
                    "signals",
                    "a handler or a timer would run work after forward returned",
                )
    for name in [n for n in sys.modules if n == "ctypes" or n.startswith("ctypes.")]:
        sys.modules.pop(name)  # the stand-in (native/shim.py): `import ctypes` is an import again, and refused
        r.done.append(f"sys.modules[{name!r}]")
    frames = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "set_eval_frame", None)
    if frames is not None:
        r.in_module(
            torch._C._dynamo.eval_frame,
            "set_eval_frame",
            "set_eval_frame",
            "introspection",
            "an eval-frame hook sees every frame",
        )


def _refuse_loader_flags(r: _Refusers) -> None:
    """How the loader binds libraries' symbols is the sandbox's, not the candidate's: RTLD_GLOBAL would
    let a library's exports interpose on the next one's. (Which files load at all is the audit hook's
    rule: kiln_native's check_extension.)"""
    r.in_module(sys, "setdlopenflags", "sys.setdlopenflags", "foreign_library", "changing how native code is loaded")


def _is_static(tp: type) -> bool:
    return not (tp.__flags__ & (1 << 9))  # Py_TPFLAGS_HEAPTYPE


def _type_dict(tp: type) -> dict:
    """The dict behind a static (C-defined, immutable) type's mappingproxy."""
    return gc.get_referents(tp.__dict__)[0]


def _replace_module_attribute(module, name: str, replacement, done: list[str], aliases: dict) -> None:
    """Replace `module.name`; every module-level alias of the same object goes in `_replace_aliases`."""
    original = getattr(module, name, None)
    if original is None:
        return
    aliases[id(original)] = (original, replacement)
    setattr(module, name, replacement)
    done.append(f"{module.__name__}.{name}")


def _replace_aliases(aliases: dict) -> None:
    """One pass over every loaded module's namespace: each alias of a replaced object is replaced too
    (`from torch import frombuffer` made before sealing, `signal.signal` as `_signal.signal`)."""
    for loaded in list(sys.modules.values()):
        space = getattr(loaded, "__dict__", None)
        if not isinstance(space, dict):
            continue
        for key, value in list(space.items()):
            hit = aliases.get(id(value))
            if hit is not None and hit[0] is value:
                space[key] = hit[1]
