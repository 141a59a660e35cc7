"""Whose code an instruction pointer of a sandbox is in: the one documented table of cpu provenance.

A sample's instruction pointer (sampling.py) is placed in one executable mapping of the sandbox
(read from /proc/PID/maps by the verifier), and the mapping's file is known by its device and inode,
which a bind mount into the jail keeps, so the verifier judges the file it has itself, never one
the sandbox names. Within torch's libraries and the bundled code in them, the sample is attributed
**by symbol**, read from the library's own ELF symbol table (.symtab, else .dynsym):

| class | what | how it is found |
| --- | --- | --- |
| `own` | the candidate's own build | its built libraries, by inode |
| `aten` | libtorch's operator kernels, however they were reached | a libtorch symbol of an operator's kernel, or the loop or lambda that runs one (`KERNEL_IDENT`), or of an operator outside plumbing in `at::native`, `at::cpu`, `at::_ops` |
| `plumbing` | libtorch's allocation, views, copies, casts, fills and random fills | a libtorch symbol of one of those (`PLUMBING_MARKS`, an op of `legality.ALLOWED_OPS`) |
| `runtime` | the dispatcher, the allocator, tensor bookkeeping, and every library that is not compute | libtorch code no rule above claims (c10, the dispatcher, autograd, TensorIterator's set-up); libc, libm, libstdc++, libgcc, the loader, Python, libgomp, the vdso, the sandbox's own libraries |
| `math` | vectorised math (Sleef) bundled in libtorch | `Sleef_*`: allowed as libm is |
| `vendor` | bundled vendor math (MKL, VML, oneDNN, OpenBLAS, FBGEMM, NNPACK, XNNPACK) and vendor libraries | its symbols in torch's libraries; vendor libraries' own files |
| `unknown` | executable memory of no file, or of a file none of the above names | JIT code; a library nobody expected |

Only samples in the candidate's own code count as its work. provenance.py turns the classes into
findings; docs/verifier.md states the rules and their statistical power.
"""

from __future__ import annotations

import bisect
import functools
import mmap
import os
import re
import struct
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path

from actors.verifier.legality import ALLOWED_OPS

CLASSES = ("own", "aten", "plumbing", "runtime", "math", "vendor", "unknown")

# Files, by name, whose code is the machine's runtime, not compute (the sandbox's own Python and its
# libraries included: the interpreter's frames, msgpack, the arena's copies).
RUNTIME_FILES = re.compile(
    r"(^|/)(ld-linux[\w.-]*|libc\.so[\w.]*|libm\.so[\w.]*|libmvec[\w.]*|libpthread[\w.]*|libdl[\w.]*|librt[\w.]*"
    r"|libstdc\+\+[\w.]*|libgcc_s[\w.]*|libgomp[\w.-]*|libiomp5[\w.]*|libpython[\w.]*|python3[\w.]*|libz\.so[\w.]*"
    r"|libffi[\w.]*|libutil[\w.]*|libcrypto[\w.]*|libssl[\w.]*|libuuid[\w.]*|libexpat[\w.]*|liblzma[\w.]*"
    r"|libbz2[\w.]*|libtinfo[\w.]*|libreadline[\w.]*|libncurses[\w.]*|libsqlite3[\w.]*|libshm[\w.]*"
    r"|libtorch_python\.so|libtorch_global_deps\.so|libc10\.so|libc10_cuda\.so|kiln_native[\w.-]*|kiln_fence[\w.-]*"
    r"|_[\w]+\.cpython-[\w.-]+\.so|[\w]+\.cpython-[\w.-]+\.so)$"
)
# Torch's compute libraries: attributed by symbol.
TORCH_COMPUTE_FILES = re.compile(r"(^|/)(libtorch_cpu|libtorch|libtorch_cuda)\.so$")
# Vendor libraries shipped as files of their own (CUDA's included: cuBLAS, cuDNN, ... on cuda hosts).
VENDOR_FILES = re.compile(
    r"(^|/)(libmkl[\w.-]*|libopenblas[\w.-]*|libblas[\w.-]*|liblapack[\w.-]*|libdnnl[\w.-]*|libcublas[\w.-]*"
    r"|libcudnn[\w.-]*|libcufft[\w.-]*|libcurand[\w.-]*|libcusparse[\w.-]*|libcusolver[\w.-]*|libnccl[\w.-]*"
    r"|libcuda[\w.-]*|libcudart[\w.-]*|libnvrtc[\w.-]*|libnvJitLink[\w.-]*|libcupti[\w.-]*)$"
)
# In a torch library: a symbol of bundled vendor code (its mangled or C name begins with one of these).
VENDOR_MARKS = (
    "mkl_",
    "MKL_",
    "mkl",
    "vml",
    "Vml",
    "_ZN4dnnl",
    "_ZNK4dnnl",
    "dnnl_",
    "_ZN6ideep",
    "_ZN6fbgemm",
    "_ZNK6fbgemm",
    "fbgemm",
    "nnp_",
    "xnn_",
    "pytorch_q",
    "_ZN6Xbyak",
    "cblas_",
    "LAPACKE",
    "sgemm",
    "dgemm",
    "SGEMM",
    "DGEMM",
    "gemm_",
    "_ZN5pocketfft",
    "_ZN3kl",
    "_ZN3asmjit",
    "omp_",
)
# Bundled vendor routines that are a cast (copy_ to and from half types runs FBGEMM's), and FBGEMM's
# question about the CPU it runs on.
VENDOR_CASTS = (
    "FloatToFloat16",
    "Float16ToFloat",
    "FloatToBfloat16",
    "Bfloat16ToFloat",
    "FloatToFloat8",
    "Float8ToFloat",
    "fbgemmHasAvx",
    "fbgemmHasArm",
)
# In a torch library: a symbol of plumbing (allocation, copies and casts, fills, random fills): its
# name carries the kernel it belongs to, even inside a lambda or a TensorIterator loop's template.
PLUMBING_MARKS = (
    "copy_kernel",
    "copy_impl",
    "copy_same_type",
    "copy_same_dtype",
    "copy_requires_temporaries",
    "direct_copy",
    "_copy_from",
    "_to_copy",
    "fill_kernel",
    "fill_stub",
    "fill_out",
    "fill_empty_deterministic",
    "empty_cpu",
    "empty_generic",
    "empty_strided",
    "resize_impl",
    "resize_bytes",
    "zero_",
    "normal_kernel",
    "normal_fill",
    "uniform_kernel",
    "random_kernel",
    "random_from_to",
    "exponential_kernel",
    "cauchy_kernel",
    "log_normal_kernel",
    "geometric_kernel",
    "randperm",
    "mt19937",
    "CPUGeneratorImpl",
    "philox",
)
# Runtime entries that are C names (the C++ ABI's, the unwinder's, the allocator's).
RUNTIME_C = re.compile(
    r"^(__cxa_|_Unwind|__gxx|__gcc|__tls|_dl_|__libc|__memcpy|__memset|GOMP_|omp_|kmp_|__kmp|_init$|_fini$"
    r"|frame_dummy|register_tm_clones|deregister_tm_clones|__do_global)"
)
MATH_C = re.compile(r"^Sleef_")
# An identifier of a mangled name that is an operator's kernel or the loop that runs one: the name
# of the function or template the sampled code was instantiated for.
KERNEL_IDENT = re.compile(
    r"(_kernel|_kernel_impl|_kernel_cpu|_kernel_vec|Kernel|_stub)$|^(VectorizedLoop2d|vectorized_loop|loop_2d_from_1d"
    r"|basic_loop|cpu_kernel|cpu_kernel_vec|cpu_serial_kernel|binary_kernel_reduce|binary_kernel_reduce_vec"
    r"|unary_kernel_reduce|vectorized_reduction|parallel_reduce|_vec_log_softmax|_vec_softmax)$"
)
_LOOPS = re.compile(r"^(VectorizedLoop2d|vectorized_loop|loop_2d_from_1d|basic_loop|cpu_kernel|cpu_kernel_vec)$")
# The dispatcher's own types, which name a kernel without being one.
RUNTIME_IDENTS = frozenset(
    {"OperatorKernel", "BoxedKernel", "KernelFunction", "SafeKernelFunction", "OperatorHandle", "DispatchStubImpl"}
)
# Torch's own BLAS and vectorised math under at::native: compute, whatever the function's name.
NATIVE_COMPUTE = frozenset({"cpublas", "blas_impl", "vml", "mkldnn", "onednn", "quantized", "sparse"})
# An operator's overload name after its own name in `at::_ops::<op>_<overload>` (`empty_memory_format`,
# `view_dtype`, `slice_Tensor`): the part after the op that says which overload, not another op.
_OVERLOAD = re.compile(
    r"^(_?[A-Z]\w*|out|dtype|memory_format|int|self|dim|names|src|other|from|to|generator|float|symint"
    r"|using_ints|default|device|prim_dtype|dtype_layout|copy|Scalar\w*|Tensor\w*|list|intlist|sizes|value)$"
)


def identifiers(name: str) -> list[str]:
    """The source names inside a mangled C++ name, in order (its scopes, template arguments and
    lambdas' enclosing functions alike): a scan of its length-prefixed names, no demangler needed.
    A number after S or T and before "_" is a substitution or template parameter, not a length."""
    found, i, n = [], 0, len(name)
    while i < n:
        if not name[i].isdigit():
            i += 1
            continue
        j = i
        while j < n and name[j].isdigit():
            j += 1
        if i and name[i - 1] in "ST" and j < n and name[j] == "_":
            i = j + 1
            continue
        length = int(name[i:j])
        ident = name[j : j + length]
        if length and len(ident) == length and (ident[0].isalpha() or ident[0] == "_"):
            found.append(ident)
            i = j + length
        else:
            i = j
    return found


def label(symbol: str) -> str:
    """A short, readable name for a sampled symbol: the kernel it belongs to where one is named
    (`maximum_kernel`), else its first scopes (`at::native::relu`); a C name as it is."""
    if not symbol.startswith("_Z"):
        return symbol[:80]
    idents = [i for i in identifiers(symbol) if KERNEL_IDENT.search(i) and i not in RUNTIME_IDENTS]
    named = next((i for i in idents if not _LOOPS.match(i)), None)  # the kernel, not the loop that runs it
    return named or (idents[0] if idents else "") or "::".join(identifiers(symbol)[:3]) or symbol[:80]


def op_of(component: str) -> str | None:
    """The ATen operator an `at::_ops`/`at::native`/`at::cpu` function is named after (the op
    itself, `<op>_<overload>`, `<op>_out`, `<op>_symint`), or None for a helper that is no operator."""
    ops = _aten_ops()
    if component in ops:
        return component
    parts = component.split("_")
    for k in range(len(parts) - 1, 0, -1):
        op, rest = "_".join(parts[:k]), "_".join(parts[k:])
        if op in ops and _OVERLOAD.match(rest):
            return op
        if op + "_" in ops and _OVERLOAD.match(rest):
            return op + "_"
    return None


@functools.cache
def _aten_ops() -> frozenset[str]:
    """Every ATen operator's name (no overload), as this torch registers them."""
    import torch

    names = torch._C._dispatch_get_all_op_names()
    return frozenset(n[len("aten::") :].split(".")[0] for n in names if n.startswith("aten::"))


@dataclass(frozen=True)
class Attributed:
    """One instruction pointer's owner: its class, and the file and symbol it was found in."""

    cls: str
    where: str  # the file's base name ("" for anonymous memory)
    symbol: str  # the symbol's (mangled) name, or "" where none covers the address


class FunctionTable:
    """The functions of one ELF file: sorted start addresses (in the file's virtual addresses), sizes
    and name offsets, read once; names are decoded only when an address is asked for."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = self._map
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        (phoff,) = struct.unpack_from("<Q", data, 0x20)
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        # PT_LOAD segments: (file offset, size in the file, virtual address)
        self.loads = []
        for i in range(phnum):
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + i * phentsize
            )
            if p_type == 1:
                self.loads.append((p_offset, p_filesz, p_vaddr))
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        chosen = [s for s in sections if s[1] == 2] or [s for s in sections if s[1] == 11]  # SHT_SYMTAB, SHT_DYNSYM
        entries = []
        if chosen:
            _n, _k, _f, _a, offset, size, link, _i, _al, _e = chosen[0]
            self._strtab = sections[link][4]
            for st_name, st_info, _other, st_shndx, st_value, st_size in struct.iter_unpack(
                "<IBBHQQ", data[offset : offset + size]
            ):
                if st_info & 0xF == 2 and st_shndx != 0 and st_value:  # STT_FUNC, defined
                    entries.append((st_value, st_size, st_name))
        else:
            self._strtab = 0
        entries.sort()
        self.starts = array("Q", (e[0] for e in entries))
        self.sizes = array("Q", (e[1] for e in entries))
        self.names = array("Q", (e[2] for e in entries))

    def vaddr(self, file_offset: int) -> int | None:
        for off, size, vaddr in self.loads:
            if off <= file_offset < off + size:
                return file_offset - off + vaddr
        return None

    def symbol_at(self, vaddr: int) -> str:
        """The name of the function covering `vaddr`, or "" (past its end, or before the first)."""
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i < 0:
            return ""
        if self.sizes[i] and vaddr >= self.starts[i] + self.sizes[i]:
            return ""
        at = self._strtab + self.names[i]
        end = self._map.find(b"\0", at, at + 65536)
        return self._map[at : end if end >= 0 else at + 65536].decode("ascii", "replace")


_TABLES: dict[tuple[int, int], FunctionTable | None] = {}
_TABLES_LOCK = threading.Lock()


def function_table(path: str, ident: tuple[int, int]) -> FunctionTable | None:
    """The function table of the file `ident` (device, inode) at `path`, read once per process."""
    with _TABLES_LOCK:
        if ident not in _TABLES:
            try:
                _TABLES[ident] = FunctionTable(path)
            except (OSError, ValueError, struct.error, IndexError):
                _TABLES[ident] = None
        return _TABLES[ident]


def classify_torch_symbol(name: str) -> str:
    """The class of a function in one of torch's compute libraries, from its (mangled) name: the
    kernel it belongs to decides (a copy's loop is plumbing, a maximum's is ATen's, whatever
    template or callback wraps it), then its scope (c10, the dispatcher: runtime)."""
    if not name:
        return "runtime"  # no symbol covers it: no rule names it an operator's kernel
    if MATH_C.match(name):
        return "math"
    if any(mark in name for mark in VENDOR_CASTS):
        return "plumbing"
    if name.startswith(VENDOR_MARKS):
        return "vendor"
    if RUNTIME_C.match(name):
        return "runtime"
    if not name.startswith("_Z"):
        return "vendor"  # a C name in torch's library that is not torch's own: bundled code
    if any(mark in name for mark in PLUMBING_MARKS):
        return "plumbing"
    idents = identifiers(name)
    if any(KERNEL_IDENT.search(ident) and ident not in RUNTIME_IDENTS for ident in idents):
        return "aten"
    if len(idents) >= 3 and idents[0] == "at" and idents[1] in ("_ops", "native", "cpu", "cuda", "meta", "vml"):
        if idents[1] == "vml" or idents[2] in NATIVE_COMPUTE:
            return "aten"
        op = op_of(idents[2])
        if op is None:  # a helper of no operator (checks, shape arithmetic, the stub's dispatch)
            return "runtime"
        return "plumbing" if op in ALLOWED_OPS or op.rstrip("_") in ALLOWED_OPS else "aten"
    return "runtime"


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    ident: tuple[int, int]  # (device, inode); (0, 0) for anonymous memory
    name: str  # as the sandbox sees it ("" for anonymous memory, "[vdso]" ...)


def executable_mappings(pid: int) -> list[Mapping]:
    """The executable mappings of a process, read from /proc by the verifier."""
    found = []
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 5 or "x" not in parts[1]:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                name = parts[5].strip() if len(parts) > 5 else ""
                found.append(Mapping(lo, hi, int(parts[2], 16), (os.makedev(major, minor), int(parts[4])), name))
    except (OSError, ValueError):
        pass
    return found


class AddressMap:
    """A sandbox's executable memory, each mapping tied to a file of the verifier's own (found by
    device and inode among `own` — the candidate's built libraries — and the libraries this process
    loaded itself) and a class, and each address inside torch's compute libraries to its symbol."""

    def __init__(self, own: list[str]) -> None:
        self.own = {_ident(p) for p in own if _ident(p)}
        self.mappings: dict[tuple[int, int], Mapping] = {}
        self._known = _host_files()
        self._starts: list[int] = []
        self._sorted: list[Mapping] = []

    def observe(self, pid: int) -> None:
        """Add the process's current executable mappings (called while it lives, more than once:
        libraries load at import and after)."""
        for m in executable_mappings(pid):
            self.mappings[(m.start, m.end)] = m
        self._sorted = sorted(self.mappings.values(), key=lambda m: m.start)
        self._starts = [m.start for m in self._sorted]

    def attribute(self, ip: int) -> Attributed:
        i = bisect.bisect_right(self._starts, ip) - 1
        if i < 0 or ip >= self._sorted[i].end:
            return Attributed("unknown", "", "")
        m = self._sorted[i]
        if m.ident in self.own:
            return Attributed("own", "(your extension)", "")
        if m.ident == (0, 0) or not m.name.startswith("/"):
            return Attributed("runtime" if m.name in ("[vdso]", "[vsyscall]") else "unknown", m.name, "")
        base = os.path.basename(m.name)
        path = self._known.get(m.ident)
        if path is None:  # a file this process never loaded: judge by its name, read nothing of it
            if VENDOR_FILES.search(base):
                return Attributed("vendor", base, "")
            if RUNTIME_FILES.search(base):
                return Attributed("runtime", base, "")
            return Attributed("unknown", base, "")
        base = os.path.basename(path)
        if TORCH_COMPUTE_FILES.search(base):
            table = function_table(path, m.ident)
            vaddr = table.vaddr(ip - m.start + m.offset) if table else None
            symbol = table.symbol_at(vaddr) if table and vaddr is not None else ""
            return Attributed(classify_torch_symbol(symbol), base, symbol)
        if VENDOR_FILES.search(base):
            return Attributed("vendor", base, "")
        if RUNTIME_FILES.search(base):
            return Attributed("runtime", base, "")
        return Attributed("unknown", base, "")


def _ident(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _host_files() -> dict[tuple[int, int], str]:
    """The files this (trusted) process has mapped executable, by (device, inode): the libraries a
    sandbox shares with the verifier are these same files (the zygote loads what the verifier does)."""
    found = {}
    for m in executable_mappings(os.getpid()):
        if m.name.startswith("/") and m.ident != (0, 0):
            found.setdefault(m.ident, m.name)
    for lib in _torch_libraries():
        ident = _ident(lib)
        if ident:
            found.setdefault(ident, lib)
    return found


def _torch_libraries() -> list[str]:
    import torch

    libdir = Path(torch.__file__).parent / "lib"
    return [str(p) for p in libdir.glob("*.so*")] if libdir.is_dir() else []
