"""The compilers, flags and library paths one backend builds with, and the id that names them.

`Toolchain.detect(backend)` runs once in the trusted service process (compile children get the
resolved paths in their job request, because the jail gives them an environment of its own). Nothing here
is hard-coded to a machine: torch's include/library paths come from `torch.utils.cpp_extension`,
the C++ standard from what this torch's own extension builder passes, the CUDA arch from
TORCH_CUDA_ARCH_LIST or `nvidia-smi` (never from torch.cuda, which would create a CUDA context).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from .preludes import PRELUDE_DIGEST
from .spec import PIPELINE_VERSION


class ToolchainError(RuntimeError):
    """A compiler or library the backend needs is missing or unusable."""


@dataclass(frozen=True)
class Toolchain:
    backend: str  # "cpu" or "cuda"
    cxx: str  # absolute path of the host C++ compiler
    cxx_version: str
    cxx_is_gcc: bool  # precompiled headers are used only with gcc
    std: str  # "c++20" or "c++17", as this torch builds extensions
    abi: int  # _GLIBCXX_USE_CXX11_ABI of this torch
    torch_version: str
    torch_includes: tuple[str, ...]
    python_include: str
    torch_libdir: str
    nvcc: str = ""
    nvcc_version: str = ""
    cuda_home: str = ""
    cuda_libdir: str = ""
    arch_flags: tuple[str, ...] = ()  # nvcc -gencode flags for the visible GPUs
    nvcc_common: tuple[str, ...] = ()  # torch's COMMON_NVCC_FLAGS
    ccbin: str = ""  # $CC for nvcc's host compiler, as torch honours it
    link_flags: tuple[str, ...] = ()  # e.g. -fuse-ld=gold: links against libtorch ~3x faster than bfd
    nvcc_parallel: bool = True  # run nvcc's host and device front ends concurrently (nvcc.py)
    cuda_facade: bool = True  # try the CUDA facade prelude first (facade.py); KILN_CUDA_FACADE_OFF=1 turns it off

    @property
    def id(self) -> str:
        """Compiler versions + torch version + backend: part of every cache key."""
        parts = [
            self.backend,
            f"torch-{self.torch_version}",
            f"{Path(self.cxx).name}-{self.cxx_version}",
            f"py{sys.version_info.major}.{sys.version_info.minor}",
            self.std,
            f"abi{self.abi}",
            PIPELINE_VERSION,
            f"prelude-{PRELUDE_DIGEST}",
        ]
        if self.backend == "cuda":
            parts += [
                f"nvcc-{self.nvcc_version}",
                ",".join(a.split("code=")[-1] for a in self.arch_flags),
                "nvcc-parallel" if self.nvcc_parallel else "nvcc-plain",
            ]
            if not self.cuda_facade:
                parts.append("no-facade")
        parts += list(self.link_flags)
        return "|".join(parts)

    @property
    def digest(self) -> str:
        """A short, filesystem-safe name for `id` (directory names)."""
        return hashlib.sha256(self.id.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------------------ flags
    def common_flags(self, extension_name: str | None, user_includes: tuple[str, ...] = ()) -> list[str]:
        """Flags every translation unit of an extension shares (as torch's builder sets them).

        `extension_name` None: for precompiling a prelude. gcc refuses a PCH when a macro it was
        built with is defined differently later, so the per-extension name must not be in it.
        """
        flags = [f"-DTORCH_EXTENSION_NAME={extension_name}"] if extension_name else []
        flags += ["-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={self.abi}"]
        flags += [f"-I{os.path.abspath(p)}" for p in user_includes]
        for inc in self.system_includes():
            flags += ["-isystem", inc]
        return flags

    def system_includes(self) -> list[str]:
        incs = list(self.torch_includes)
        if self.backend == "cuda" and self.cuda_home:
            incs.append(os.path.join(self.cuda_home, "include"))
        incs.append(self.python_include)
        return incs

    def cxx_flags(self) -> list[str]:
        # -fno-gnu-unique: an execution worker loads many candidate .so files; unique symbols
        # would bind one candidate's template statics to another's and make .so files unloadable.
        return ["-fPIC", f"-std={self.std}", "-fno-gnu-unique"]

    def nvcc_flags(self, user_flags: tuple[str, ...]) -> list[str]:
        flags = list(self.nvcc_common)
        # torch's rule: a user flag that mentions 'arch' replaces the default arch list.
        if not any("arch" in f for f in user_flags):
            flags += list(self.arch_flags)
            if len(self.arch_flags) > 1:
                flags += ["--threads", "0"]
        flags += ["--compiler-options", "-fPIC", "-Xcompiler", "-fno-gnu-unique"]
        flags += list(user_flags)
        if not any(f.startswith(("-std=", "--std")) for f in flags):
            flags.append(f"-std={self.std}")
        if self.ccbin:
            flags = ["-ccbin", self.ccbin] + flags
        return flags

    def link_libs(self, with_cuda: bool) -> list[str]:
        libs = [f"-L{self.torch_libdir}", "-lc10"]
        if with_cuda:
            libs.append("-lc10_cuda")
        libs.append("-ltorch_cpu")
        if with_cuda:
            libs.append("-ltorch_cuda")
        libs += ["-ltorch", "-ltorch_python"]
        # The C++ runtime by its soname: inside the build jail the compiler's `libstdc++.so` link
        # may not resolve, and ld then links libstdc++.a in silently, whose file and futex calls
        # (open, fdopen, syscall) the symbol check rightly refuses in an extension.
        libs.append("-l:libstdc++.so.6")
        if with_cuda and self.cuda_libdir:
            libs += [f"-L{self.cuda_libdir}", "-lcudart"]
        return libs

    # ------------------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Toolchain:
        fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
        return cls(**fields)

    # ------------------------------------------------------------------------------ detection
    @classmethod
    def detect(cls, backend: str) -> Toolchain:
        if backend not in ("cpu", "cuda"):
            raise ToolchainError(f"backend {backend!r} has no compile toolchain here (cpu, cuda)")
        import torch
        from torch.utils import cpp_extension

        cxx = shutil.which(os.environ.get("CXX", "c++"))
        if cxx is None:
            raise ToolchainError("no C++ compiler: install g++ or set $CXX")
        version = _run([cxx, "-dumpfullversion", "-dumpversion"]).strip()
        is_gcc = "gcc version" in _run([cxx, "-v"], stderr=True)
        fields = {
            "backend": backend,
            "cxx": cxx,
            "cxx_version": version,
            "cxx_is_gcc": is_gcc,
            "std": _torch_cxx_std(cpp_extension),
            "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
            "torch_version": f"{torch.__version__}+{(torch.version.git_version or '')[:10]}",
            "torch_includes": tuple(cpp_extension.include_paths()),
            "python_include": sysconfig.get_path("include", scheme="posix_prefix"),
            "torch_libdir": cpp_extension.library_paths()[0],
        }
        if backend == "cuda":
            fields.update(_detect_cuda(cpp_extension))
        elif is_gcc and shutil.which("ld.gold"):
            # gold only for CPU builds: CUDA objects have not been validated with it on a GPU host.
            fields["link_flags"] = ("-fuse-ld=gold",)
        return cls(**fields)


def _run(cmd: list[str], stderr: bool = False) -> str:
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"{' '.join(cmd)}: {e}") from e
    return p.stderr if stderr else p.stdout


def _torch_cxx_std(cpp_extension) -> str:
    """The -std this torch's extension builder uses (C++20 from torch ~2.12 on, C++17 before)."""
    try:
        text = Path(cpp_extension.__file__).read_text()
    except OSError:
        return "c++17"
    return "c++20" if "'-std=c++20'" in text else "c++17"


def _detect_cuda(cpp_extension) -> dict:
    home = cpp_extension.CUDA_HOME or ""
    nvcc = os.path.join(home, "bin", "nvcc") if home else (shutil.which("nvcc") or "")
    if not nvcc or not os.path.exists(nvcc):
        raise ToolchainError("backend 'cuda' needs nvcc: set CUDA_HOME or put nvcc on PATH")
    if not home:
        home = str(Path(nvcc).resolve().parent.parent)
    if not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        # nvcc behind a wrapper script (/usr/local/bin/nvcc -> exec .../cuda-13.0/bin/nvcc): its
        # dry run names the toolkit it belongs to; g++ units that include the CUDA runtime need it.
        top = re.search(
            r"^#\$ TOP=(\S+)", _run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull], stderr=True), re.MULTILINE
        )
        if top and os.path.exists(os.path.join(top.group(1), "include", "cuda_runtime.h")):
            home = os.path.realpath(top.group(1))
    m = re.search(r"release [\d.]+, V([\d.]+)", _run([nvcc, "--version"]))
    libdir = os.path.join(home, "lib64")
    if not os.path.isdir(libdir) and os.path.isdir(os.path.join(home, "lib")):
        libdir = os.path.join(home, "lib")
    return {
        "nvcc": nvcc,
        "nvcc_version": m.group(1) if m else "unknown",
        "cuda_home": home,
        "cuda_libdir": libdir,
        "arch_flags": tuple(cuda_arch_flags(nvcc)),
        "nvcc_common": tuple(cpp_extension.COMMON_NVCC_FLAGS),
        "ccbin": os.environ.get("CC", ""),
        "nvcc_parallel": not os.environ.get("KILN_NVCC_PLAIN"),
        "cuda_facade": not os.environ.get("KILN_CUDA_FACADE_OFF"),
    }


_NAMED_ARCHES = {"Ampere": "8.0;8.6", "Ada": "8.9", "Hopper": "9.0", "Blackwell": "10.0;12.0"}


def cuda_arch_flags(nvcc: str) -> list[str]:
    """-gencode flags from TORCH_CUDA_ARCH_LIST, else from the visible GPUs via nvidia-smi."""
    wanted = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if wanted and wanted != "native":
        for name, value in _NAMED_ARCHES.items():
            wanted = wanted.replace(name, value)
        arches = [a for a in re.split(r"[;\s]+", wanted) if a]
    else:
        arches = _visible_gpu_arches()
    supported = _nvcc_arches(nvcc)
    flags = []
    for arch in arches:
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", arch)
        if not m:
            raise ToolchainError(f"cannot read CUDA arch {arch!r} (TORCH_CUDA_ARCH_LIST)")
        num = f"{m.group(1)}{m.group(2)}"
        if supported and int(num) > max(supported):
            num = str(max(supported))  # newer GPU than this nvcc knows: build for the newest it has
        suffix = m.group(3)
        flags.append(f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}")
        if m.group(4):
            flags.append(f"-gencode=arch=compute_{num}{suffix},code=compute_{num}{suffix}")
    return sorted(set(flags))


def _visible_gpu_arches() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise ToolchainError("cannot tell the CUDA arch: no nvidia-smi; set TORCH_CUDA_ARCH_LIST (e.g. 9.0)")
    cmd = [smi, "--query-gpu=compute_cap", "--format=csv,noheader"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and re.fullmatch(r"[\d,]+", visible):
        cmd += ["-i", visible]
    caps = sorted({line.strip() for line in _run(cmd).splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())})
    if not caps:
        raise ToolchainError("nvidia-smi shows no GPU; set TORCH_CUDA_ARCH_LIST to build for CUDA")
    return caps


def _nvcc_arches(nvcc: str) -> list[int]:
    out = _run([nvcc, "--list-gpu-arch"])
    return [int(x) for x in re.findall(r"compute_(\d+)", out)]
