"""The headers a candidate's code is compiled against, and their precompiled forms.

load_inline puts `#include <torch/extension.h>` (the whole C++ frontend plus pybind11) on top of
every C++ file; parsing it dominates compile time and, even precompiled, its end-of-file template
instantiations cost ~10 s per file. Kiln compiles the candidate's code against a *lean* prelude
instead and falls back to the *full* one only when the code needs more:

* lean (C++):  ATen (every at:: op and Tensor method, Dispatch, Parallel) plus the `torch::`
               spellings of it (`torch::Tensor`, `torch::empty_like`, `torch::kFloat32`, ...).
* facade (CUDA): no torch header at all, a handle class with torch's spellings (facade.py); tried
               first for CUDA units, which fall back to lean (CUDA) when it lacks a name.
* lean (CUDA): only the Tensor class, the allocation ops used for plumbing and TORCH_CHECK: nvcc
               cannot use a precompiled header, so every header it parses costs three passes.
* binding:     lean (C++) plus pybind11 and torch's type casters, for the generated binding TU.
* full:        exactly load_inline's implicit headers.

A precompiled header (gcc only) is built per prelude and per *flag profile* (the flags that make
gcc reject a PCH: -O0 vs -O1+, -ffast-math, -march, -fopenmp, -g, ...). All variants of one
prelude live in `<prelude>.h.gch/`, a directory gcc searches for the first valid one. Variants are
built by the trusted service process only, from whitelisted flags, into a temp file renamed into
place, under a file lock, so concurrent processes never see a partial PCH or build one twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from actors.verifier import native

from .facade_headers import FACADE_CUDA_PRELUDE, FACADE_HEADER
from .facade_lib import FACADE_BRIDGE, FACADE_LIB_SOURCE
from .thunks import FACADE_THUNK_HEADER, SHELL_SOURCE, THUNK_ABI_HEADER, THUNK_CALLS_HEADER, THUNK_HEADER

_TORCH_SPELLINGS = """
namespace torch {
using namespace at;  // torch::Tensor, torch::empty_like, ... as torch/types.h provides them
using std::nullopt;
using std::optional;
using Dtype = at::ScalarType;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
constexpr auto kU8 = kUInt8;
constexpr auto kI8 = kInt8;
constexpr auto kI16 = kInt16;
constexpr auto kI32 = kInt32;
constexpr auto kI64 = kInt64;
constexpr auto kF16 = kFloat16;
constexpr auto kF32 = kFloat32;
constexpr auto kF64 = kFloat64;
}  // namespace torch
"""

PRELUDES: dict[str, str] = {
    "lean": "// Kiln lean prelude (C++)\n#ifndef KILN_LEAN_H\n#define KILN_LEAN_H\n#include <ATen/ATen.h>\n#include <c10/util/Exception.h>\n"
    "#include <algorithm>\n#include <cmath>\n#include <cstdint>\n#include <limits>\n#include <vector>\n"
    + _TORCH_SPELLINGS
    + "#endif\n",
    "lean_cuda": "// Kiln lean prelude (CUDA)\n#ifndef KILN_LEAN_CUDA_H\n#define KILN_LEAN_CUDA_H\n#include <ATen/core/Tensor.h>\n"
    "#include <ATen/ops/empty.h>\n#include <ATen/ops/empty_like.h>\n#include <ATen/ops/empty_strided.h>\n"
    "#include <ATen/ops/zeros.h>\n#include <ATen/ops/zeros_like.h>\n#include <ATen/ops/ones.h>\n"
    "#include <ATen/ops/ones_like.h>\n#include <ATen/ops/full.h>\n#include <ATen/ops/full_like.h>\n"
    "#include <ATen/Dispatch.h>\n"
    "#include <c10/util/Exception.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n" + _TORCH_SPELLINGS + "#endif\n",
    "binding": '// Kiln binding prelude\n#include "lean.h"\n#include <torch/csrc/utils/pybind.h>\n'
    "#include <torch/csrc/Exceptions.h>\n",
    "full": "// load_inline's implicit C++ header\n#include <torch/extension.h>\n",
    "full_cuda": "// load_inline's implicit CUDA headers\n#include <torch/types.h>\n#include <cuda.h>\n"
    "#include <cuda_runtime.h>\n",
}
PRELUDES["kiln_thunk_abi"] = THUNK_ABI_HEADER
PRELUDES["kiln_thunk_calls"] = THUNK_CALLS_HEADER
PRELUDES["kiln_thunk"] = THUNK_HEADER
PRELUDES["kiln_facade"] = FACADE_HEADER
PRELUDES["facade_cuda"] = FACADE_CUDA_PRELUDE
PRELUDES["kiln_facade_bridge"] = FACADE_BRIDGE
PRELUDES["kiln_facade_thunk"] = FACADE_THUNK_HEADER
PCH_PRELUDES = ("lean", "binding", "full")  # the ones g++ compiles; nvcc has no PCH
# Runs the compiler niced in its own process group, and kills that group when the service process
# dies (PR_SET_PDEATHSIG): an orphaned cc1plus would hold a core and leave a half-written file.
_LAUNCHER = """
import ctypes, os, signal, subprocess, sys
parent = int(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
ctypes.CDLL(None).prctl(1, signal.SIGTERM)
if os.getppid() != parent:
    sys.exit(1)
os.nice(int(sys.argv[2]))
sys.exit(subprocess.call(sys.argv[3:]))
"""
PRELUDE_DIGEST = hashlib.sha256(
    ("".join(PRELUDES[k] for k in sorted(PRELUDES)) + SHELL_SOURCE + FACADE_LIB_SOURCE).encode()
).hexdigest()[:10]
SHELL = "shell"  # the thunk module shell object, built next to the PCH variants
FACADE_LIB = "facade"  # the CUDA facade's out-of-line parts (facade_lib.py), built next to them too
NATIVE = "native"  # the sandbox's native module (actors/verifier/native/kiln_native.c), built next to them too
FENCE = "fence"  # the compute fence (actors/verifier/native/kiln_fence.cpp), built next to them too

# Flags that decide whether gcc accepts a PCH, and that are safe to run outside the sandbox.
_PROFILE_FLAG = re.compile(
    r"^(-ffast-math|-funroll-loops|-march=native|-mtune=native|-fopenmp|-g|-g[0-3]|"
    r"-DNDEBUG|-fno-math-errno|-fno-trapping-math|-ffp-contract=fast|"
    r"-m(avx|avx2|avx512f|avx512bw|avx512vl|fma|f16c|bmi2|sse4\.1|sse4\.2))$"
)


def flag_profile(user_flags: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The PCH-relevant part of a TU's user flags, normalised ('-O3' and '-O2' share a profile)."""
    opt = "-O0"
    rest = set()
    for flag in user_flags:
        for f in flag.split():
            if f == "-Ofast":
                opt = "-O2"
                rest.add("-ffast-math")
            elif f in ("-O0", "-Os", "-Og"):
                opt = f
            elif re.fullmatch(r"-O[1-9]?", f):
                opt = "-O2"
            elif _PROFILE_FLAG.match(f):
                rest.add(f)
    return (opt, *sorted(rest))


def profile_name(profile: tuple[str, ...]) -> str:
    return re.sub(r"[^\w.=-]", "_", "".join(profile))[:120]


class PchAborted(RuntimeError):
    """A build stopped because its store was closed (`PchStore.abort`: the service shut down), not
    because it failed: the part is simply left for the next service to build."""


def _exit_story(returncode: int) -> str:
    """A build's exit in words. The launcher passes on a compiler killed by signal N as its own exit
    status 256 - N (`sys.exit` of subprocess.call's -N); a killed launcher returns -N itself."""
    signal = -returncode if returncode < 0 else 256 - returncode if returncode > 192 else 0
    return f"killed by signal {signal}" if signal else f"exit status {returncode}"


class PchStore:
    """Prelude headers and their precompiled variants for one toolchain, under `root`."""

    def __init__(self, root: Path, toolchain, *, create: bool = True) -> None:
        """`create=False` (a jailed build process): use what the service wrote, write nothing."""
        self.toolchain = toolchain
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._aborted = False
        self.root = Path(root) / toolchain.digest
        if not create:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for name, text in PRELUDES.items():
            _write_once(self.root / f"{name}.h", text)
        _write_once(self.root / f"{SHELL}.cpp", SHELL_SOURCE)
        _write_once(self.root / f"{FACADE_LIB}.cpp", FACADE_LIB_SOURCE)

    def header(self, prelude: str) -> Path:
        return self.root / f"{prelude}.h"

    def variant(self, prelude: str, profile: tuple[str, ...]) -> Path:
        return self.root / f"{prelude}.h.gch" / f"{profile_name(profile)}.gch"

    def has(self, prelude: str, profile: tuple[str, ...]) -> bool:
        return self.toolchain.cxx_is_gcc and self.variant(prelude, profile).exists()

    def build(self, prelude: str, profile: tuple[str, ...], nice: int = 0) -> float:
        """Build one PCH variant (or, for prelude "shell", the thunk module shell) if missing;
        returns the seconds spent (0 when already there).

        Raises RuntimeError with the compiler's output when it does not compile.
        """
        if prelude == SHELL:
            return self._build_once(self.shell_object(), self._shell_cmd, nice)
        if prelude == NATIVE:
            return self._build_once(self.native_module(), native.native_command, nice)
        if prelude == FENCE:
            return self._build_once(self.fence_module(), lambda tmp: native.fence_command(self.toolchain, tmp), nice)
        if prelude == FACADE_LIB:
            return self._build_once(self.facade_object(), self._facade_cmd, nice)
        if prelude not in PCH_PRELUDES or not self.toolchain.cxx_is_gcc:
            return 0.0
        if any(not (_PROFILE_FLAG.match(f) or re.fullmatch(r"-O[0-3sg]?", f)) for f in profile):
            raise ValueError(f"refusing PCH profile with unvetted flags: {profile}")
        cmd = lambda tmp: [
            self.toolchain.cxx,
            *self.toolchain.cxx_flags(),
            *self.toolchain.common_flags(None),
            *profile,
            "-x",
            "c++-header",
            str(self.header(prelude)),
            "-o",
            str(tmp),
        ]
        return self._build_once(self.variant(prelude, profile), cmd, nice)

    def shell_object(self) -> Path:
        return self.root / f"{SHELL}.o"

    def _shell_cmd(self, tmp: Path) -> list[str]:
        return [
            self.toolchain.cxx,
            *self.toolchain.cxx_flags(),
            *self.toolchain.common_flags("kiln_ext"),
            "-O2",
            "-c",
            str(self.root / f"{SHELL}.cpp"),
            "-o",
            str(tmp),
        ]

    def facade_object(self) -> Path:
        return self.root / f"{FACADE_LIB}.o"

    def _facade_cmd(self, tmp: Path) -> list[str]:
        # The lean PCH's flags (-O2 profile), so gcc can use it for the ATen part.
        return [
            self.toolchain.cxx,
            *self.toolchain.cxx_flags(),
            *self.toolchain.common_flags(None),
            "-O2",
            "-c",
            str(self.root / f"{FACADE_LIB}.cpp"),
            "-o",
            str(tmp),
        ]

    def native_module(self) -> Path:
        """kiln_native, named after its sources (a changed source builds anew)."""
        return self.root / f"kiln_native.{native.source_digest()}.so"

    def fence_module(self) -> Path:
        return self.root / f"kiln_fence.{native.source_digest()}.so"

    def _build_once(self, out: Path, make_cmd, nice: int) -> float:
        if out.exists():
            return 0.0
        out.parent.mkdir(parents=True, exist_ok=True)
        stem = out.relative_to(self.root).as_posix().replace("/", "_")
        with open(self.root / f".{stem}.lock", "w") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            if out.exists():
                return 0.0
            for stale in self.root.glob(f".{stem}.*.tmp"):
                stale.unlink(missing_ok=True)  # left by a builder that died holding this lock
            t0 = time.monotonic()
            tmp = self.root / f".{stem}.{os.getpid()}.tmp"
            try:
                # The compiler must not outlive this process (an orphan would hold a core and
                # leave a half-written file), and must yield to candidate compiles.
                launcher = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), str(nice)]
                with self._lock:
                    if self._aborted:
                        raise PchAborted(f"{out.name} not started: the build service closed")
                    self._proc = subprocess.Popen(
                        launcher + make_cmd(tmp),
                        cwd=self.root,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        errors="replace",
                        start_new_session=True,
                    )
                output, _ = self._proc.communicate()
                code = self._proc.returncode
                if code != 0 and self._aborted:  # killed by abort(): nothing failed
                    raise PchAborted(f"building {out.name} stopped: the build service closed")
                if code != 0:
                    said = f":\n{output[-3000:]}" if output.strip() else " without a word of output"
                    raise RuntimeError(f"building {out.name} failed ({_exit_story(code)}){said}")
                os.replace(tmp, out)
            finally:
                self._proc = None
                tmp.unlink(missing_ok=True)
            return time.monotonic() - t0

    def abort(self) -> None:
        """Kill a PCH build in progress and refuse new ones (service shutdown)."""
        with self._lock:
            self._aborted = True
            if self._proc is not None and self._proc.poll() is None:
                try:
                    os.killpg(self._proc.pid, 9)
                except OSError:
                    pass


def _write_once(path: Path, text: str) -> None:
    """Create `path` with `text` atomically unless it already holds exactly that text."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
