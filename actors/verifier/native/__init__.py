"""The sandbox's native parts, and how they are built and loaded.

Two Python extension modules, built once per toolchain and machine by the trusted build service
(next to the precompiled headers, `build_commands`) and imported by the zygote from those paths
(`load`), so every process forked from it has them:

    kiln_native   (kiln_native.c, C, Python headers only) the jail's system calls without ctypes,
                  the one-way `arm` (a C audit hook, the evidence channel, a stacked seccomp
                  filter), refusers for torch's data paths, attribution of a refusal to the
                  candidate's line. Imported before torch.
    kiln_fence    (kiln_fence.cpp, C++, torch headers) the compute fence: a kernel in front of every
                  ATen operator outside plumbing at every backend key, refusing once the process is
                  armed. Imported after torch.

`shim.install` then keeps ctypes and every module that exposes raw memory out of the zygote's
interpreter, so no process that runs candidate code has them loaded (see shim.py).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

SOURCES = Path(__file__).resolve().parent
NATIVE = "kiln_native"
FENCE = "kiln_fence"
# Top-level modules a process that runs candidate code may never import: they hand Python raw
# memory (ctypes, cffi, numpy's array interface, the interpreter's test modules) or reach into the
# interpreter. The zygote never loads them, the jail hides their files, and the armed audit hook
# refuses their import.
DENIED_IMPORTS = (
    "ctypes",
    "_ctypes",
    "_ctypes_test",
    "cffi",
    "_cffi_backend",
    "numpy",
    "numba",
    "cupy",
    "_testcapi",
    "_testinternalcapi",
    "_testbuffer",
    "_testmultiphase",
    "_testsinglephase",
    "_testimportmultiple",
    "_testclinic",
    "_xxsubinterpreters",
    "_xxinterpchannels",
    "_xxtestfuzz",
    "xxlimited",
    "xxlimited_35",
    "xxsubtype",
    # NVML's binding over ctypes: torch imports it when installed; without ctypes it cannot work
    "pynvml",
    # a pickler that reaches into the interpreter through ctypes.pythonapi: torch's data pipes import
    # it when installed (TRL's `datasets`, a test dependency, brings it); torch works without it
    "dill",
)
# Kiln's own packages: never the candidate's business (imports refused once armed).
KILN_PACKAGES = ("actors", "protocols", "configs", "launch", "tasks", "tests")


def filename(name: str) -> str:
    """The file name of extension module `name` for this interpreter."""
    return name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def c_compiler() -> str:
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    return cc[0] if cc else "cc"


def native_command(out: Path) -> list[str]:
    """Compile kiln_native: plain C against this interpreter's headers, no torch."""
    return [
        c_compiler(),
        "-O2",
        "-Wall",
        "-shared",
        "-fPIC",
        f"-I{sysconfig.get_path('include')}",
        str(SOURCES / "kiln_native.c"),
        "-o",
        str(out),
    ]


def fence_command(toolchain, out: Path) -> list[str]:
    """Compile kiln_fence: C++ against torch's and this interpreter's headers."""
    tc = toolchain
    return [
        tc.cxx,
        *tc.cxx_flags(),
        *tc.common_flags(None),
        "-O2",
        "-shared",
        str(SOURCES / "kiln_fence.cpp"),
        "-o",
        str(out),
        f"-L{tc.torch_libdir}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch_python",
    ]


def source_digest() -> str:
    """Changes when either source changes (part of the built files' cache key)."""
    import hashlib

    h = hashlib.sha256()
    for name in ("kiln_native.c", "kiln_clock.h", "kiln_trace.h", "kiln_fence.cpp"):
        h.update((SOURCES / name).read_bytes())
    return h.hexdigest()[:10]


def load(name: str, path: str | Path) -> ModuleType:
    """Import extension module `name` from `path` (and register it under that name)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def ensure_loaded(path: str | Path) -> ModuleType:
    """kiln_native in this process: the one already loaded, else the one at `path`. The verifier loads
    the zygote's for the timing protocol's CallClock, the same code its sandboxes time with."""
    return sys.modules.get(NATIVE) or load(NATIVE, path)


def loaded() -> ModuleType:
    """kiln_native, as the zygote loaded it (every jailed process has it)."""
    module = sys.modules.get(NATIVE)
    if module is None:
        raise RuntimeError("kiln_native is not loaded: jailed processes are forked from the zygote, which loads it")
    return module


def evidence_records(data: bytes) -> list[tuple[int, str, str, str]]:
    """(seq, kind, what, site) of each whole line kiln_native logged: "seq\\tkind\\twhat\\tsite\\n", as
    read from the evidence pipe or carried by a signed reply (the same refusal may come both ways: the
    sequence number tells)."""
    found = []
    for line in data.split(b"\n"):
        parts = line.decode("utf-8", "replace").split("\t")
        if len(parts) >= 3 and parts[0].isdigit() and parts[1]:
            found.append((int(parts[0]), parts[1][:40], parts[2][:200], (parts[3] if len(parts) > 3 else "")[:200]))
    return found


# Where imports look for bytecode once a process is armed: nowhere. Loading a .pyc is marshal.loads,
# which the audit hook refuses (crafted bytecode reads and writes raw memory), so a module first
# imported after arming is compiled from its source instead (the "compile" event, allowed).
NO_BYTECODE = "/nonexistent/kiln-no-bytecode"
# Kiln's tree, as its code objects name their files (this file's own spelling, not resolved): frames,
# functions and tracebacks of code from here are the sandbox's own, out of the candidate's reach.
TRUSTED_ROOT = str(Path(__file__).parents[3])


def arm(
    kn: ModuleType,
    evidence_fd: int,
    candidate_file: str,
    source: str,
    seccomp: bytes | None,
    own_libraries: tuple[str, ...] = (),
) -> None:
    """Throw the one-way switch of this process (kiln_native.arm), with Kiln's lists. `own_libraries`:
    the candidate's artifact table, the only native extensions it may load besides the interpreter's
    own (`extension_rule`): the built libraries' files, or (a path ending in "/") the directory that
    holds only the libraries of its own build."""
    sys.pycache_prefix = NO_BYTECODE
    sys.dont_write_bytecode = True
    own, dirs, suffixes = extension_rule(own_libraries)
    kn.arm(
        evidence_fd,
        candidate_file,
        source,
        DENIED_IMPORTS,
        KILN_PACKAGES,
        TRUSTED_ROOT,
        seccomp,
        own_libraries=own,
        module_dirs=dirs,
        module_suffixes=suffixes,
    )


def extension_rule(own_libraries: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(own libraries, module directories, module suffixes) of the armed extension-load rule, resolved
    now: the artifact table's paths (a directory keeps its trailing "/"), the directories of sys.path
    (the standard library's extension modules, the visible site-packages), and the interpreter's
    tagged extension suffixes (".cpython-311-x86_64-linux-gnu.so", ".abi3.so"; not a bare ".so", which
    any shared library has)."""
    import os

    def resolved(path: str) -> str:
        real = os.path.realpath(path)
        return real.rstrip("/") + "/" if path.endswith("/") else real

    own = tuple(resolved(str(p)) for p in own_libraries if p)
    dirs = tuple(
        sorted({resolved(p + "/") for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p)} - {"//", "/"})
    )
    suffixes = tuple(s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so")
    return own, dirs, suffixes
