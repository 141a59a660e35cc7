"""`check_solutions.py --backend cuda --compile-only`: compile every cuda solution's load_inline sources
without a GPU (nvcc for cuda_sources, a g++ syntax check for cpp_sources), shimming the toolkit headers
this machine lacks and reporting which ones were shimmed."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from check_common import Row, Task, load_module, static_forward_issues, static_native_issues


# --------------------------------------------------------------------------- cuda compile-only
class _Dummy:
    def __getattr__(self, name):
        def _f(*a, **k):
            raise RuntimeError("compile-only mode: extension not loaded")

        return _f


def extract_sources(path: Path):
    """Imports a solution with load_inline replaced by a recorder; returns (calls, module)."""
    import torch.utils.cpp_extension as cpp_ext

    calls = []

    def recorder(name, cpp_sources, cuda_sources=None, functions=None, **kwargs):
        def as_list(x):
            return [] if x is None else ([x] if isinstance(x, str) else list(x))

        calls.append(
            {
                "name": name,
                "cpp": as_list(cpp_sources),
                "cuda": as_list(cuda_sources),
                "functions": functions,
                "kwargs": kwargs,
            }
        )
        return _Dummy()

    orig = cpp_ext.load_inline
    cpp_ext.load_inline = recorder
    try:
        mod = load_module(path, "extract")
    finally:
        cpp_ext.load_inline = orig
    return calls, mod


SHIM_HEADERS = {
    # CUDA math-library headers that ATen/cuda/CUDAContext.h pulls in. Only handle types and status
    # codes are needed to parse it; the solutions do not call these libraries.
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n"
    "#define CUSPARSE_STATUS_SUCCESS 0\n"
    'inline const char* cusparseGetErrorString(cusparseStatus_t) { return ""; }\n',
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n"
    "#define CUBLAS_STATUS_SUCCESS 0\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n#define CUSOLVER_STATUS_SUCCESS 0\n"
    "#define CUSOLVER_STATUS_INVALID_VALUE 3\n",
}
TORCH_GENERATED_SHIMS = {
    # Generated at torch build time and absent from CPU-only wheels.
    "c10/cuda/impl/cuda_cmake_macros.h": "",
}


def cuda_include_dir() -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    return Path(nvcc).resolve().parent.parent / "include"


def make_shim(root: Path) -> list[str]:
    shim = root / "shim"
    made = []
    cinc = cuda_include_dir()
    from torch.utils.cpp_extension import include_paths

    tinc = [Path(p) for p in include_paths()]
    for hdr, body in SHIM_HEADERS.items():
        if not (cinc / hdr).exists():
            (shim / hdr).parent.mkdir(parents=True, exist_ok=True)
            (shim / hdr).write_text("#pragma once\n" + body)
            made.append(hdr)
    for hdr, body in TORCH_GENERATED_SHIMS.items():
        if not any((p / hdr).exists() for p in tinc):
            (shim / hdr).parent.mkdir(parents=True, exist_ok=True)
            (shim / hdr).write_text("#pragma once\n" + body)
            made.append(hdr)
    return made


def _compile_one(args) -> tuple[str, bool, float, str]:
    cmd, cwd, label = args
    t0 = time.time()
    p = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True)
    out = p.stdout + p.stderr
    Path(cwd, label.split("|")[1].replace("+", "x") + ".log").write_text(" ".join(cmd) + "\n\n" + out)
    errs = "\n".join(line for line in out.splitlines() if "error" in line.lower())
    return label, p.returncode == 0, time.time() - t0, (errs or out)[-3000:]


@dataclass(frozen=True)
class _Flags:
    """What every compile-only command shares: the language standard, the GPU architecture, include
    directories (the shims first), the C++ ABI of this torch and nvcc's common flags."""

    std: str
    arch: str
    incs: tuple[str, ...]
    pyinc: str
    abi: int
    nvcc_common: tuple[str, ...]


def compile_only_cuda(tasks: list[Task], jobs: int, std: str, arch: str) -> list[Row]:
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "compile_only"
    root.mkdir(parents=True, exist_ok=True)
    shimmed = make_shim(root)
    if shimmed:
        print(f"[compile-only] shimmed missing headers: {shimmed}")
    flags = _Flags(
        std=std,
        arch=arch,
        incs=tuple([f"-I{root / 'shim'}"] + [f"-I{p}" for p in include_paths()]),
        pyinc=sysconfig.get_paths()["include"],
        abi=int(torch._C._GLIBCXX_USE_CXX11_ABI),
        nvcc_common=tuple(COMMON_NVCC_FLAGS),
    )
    rows, jobs_list = {}, []
    for t in tasks:
        row = Row(t.key, "cuda compile-only")
        rows[t.key] = row
        jobs_list += _task_jobs(t, row, root, flags)
    t0 = time.time()
    with cf.ThreadPoolExecutor(max(1, jobs)) as ex:
        for label, ok, dt, log in ex.map(_compile_one, jobs_list):
            key, tool, _ = label.split("|")
            row = rows[key]
            row.secs += dt
            row.notes.append(f"{tool} {dt:.0f}s")
            row.cases += 1
            if ok:
                row.passed += 1
            else:
                row.fail(f"{tool} failed: {log}")
                print(f"----- {label} -----\n{log}\n")
    print(f"[compile-only] {len(jobs_list)} compiles in {time.time() - t0:.0f}s wall")
    for r in rows.values():
        if shimmed:
            r.notes.append("shim:" + ",".join(Path(h).name for h in shimmed))
    return list(rows.values())


def _task_jobs(t: Task, row: Row, root: Path, flags: _Flags) -> list[tuple[list[str], str, str]]:
    """One task's solution checked statically (the verifier's scans) and its compiles planned:
    (command, directory, "task|tool|extension") for nvcc and for g++ per load_inline call."""
    path = t.sol_path("cuda")
    if not path.exists():
        row.fail("no solution file")
        return []
    try:
        calls, sol = extract_sources(path)
    except Exception as e:  # noqa: BLE001 - a check tool: any failure is this row's verdict
        row.fail(f"import failed: {type(e).__name__}: {e}")
        return []
    for issue in static_forward_issues(sol):
        row.fail(f"static: {issue}")
    if not hasattr(sol, "ModelNew"):
        row.fail("no ModelNew")
    if not calls:
        row.fail("no load_inline call")
    out = []
    for i, c in enumerate(calls):
        if not c["cuda"]:
            row.fail(f"{c['name']}: no cuda_sources")
            continue
        src = "\n".join(c["cpp"] + c["cuda"])
        if "__global__" not in src:
            row.fail(f"{c['name']}: no __global__ kernel")
        if "getCurrentCUDAStream" not in src:
            row.notes.append("WARN not launched on the current stream")
        for issue in static_native_issues(src):
            row.fail(f"static: {issue}")
        d = root / f"{t.level}_{t.stem}_{i}"
        d.mkdir(parents=True, exist_ok=True)
        nvcc_cmd, gxx_cmd = _unit_commands(c, d, flags)
        out.append((nvcc_cmd, str(d), f"{t.key}|nvcc|{c['name']}"))
        out.append((gxx_cmd, str(d), f"{t.key}|g++|{c['name']}"))
    return out


def _unit_commands(c: dict, d: Path, flags: _Flags) -> tuple[list[str], list[str]]:
    """Write one load_inline call's binding TU (main.cpp) and CUDA TU (cuda.cu) into `d`; return the
    nvcc command that compiles the CUDA TU and the g++ command that syntax-checks the binding."""
    cpp = ["#include <torch/extension.h>"] + c["cpp"]
    funcs = c["functions"] or []
    if isinstance(funcs, str):
        funcs = [funcs]
    cpp.append("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
    for f in funcs:
        cpp.append(f'm.def("{f}", torch::wrap_pybind_function({f}), "{f}");')
    cpp.append("}")
    (d / "main.cpp").write_text("\n".join(cpp))
    cu = ["#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>"] + c["cuda"]
    (d / "cuda.cu").write_text("\n".join(cu))
    extra_cuda = list(c["kwargs"].get("extra_cuda_cflags") or [])
    nvcc_cmd = [
        "nvcc",
        f"-std={flags.std}",
        "-c",
        f"-arch={flags.arch}",
        *flags.incs,
        f"-D_GLIBCXX_USE_CXX11_ABI={flags.abi}",
        *flags.nvcc_common,
        "-Xcompiler",
        "-fPIC",
        "-diag-suppress",
        "3306",
        *extra_cuda,
        "cuda.cu",
        "-o",
        "cuda.o",
    ]
    gxx_cmd = [
        "g++",
        f"-std={flags.std}",
        "-fsyntax-only",
        "-fPIC",
        *flags.incs,
        f"-I{flags.pyinc}",
        f"-D_GLIBCXX_USE_CXX11_ABI={flags.abi}",
        f"-DTORCH_EXTENSION_NAME={c['name']}",
        "-Wno-c++20-extensions",
        "main.cpp",
    ]
    return nvcc_cmd, gxx_cmd
