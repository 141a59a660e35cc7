"""What a built extension imports, read from the ELF file itself, checked against an allowlist.

However the candidate's source spells it (a namespace alias, token pasting, a macro, an `at::cpu::`
kernel that never reaches the dispatcher), a call into PyTorch's compute is an undefined dynamic
symbol of the built library: `at::_ops::relu::call`, `at::cpu::clamp_min`, `at::native::...`. The
trusted build service reads every built library's dynamic symbols and libraries here, before
anything imports it, and classifies them:

* allowed: tensor plumbing (allocation, shape, strides, data pointers, streams: the ATen ops in
  `legality.ALLOWED_OPS` and non-op helpers), the C/C++ runtime, OpenMP, pybind11 / the Python C
  API, the CUDA runtime and driver;
* vendor: cuBLAS, cuDNN, cuFFT, cuRAND, cuSPARSE, cuSOLVER, CPU BLAS, MKL, oneDNN (allowed when
  `verifier.legality.allow_vendor_libs` is on, and reported);
* forbidden (a finding, so the verdict is cheating): any ATen op outside plumbing, by any route
  (`at::_ops`, `at::<backend>::`, `at::native::`, `at::redispatch::`, out-of-line Tensor methods);
  driving the dispatcher; operator registration; TorchScript and the C++ module frontend; the
  loader's internals and the CUDA profiling interface (CUPTI); raw
  `syscall`, memory protection changes, processes, signals handlers, files and sockets;
* libraries (DT_NEEDED) outside torch, the C/C++ runtime, CUDA and the vendor libraries, search
  paths (RPATH/RUNPATH) outside torch's and CUDA's, and rtld audit/filter entries.
Names are read from the mangled symbol (Itanium C++ ABI), not from a demangler's text. The ELF file
itself is read by elf.py, within bounds for a candidate's library.

A symbol is judged by the library that defines it, not by how it is spelled. torch's own libraries
bundle other libraries (MKL's BLAS and LAPACK under every spelling: `sgemm_`, `SGEMM`, `cblas_sgemm`;
NNPACK, FBGEMM, oneDNN, the AOTI C shim over ATen ops), so an import that torch's libraries define is
allowed only when it is torch's plumbing: C-named symbols there are the vectorised math library
(Sleef, as libm is allowed) or else a bundled vendor library (reported, and refused when vendor
libraries are off) or, for the AOTI shim and anything unknown, refused; C++ names outside at::, c10::
and torch:: there are a bundled vendor library.
"""

from __future__ import annotations

import os
import re
import struct
import threading
from dataclasses import dataclass, field

from actors.verifier.build.elf import ElfError, read_imports
from actors.verifier.legality import ALLOWED_OPS, Violation

# Part of every build's cache key: a change to the rules below re-checks what was built before.
RULES_VERSION = "kiln-symbols-3"

# One family a line, so a change reads as a diff of names: the loader's internals; raw syscalls and memory
# maps; processes; signals; limits, namespaces and mounts; opening files; sockets; links and renames.
_DENY_C_NAMES = """
__libc_dlopen_mode __libc_dlsym _dl_sym
syscall ptrace process_vm_readv process_vm_writev mprotect pkey_mprotect mmap mmap64 mremap remap_file_pages
fork vfork clone clone3 __clone execve execv execvp execvpe execl execlp execle fexecve posix_spawn posix_spawnp
system popen kill tgkill tkill killpg sigaction __sigaction signal sigset bsd_signal sysv_signal sigaltstack
prctl setrlimit setrlimit64 prlimit prlimit64 unshare setns chroot mount umount umount2
open open64 openat openat64 __open_2 __open64_2 __openat_2 __openat64_2 fopen fopen64 freopen freopen64
creat creat64 fdopen socket socketpair connect bind listen accept accept4 memfd_create shm_open
link linkat symlink symlinkat unlink unlinkat rename renameat renameat2 truncate truncate64
"""
_DENY_C = frozenset(_DENY_C_NAMES.split())
_VENDOR_C = (
    ("cublas", "cublas"),
    ("cudnn", "cudnn"),
    ("cufft", "cufft"),
    ("curand", "curand"),
    ("cusparse", "cusparse"),
    ("cusolver", "cusolver"),
    ("cblas_", "openblas"),
    ("sgemm_", "openblas"),
    ("dgemm_", "openblas"),
    ("dnnl_", "onednn"),
    ("mkl_", "mkl"),
)
# The CUDA profiling interface: the device's record of a call is the verifier's evidence (provenance.py).
_CUPTI = re.compile(r"^cupti")
_STD_DENIED = frozenset(
    {"basic_filebuf", "basic_ifstream", "basic_ofstream", "basic_fstream", "__basic_file", "filesystem"}
)
# Driving the dispatcher from native code (calling or registering an operator by handle). Dispatch-key
# guards are not here: torch's own headers instantiate them in honest extensions (a hand-written
# PYBIND11_MODULE), and no guard reaches below the compute fence, which sits at the backend keys.
_DISPATCH_WORDS = (
    "Dispatcher",
    "OperatorHandle",
    "OperatorEntry",
    "KernelFunction",
    "BoxedKernel",
    "RegisterOperators",
)
_TORCH_DENIED_NS = frozenset(
    {"jit", "Library", "CppFunction", "detail", "nn", "optim", "data", "serialize", "autograd_function"}
)
_AT_BACKENDS = frozenset(
    {
        "cpu",
        "cuda",
        "meta",
        "mps",
        "redispatch",
        "compositeexplicitautograd",
        "compositeexplicitautogradnonfunctional",
        "compositeimplicitautograd",
        "compositeimplicitautogradnestedtensor",
        "sparsecpu",
        "sparsecuda",
        "sparsecsrcpu",
        "sparsecsrcuda",
        "mkldnncpu",
        "quantizedcpu",
        "quantizedcuda",
        "nestedtensorcpu",
        "nestedtensorcuda",
        "zerotensor",
        "conjugate",
        "negative",
    }
)
_OP_SUFFIXES = ("_outf", "_out", "_symint")
_LIB_ALLOWED = re.compile(
    r"^(libtorch\w*|libc10\w*|libshm|libc|libm|libstdc\+\+|libgcc_s|libgomp[\w-]*|libpthread|"
    r"libdl|librt|ld-linux[\w-]*|libpython3[\w.]*|libcudart|libcuda|libnvrtc[\w-]*|"
    r"libnvToolsExt|libnvtx3interop)\.so(\.[\w.]+)?$"
)
_LIB_VENDOR = re.compile(
    r"^(libcublas|libcublasLt|libcudnn\w*|libcufft\w*|libcurand|libcusparse\w*|libcusolver\w*|"
    r"libopenblas\w*|libblas|libcblas|libmkl\w*|libdnnl|libmkldnn)\.so(\.[\w.]+)?$"
)


@dataclass
class SymbolCheck:
    violations: list[Violation] = field(default_factory=list)
    vendors: set[str] = field(default_factory=set)
    imports: int = 0

    def to_json(self) -> dict:
        return {
            "violations": [v.to_json() for v in self.violations],
            "vendors": sorted(self.vendors),
            "imports": self.imports,
        }


# ------------------------------------------------------------------------------ mangled names


def qualified_name(sym: str) -> list[str] | None:
    """The components of a mangled C++ function or variable name (`_ZN2at4_ops4relu4callE...` ->
    ['at', '_ops', 'relu', 'call']); special names (vtables, typeinfo) give their class. None when the
    name is not mangled or cannot be read."""
    if not sym.startswith("_Z"):
        return None
    i = 2
    if sym.startswith(("_ZTV", "_ZTI", "_ZTS", "_ZTT"), 0):
        i = 4
    elif sym.startswith(("_ZTh", "_ZTv", "_ZTc")):
        return None
    try:
        comps, _ = _name(sym, i)
    except (IndexError, ValueError):
        return None
    return comps or None


def _name(s: str, i: int) -> tuple[list[str], int]:
    if s[i] == "N":
        i += 1
        while s[i] in "rVKRO":
            i += 1
        comps: list[str] = []
        while s[i] != "E":
            i = _component(s, i, comps)
        return comps, i + 1
    if s.startswith("St", i):
        comps = ["std"]
        i = _component(s, i + 2, comps)
        return comps, i
    comps = []
    i = _component(s, i, comps)
    return comps, i


def _component(s: str, i: int, comps: list[str]) -> int:
    c = s[i]
    if c.isdigit():
        j = i
        while s[j].isdigit():
            j += 1
        n = int(s[i:j])
        comps.append(s[j : j + n])
        return j + n
    if c == "I":  # template arguments: skip, balanced
        return _skip_until_e(s, i + 1)
    if c == "S":  # a substitution: St (std), Sa, Sb, Ss, Si, So, Sd, S_, S<seq-id>_
        if s[i + 1] == "t":
            comps.append("std")
            return i + 2
        if s[i + 1] in "absiod":
            comps.append("std")
            return i + 2
        j = s.index("_", i + 1)
        return j + 1
    if c in "CD" and i + 1 < len(s) and s[i + 1] in "0123456I":  # constructor / destructor
        return i + 2
    if c == "B":  # ABI tag: B<source-name>
        j = i + 1
        while s[j].isdigit():
            j += 1
        return j + int(s[i + 1 : j])
    if c == "L":  # a local entity: give up on precision
        raise ValueError("local name")
    if c.islower() and i + 1 < len(s) and s[i + 1].islower():  # an operator name ("nw", "dl", "cv" ...)
        comps.append("operator")
        return i + 2
    raise ValueError(f"unexpected {c!r}")


def _skip_until_e(s: str, i: int) -> int:
    depth = 1
    while depth:
        c = s[i]
        if c.isdigit():
            j = i
            while s[j].isdigit():
                j += 1
            i = j + int(s[i:j])
            continue
        if c in "INLXJ":
            depth += 1
        elif c == "E":
            depth -= 1
        elif c == "S":  # substitution inside template args
            if s[i + 1] in "tabsiod":
                i += 2
                continue
            i = s.index("_", i + 1) + 1
            continue
        elif c == "T" and s[i + 1] in "_0123456789":
            i = s.index("_", i + 1) + 1
            continue
        i += 1
    return i


# ------------------------------------------------------------------------------ classification


# C-named exports of torch's libraries a candidate may import: the vectorised math library, the Python
# binding glue a pybind11 extension links against.
_TORCH_C_ALLOWED = re.compile(r"^(Sleef_\w+|THP\w+)$")
# C-named exports of torch's libraries that are ATen ops by another door (the AOTI C shim).
_TORCH_C_OPS = re.compile(r"^(aoti_torch_\w+)$")
# MKL's vector math library (VML), bundled in libtorch_cpu: vsExp, vmdLn, vcAdd ... and the Fortran
# spellings (vsexp_).
_VML = re.compile(r"^(vm?[sdcz][A-Z][A-Za-z0-9]*|vm?[sdcz][a-z0-9]+_)$")
_TORCH_LIBRARY = re.compile(r"^(libtorch\w*|libc10\w*|libshm)\.so")


class TorchExports:
    """Which of torch's libraries defines a symbol, read from their ELF files once per process (a
    second or two for libtorch_cuda): by `load`, which the build service starts in the background at
    start-up, or else when first asked. One lock: concurrent first builds wait for one read instead
    of each parsing the same gigabyte under the GIL."""

    def __init__(self, libdir: str | None) -> None:
        self.libdir = libdir
        self._defined: dict[str, str] | None = None
        self._lock = threading.Lock()

    def load(self) -> None:
        with self._lock:
            if self._defined is None:
                self._defined = self._load()

    def library_of(self, sym: str) -> str | None:
        if self._defined is None:
            self.load()
        return self._defined.get(sym.split("@")[0])

    def _load(self) -> dict[str, str]:

        found: dict[str, str] = {}
        if not self.libdir or not os.path.isdir(self.libdir):
            return found
        for name in sorted(os.listdir(self.libdir)):
            if not _TORCH_LIBRARY.match(name):
                continue
            try:
                for sym in read_imports(os.path.join(self.libdir, name)).defined:
                    found.setdefault(sym.split("@")[0], name)
            except (OSError, ElfError, struct.error, IndexError):
                continue
        return found


class Allowlist:
    """The ATen operator names of this torch (one table per process, built from the dispatcher), and
    the exports of torch's libraries."""

    def __init__(self, op_names: list[str], torch_libdir: str | None = None) -> None:
        packets: set[str] = set()
        structs: dict[str, str] = {}
        for full in op_names:
            if not full.startswith("aten::"):
                continue
            base = full[len("aten::") :]
            name, _, overload = base.partition(".")
            packets.add(name)
            structs[name] = name
            if overload:
                structs[f"{name}_{overload}"] = name
        self.packets = frozenset(packets)
        self.structs = structs
        self.torch = TorchExports(torch_libdir)

    @classmethod
    def from_torch(cls) -> Allowlist:

        import torch

        return cls(list(torch._C._dispatch_get_all_op_names()), os.path.join(os.path.dirname(torch.__file__), "lib"))

    def op_of(self, name: str) -> str | None:
        """The ATen op a function name stands for (`clamp_min_out` -> clamp_min), or None."""
        if name in self.packets:
            return name
        for suffix in _OP_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in self.packets:
                return name[: -len(suffix)]
        return None

    def classify(self, sym: str) -> tuple[str, str]:
        """("allow" | "vendor" | "deny", what) for one undefined symbol."""
        comps = qualified_name(sym)
        verdict = self._classify_c(sym) if comps is None else self._classify_cxx(sym, comps)
        if verdict[0] == "deny":
            return verdict
        library = self.torch.library_of(sym)
        if library is None:
            return verdict
        return self._torch_defined(sym, comps, library, verdict)

    def _torch_defined(self, sym: str, comps: list[str] | None, library: str, verdict: tuple[str, str]):
        """The rule for an import that one of torch's libraries defines."""
        base = sym.split("@")[0]
        if comps is None:
            if _TORCH_C_ALLOWED.match(base):
                return "allow", base
            if _TORCH_C_OPS.match(base):
                return "deny", f"{base}() (an ATen op through {library}'s C shim)"
            if re.match(
                r"^(cblas_|[sdcz](gemm|gemv|syrk|trsm|symm|axpy|dot|scal|gesv|getrf|potrf|geqrf|gesdd|syev)|"
                r"[SDCZ](GEMM|GEMV|SYRK|TRSM|SYMM|AXPY|DOT|SCAL|GESV|GETRF|POTRF|GEQRF|GESDD|SYEV)|mkl_|MKL_|"
                r"Dfti|DFTI|nnp_|pytorch_qnnp_|qnnp_|xnn_|dnnl_|mkldnn_)",
                base,
            ):
                return "vendor", f"{library}: bundled BLAS/LAPACK/FFT/NN ({base})"
            if _VML.match(base):
                return "vendor", f"{library}: bundled MKL vector math ({base})"
            return "deny", f"{base}() (an internal of {library}, not tensor plumbing)"
        if comps[0] not in ("at", "c10", "torch", "caffe2", "std", "__gnu_cxx", "__cxxabiv1", "pybind11"):
            return "vendor", f"{library}: bundled {comps[0]}"
        if comps[0] == "at" and len(comps) > 2 and comps[1] in ("cuda", "native") and comps[2] in ("blas", "cpublas"):
            return "vendor", "cublas" if comps[1] == "cuda" else f"{library}: bundled BLAS"
        return verdict

    def _classify_c(self, sym: str) -> tuple[str, str]:
        base = sym.split("@")[0]
        if base in _DENY_C:
            return "deny", f"{base}()"
        if _CUPTI.match(base):
            return "deny", f"{base}() (the profiling interface: the device's record of what ran)"
        for prefix, lib in _VENDOR_C:
            if base.startswith(prefix):
                return "vendor", lib
        if base.startswith("_Z"):  # mangled but unreadable: judge by its words
            return self._classify_words(base)
        return "allow", base

    def _classify_words(self, sym: str) -> tuple[str, str]:
        for marker, what in (
            ("2at4_ops", "at::_ops"),
            ("2at6native", "at::native"),
            ("2at3cpu", "at::cpu"),
            ("2at4cuda", "at::cuda"),
            ("5torch3jit", "torch::jit"),
            ("Dispatch", "the dispatcher"),
        ):
            if marker in sym and not (marker == "2at4cuda" and "getCurrent" in sym):
                return "deny", f"{what} (symbol {sym[:80]})"
        return "allow", sym

    def _classify_cxx(self, sym: str, comps: list[str]) -> tuple[str, str]:
        text = "::".join(comps)
        if any(w in c for c in comps for w in _DISPATCH_WORDS):
            return "deny", f"{text} (the dispatcher or a dispatch-key guard)"
        root = comps[0]
        if root in ("std", "__gnu_cxx", "__cxxabiv1"):
            if any(c in _STD_DENIED for c in comps):
                return "deny", f"{text} (file access)"
            return "allow", text
        if root == "torch":
            if len(comps) > 1 and comps[1] in _TORCH_DENIED_NS:
                return "deny", f"{text} (torch::{comps[1]} is not tensor plumbing)"
            op = self.op_of(comps[-1])
            if op and op not in ALLOWED_OPS:
                return "deny", f"{text} (aten::{op})"
            return "allow", text
        if root != "at":
            return "allow", text
        if len(comps) >= 3 and comps[1] == "_ops":
            op = self.structs.get(comps[2])
            if op is None or op not in ALLOWED_OPS:
                return "deny", f"{text} (aten::{op or comps[2]})"
            return "allow", text
        if len(comps) >= 2 and comps[1] == "native":
            return "deny", f"{text} (an ATen kernel called directly)"
        if "getCurrentCUDABlasHandle" in comps[-1] or "getCurrentCUDABlasLtHandle" in comps[-1]:
            return "vendor", "cublas"
        if "getCudnnHandle" in comps[-1]:
            return "vendor", "cudnn"
        op = self.op_of(comps[-1])
        if op and op not in ALLOWED_OPS:
            how = "an ATen kernel called directly" if len(comps) > 2 and comps[1] in _AT_BACKENDS else f"aten::{op}"
            return "deny", f"{text} ({how})"
        return "allow", text


def check_library(path: str, allowlist: Allowlist, allowed_dirs: tuple[str, ...]) -> SymbolCheck:
    """Every import of one built library, classified (see the module docstring)."""
    result = SymbolCheck()
    try:
        imports = read_imports(path, limited=True)
    except (OSError, ElfError, struct.error, IndexError) as err:
        result.violations.append(
            Violation(
                "native_symbol",
                f"unreadable library: {err}",
                "",
                "the verifier checks what every built library imports",
            )
        )
        return result
    result.imports = len(imports.undefined)
    for sym in imports.undefined:
        verdict, what = allowlist.classify(sym)
        if verdict == "deny":
            kind = "native_op" if "aten::" in what or "ATen" in what else "native_symbol"
            what = what if len(what) <= 300 else what[:297] + "..."
            result.violations.append(Violation(kind, what, "", _reason(kind, what)))
        elif verdict == "vendor":
            result.vendors.add(what)
    if any("7cutlass" in s or "4cute" in s for s in imports.defined):
        result.vendors.add("cutlass")
    for lib in imports.needed:
        if _LIB_VENDOR.match(lib):
            result.vendors.add(_vendor_name(lib))
        elif not _LIB_ALLOWED.match(lib):
            result.violations.append(
                Violation(
                    "native_library",
                    f"links {lib[:200]}",
                    "",
                    "only torch, the C/C++ runtime, CUDA and vendor libraries",
                )
            )
    for entry in imports.search_paths:
        if entry.rstrip("/") not in allowed_dirs:
            result.violations.append(
                Violation(
                    "native_library", f"library search path {entry[:200]}", "", "RPATH/RUNPATH outside torch and CUDA"
                )
            )
    for tag in imports.suspicious:
        result.violations.append(Violation("native_library", tag, "", "dynamic-loader audit/filter entries"))
    result.violations = _dedupe(result.violations)
    return result


def _reason(kind: str, what: str) -> str:
    head = "native code: the built extension imports it"
    if kind == "native_op":
        return f"{head}; ATen compute called from C++/CUDA (write the computation in your kernel)"
    if "dlopen" in what or "dlsym" in what or "dl_iterate" in what:
        return f"{head}; looking up symbols at run time"
    if "dispatcher" in what:
        return f"{head}; bypassing or driving the ATen dispatcher"
    return f"{head}; not allowed in a kernel extension"


def _vendor_name(lib: str) -> str:
    for prefix, name in (
        ("libcublas", "cublas"),
        ("libcudnn", "cudnn"),
        ("libcufft", "cufft"),
        ("libcurand", "curand"),
        ("libcusparse", "cusparse"),
        ("libcusolver", "cusolver"),
        ("libmkl", "mkl"),
        ("libdnnl", "onednn"),
        ("libmkldnn", "onednn"),
    ):
        if lib.startswith(prefix):
            return name
    return "openblas"


def _dedupe(items: list[Violation]) -> list[Violation]:
    seen, out = set(), []
    for v in items:
        if (v.kind, v.what) not in seen:
            seen.add((v.kind, v.what))
            out.append(v)
    return out[:50]
