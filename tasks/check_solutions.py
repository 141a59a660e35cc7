#!/usr/bin/env python
"""Maintainer tool: validate the shipped Kiln task set (references and reference solutions).

Modes
  --refs-only                      check every reference module (CPU sizes + alt shapes; add
                                   --full-size to also run the default CUDA sizes on the CPU)
  --backend cpu                    build every cpu solution, compare with the reference on the CPU
                                   sizes and every alt shape, several seeds, with an ATen-dispatch
                                   recorder that fails on any non-plumbing op inside ModelNew.forward
  --backend cuda --compile-only    no GPU needed: extract the load_inline sources of every cuda
                                   solution and compile them (nvcc for cuda_sources, g++ syntax check
                                   for cpp_sources); missing toolkit headers are shimmed and reported
  --backend cuda                   on a GPU machine: build, run on the GPU (default sizes + alt shapes),
                                   compare with the reference (TF32 off), same legality recorder
Common options: --only SUBSTR (filter on "levelK/NN_name"), --seeds N, --jobs N (parallel builds).

Builds go to $TORCH_EXTENSIONS_DIR (default /tmp/kiln-task-builds) so re-runs reuse them.
Exit status is 0 only if every selected check passed.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/kiln-task-builds")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parent
LEVELS = ("level1", "level2", "level3", "level4")

# Tolerance (atol = rtol) per level, with per-task overrides.
TOLERANCE = {"level1": 1e-4, "level2": 1e-4, "level3": 1e-3, "level4": 1e-3}
TOLERANCE_OVERRIDES = {"level2/01_sum_dim": 1e-3}

# ATen ops that are tensor plumbing (allocation, views, copies); everything else is compute.
ALLOWED_OPS = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "zeros", "zeros_like", "new_zeros", "zero_", "fill_",
    "view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "transpose", "t",
    "contiguous", "clone", "expand", "copy_", "detach", "alias", "as_strided",
    "resize_", "squeeze", "unsqueeze", "flatten", "lift_fresh", "_to_copy", "to",
}

# Static C++/CUDA scan: ATen/torch calls that are allowed from native code.
ALLOWED_NATIVE_NAMES = {
    "torch::Tensor", "at::Tensor", "torch::empty", "torch::empty_like", "torch::zeros",
    "torch::zeros_like", "at::empty", "at::empty_like", "at::zeros", "at::zeros_like",
    "torch::kFloat32", "torch::kFloat", "at::kFloat", "torch::TensorOptions",
    "at::cuda::getCurrentCUDAStream", "torch::IntArrayRef", "at::IntArrayRef",
}
FORBIDDEN_METHOD_RE = re.compile(
    r"\.(add|sub|mul|div|matmul|mm|bmm|addmm|baddbmm|sum|mean|amax|amin|max|min|exp|log|relu|"
    r"softmax|log_softmax|pow|sqrt|rsqrt|clamp|tanh|sigmoid|neg|abs|conv\w*|linear|layer_norm|gelu|"
    r"silu|cat|stack|index_select|gather|scatter|masked_fill|where|cumsum|prod|norm|var|std)_?\s*\("
)
# Python names allowed inside ModelNew.forward (static scan).
ALLOWED_FORWARD_ATTRS = {
    "view", "reshape", "permute", "transpose", "contiguous", "size", "dim", "numel", "stride",
    "expand", "flatten", "unsqueeze", "squeeze", "is_contiguous", "shape", "device", "dtype",
    "new_empty", "empty", "empty_like", "zeros", "zeros_like",
}


# --------------------------------------------------------------------------- discovery / loading
@dataclass
class Task:
    level: str
    stem: str

    @property
    def key(self) -> str:
        return f"{self.level}/{self.stem}"

    @property
    def ref_path(self) -> Path:
        return TASKS_DIR / self.level / f"{self.stem}.py"

    def sol_path(self, backend: str) -> Path:
        return TASKS_DIR / "solutions" / backend / self.level / f"{self.stem}.py"

    @property
    def tol(self) -> float:
        return TOLERANCE_OVERRIDES.get(self.key, TOLERANCE[self.level])


def discover(only: str | None) -> list[Task]:
    tasks = []
    for level in LEVELS:
        for p in sorted((TASKS_DIR / level).glob("[0-9][0-9]_*.py")):
            t = Task(level, p.stem)
            if only is None or only in t.key:
                tasks.append(t)
    return tasks


def load_module(path: Path, tag: str):
    name = "kiln_" + tag + "_" + re.sub(r"\W", "_", str(path.relative_to(TASKS_DIR)))[:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Shapes:
    """Applies KILN_CPU_SHAPES / KILN_ALT_SHAPES overrides to a reference module, restorably."""

    def __init__(self, mod):
        self.mod = mod
        self.cpu = dict(getattr(mod, "KILN_CPU_SHAPES", {}))
        self.alts = [dict(a) for a in getattr(mod, "KILN_ALT_SHAPES", [])]
        keys = set(self.cpu)
        for a in self.alts:
            keys |= set(a)
        missing = [k for k in keys if not hasattr(mod, k)]
        if missing:
            raise ValueError(f"KILN_* overrides name unknown constants: {missing}")
        self.defaults = {k: getattr(mod, k) for k in keys}

    def apply(self, *layers: dict) -> dict:
        for k, v in self.defaults.items():
            setattr(self.mod, k, v)
        eff = {}
        for layer in layers:
            for k, v in layer.items():
                setattr(self.mod, k, v)
                eff[k] = v
        return eff

    def configs(self, backend: str) -> list[tuple[str, list[dict]]]:
        base = [self.cpu] if backend == "cpu" else []
        out = [("base", base)]
        for i, a in enumerate(self.alts):
            out.append((f"alt{i}", base + [a]))
        return out


def tensors_to(xs, device):
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


# --------------------------------------------------------------------------- legality recorder
class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def static_forward_issues(sol_mod) -> list[str]:
    """Flags torch/F/nn calls and tensor-math methods inside ModelNew.forward (source scan)."""
    issues = []
    try:
        src = Path(sol_mod.__file__).read_text()
        tree = ast.parse(src)
    except Exception as e:  # pragma: no cover
        return [f"cannot parse solution: {e}"]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ModelNew":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                    for sub in ast.walk(fn):
                        if isinstance(sub, ast.BinOp) and isinstance(
                            sub.op, (ast.MatMult,)
                        ):
                            issues.append("matmul operator in forward")
                        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                            base = sub.func.value
                            if isinstance(base, ast.Name) and base.id in ("torch", "F", "nn"):
                                if sub.func.attr not in ALLOWED_FORWARD_ATTRS:
                                    issues.append(f"{base.id}.{sub.func.attr}() in forward")
    if "import" in src and re.search(r"^\s*(from|import)\s+.*level\d", src, re.M):
        issues.append("solution imports a reference module")
    return issues


def strip_cpp_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def static_native_issues(sources: str) -> list[str]:
    issues = []
    sources = strip_cpp_comments(sources)
    for m in re.finditer(r"\b(?:torch|at)::[A-Za-z_:]+", sources):
        name = m.group(0)
        if name not in ALLOWED_NATIVE_NAMES and not name.startswith(("at::cuda::getCurrent",)):
            issues.append(f"native call {name}")
    for m in FORBIDDEN_METHOD_RE.finditer(sources):
        issues.append(f"tensor method .{m.group(1)}(")
    return sorted(set(issues))


# --------------------------------------------------------------------------- result table
@dataclass
class Row:
    task: str
    what: str
    ok: bool = True
    cases: int = 0
    passed: int = 0
    max_err: float = 0.0
    secs: float = 0.0
    notes: list[str] = field(default_factory=list)

    def fail(self, msg: str):
        self.ok = False
        self.notes.append(msg)


def print_table(rows: list[Row]):
    hdr = ("task", "check", "status", "cases", "max_abs_err", "time_s", "notes")
    lines = []
    for r in rows:
        lines.append((
            r.task, r.what, "PASS" if r.ok else "FAIL", f"{r.passed}/{r.cases}" if r.cases else "-",
            f"{r.max_err:.2e}" if r.cases and r.what.endswith("solution") else "-", f"{r.secs:.1f}", "; ".join(r.notes)[:160],
        ))
    w = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(hdr)]
    fmt = "  ".join("{:<%d}" % x for x in w[:-1]) + "  {}"
    print()
    print(fmt.format(*hdr))
    print(fmt.format(*("-" * x for x in w)))
    for l in lines:
        print(fmt.format(*l))
    npass = sum(r.ok for r in rows)
    print(f"\n{npass}/{len(rows)} checks passed")


# --------------------------------------------------------------------------- reference checks
def check_reference(task: Task, full_size: bool) -> Row:
    row = Row(task.key, "reference")
    t0 = time.time()
    try:
        mod = load_module(task.ref_path, "ref")
        doc = (mod.__doc__ or "").strip()
        if not doc:
            row.fail("no module docstring")
        for attr in ("Model", "get_inputs", "get_init_inputs", "KILN_CPU_SHAPES", "KILN_ALT_SHAPES"):
            if not hasattr(mod, attr):
                row.fail(f"missing {attr}")
        sh = Shapes(mod)
        if not sh.alts:
            row.notes.append("no alt shapes")
        configs = [(f"cpu-{lbl}", layers) for lbl, layers in sh.configs("cpu")]
        if full_size:
            configs.insert(0, ("cuda-base", []))
        for label, layers in configs:
            row.cases += 1
            sh.apply(*layers)
            torch.manual_seed(0)
            model = mod.Model(*mod.get_init_inputs())
            inputs = mod.get_inputs()
            if any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in inputs):
                row.fail(f"{label}: get_inputs must return CPU tensors")
            with torch.no_grad():
                out = model(*inputs)  # warm-up (lazy initialisation inside torch)
                dt = float("inf")
                for _ in range(3):
                    t1 = time.perf_counter()
                    out = model(*inputs)
                    dt = min(dt, time.perf_counter() - t1)
            outs = out if isinstance(out, (tuple, list)) else [out]
            finite = all(torch.isfinite(o).all().item() for o in outs)
            nbytes = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
            if not finite:
                row.fail(f"{label}: non-finite output")
            else:
                row.passed += 1
            row.notes.append(f"{label}:{tuple(outs[0].shape)} {dt*1e3:.0f}ms in={nbytes/2**20:.1f}MiB")
        sh.apply()
    except Exception as e:
        row.fail(f"error: {type(e).__name__}: {e}")
        traceback.print_exc()
    row.secs = time.time() - t0
    return row


# --------------------------------------------------------------------------- solution runs
def _prebuild(path_str: str) -> tuple[str, float, str | None]:
    t0 = time.time()
    try:
        load_module(Path(path_str), "prebuild")
        return path_str, time.time() - t0, None
    except Exception as e:  # noqa: BLE001
        return path_str, time.time() - t0, f"{type(e).__name__}: {str(e)[-2000:]}"


def prebuild(paths: list[Path], jobs: int) -> dict[str, tuple[float, str | None]]:
    res = {}
    if jobs <= 1:
        for p in paths:
            _, dt, err = _prebuild(str(p))
            res[str(p)] = (dt, err)
        return res
    import multiprocessing as mp
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        for p, dt, err in ex.map(_prebuild, [str(p) for p in paths]):
            res[p] = (dt, err)
    return res


def _storages(ts):
    out = set()
    for t in ts:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            out.add(t.untyped_storage().data_ptr())
    return out


def run_solution(task: Task, backend: str, seeds: int, build_info) -> Row:
    row = Row(task.key, f"{backend} solution")
    path = task.sol_path(backend)
    if not path.exists():
        row.fail("no solution file")
        return row
    device = "cuda" if backend == "cuda" else "cpu"
    t0 = time.time()
    try:
        ref = load_module(task.ref_path, "ref")
        t1 = time.time()
        sol = load_module(path, backend)
        load_s = time.time() - t1
        pre = build_info.get(str(path))
        if pre:
            row.notes.append(f"build {pre[0]:.1f}s")
        else:
            row.notes.append(f"import+build {load_s:.1f}s")
        for issue in static_forward_issues(sol):
            row.fail(f"static: {issue}")
        calls, _ = extract_sources(path)  # re-import with load_inline recorded, for the static scan
        for c in calls:
            native = "\n".join(c["cpp"] + c["cuda"])
            for issue in static_native_issues(native):
                row.fail(f"static: {issue}")
            if backend == "cpu" and c["cuda"]:
                row.fail(f"{c['name']}: cpu solution has cuda_sources")
            if backend == "cuda" and "__global__" not in native:
                row.fail(f"{c['name']}: no __global__ kernel")
        sh = Shapes(ref)
        seen_ops: dict[str, int] = {}
        init_mismatch = False
        fwd_ms = 0.0
        for label, layers in sh.configs(backend):
            for s in range(seeds):
                seed = 1000 * s + 17
                sh.apply(*layers)
                init = ref.get_init_inputs()
                torch.manual_seed(seed)
                model = ref.Model(*init).to(device)
                torch.manual_seed(seed)
                new = sol.ModelNew(*init).to(device)
                sd = model.state_dict()
                if sd:
                    nsd = new.state_dict()
                    if set(nsd) != set(sd) or any(nsd[k].shape != sd[k].shape for k in sd):
                        row.fail(f"{label}: ModelNew state_dict names/shapes differ from Model")
                        continue
                    if any(not torch.equal(nsd[k], sd[k]) for k in sd):
                        init_mismatch = True
                    new.load_state_dict(sd, strict=True)
                params = list(new.parameters()) + list(new.buffers())
                for rep in range(2):  # two input sets through one instance: catches result caching
                    torch.manual_seed(seed + 7919 * (rep + 1))
                    inputs = tensors_to(ref.get_inputs(), device)
                    saved = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
                    with torch.no_grad():
                        expected = model(*inputs)
                    rec = OpRecorder()
                    t1 = time.perf_counter()
                    with torch.no_grad(), rec:
                        got = new(*inputs)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if label == "base" and rep == 1:
                        fwd_ms = max(fwd_ms, (time.perf_counter() - t1) * 1e3)
                    for k, v in rec.ops.items():
                        seen_ops[k] = seen_ops.get(k, 0) + v
                    row.cases += 1
                    case = f"{label}/seed{s}/in{rep}"
                    bad = [k for k in rec.ops if k not in ALLOWED_OPS]
                    if bad:
                        row.fail(f"{case}: compute ops in forward: {bad}")
                        continue
                    if any(isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(inputs, saved)):
                        row.fail(f"{case}: an input was mutated")
                        continue
                    if not isinstance(got, torch.Tensor):
                        row.fail(f"{case}: output is {type(got).__name__}, not a tensor")
                        continue
                    if _storages([got]) & _storages(list(inputs) + params):
                        row.fail(f"{case}: output aliases an input or parameter")
                        continue
                    if got.shape != expected.shape or got.dtype != expected.dtype:
                        row.fail(f"{case}: got {tuple(got.shape)}/{got.dtype}, want {tuple(expected.shape)}/{expected.dtype}")
                        continue
                    if not torch.isfinite(got).all():
                        row.fail(f"{case}: non-finite values")
                        continue
                    err = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
                    row.max_err = max(row.max_err, err)
                    if not torch.allclose(got, expected, atol=task.tol, rtol=task.tol):
                        row.fail(f"{case}: mismatch max_abs_err={err:.3e} (tol {task.tol})")
                        continue
                    row.passed += 1
        sh.apply()
        if init_mismatch:
            row.notes.append("WARN ModelNew init differs from Model under the same seed")
        row.notes.append(f"base fwd {fwd_ms:.1f}ms")
        row.notes.append("ops=" + ",".join(f"{k}x{v}" for k, v in sorted(seen_ops.items())))
    except Exception as e:
        row.fail(f"error: {type(e).__name__}: {str(e)[-600:]}")
        traceback.print_exc()
    row.secs = time.time() - t0
    return row


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
        calls.append(dict(name=name, cpp=as_list(cpp_sources), cuda=as_list(cuda_sources),
                          functions=functions, kwargs=kwargs))
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
                  "inline const char* cusparseGetErrorString(cusparseStatus_t) { return \"\"; }\n",
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
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    out = (p.stdout + p.stderr)
    Path(cwd, label.split("|")[1].replace("+", "x") + ".log").write_text(" ".join(cmd) + "\n\n" + out)
    errs = "\n".join(l for l in out.splitlines() if "error" in l.lower())
    return label, p.returncode == 0, time.time() - t0, (errs or out)[-3000:]


def compile_only_cuda(tasks: list[Task], jobs: int, std: str, arch: str) -> list[Row]:
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "compile_only"
    root.mkdir(parents=True, exist_ok=True)
    shimmed = make_shim(root)
    if shimmed:
        print(f"[compile-only] shimmed missing headers: {shimmed}")
    incs = [f"-I{root / 'shim'}"] + [f"-I{p}" for p in include_paths()]
    pyinc = sysconfig.get_paths()["include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    rows, jobs_list = {}, []
    for t in tasks:
        row = Row(t.key, "cuda compile-only")
        rows[t.key] = row
        path = t.sol_path("cuda")
        if not path.exists():
            row.fail("no solution file")
            continue
        try:
            calls, sol = extract_sources(path)
        except Exception as e:
            row.fail(f"import failed: {type(e).__name__}: {e}")
            continue
        for issue in static_forward_issues(sol):
            row.fail(f"static: {issue}")
        if not hasattr(sol, "ModelNew"):
            row.fail("no ModelNew")
        if not calls:
            row.fail("no load_inline call")
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
            extra_cuda = list((c["kwargs"].get("extra_cuda_cflags") or []))
            nvcc_cmd = (["nvcc", f"-std={std}", "-c", f"-arch={arch}", *incs, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                         *COMMON_NVCC_FLAGS, "-Xcompiler", "-fPIC", "-diag-suppress", "3306",
                         *extra_cuda, "cuda.cu", "-o", "cuda.o"])
            gxx_cmd = (["g++", f"-std={std}", "-fsyntax-only", "-fPIC", *incs, f"-I{pyinc}",
                        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={c['name']}",
                        "-Wno-c++20-extensions", "main.cpp"])
            jobs_list.append((nvcc_cmd, str(d), f"{t.key}|nvcc|{c['name']}"))
            jobs_list.append((gxx_cmd, str(d), f"{t.key}|g++|{c['name']}"))
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


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--only", default=None, help="substring filter on 'levelK/NN_name'")
    ap.add_argument("--refs-only", action="store_true", help="only check the reference modules")
    ap.add_argument("--no-refs", action="store_true", help="skip the reference checks")
    ap.add_argument("--full-size", action="store_true", help="also run references at the default (CUDA) sizes on CPU")
    ap.add_argument("--compile-only", action="store_true", help="cuda: compile the extracted sources, do not run")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="parallel builds")
    ap.add_argument("--std", default="c++20", help="C++ standard for --compile-only (torch 2.13 builds with c++20)")
    ap.add_argument("--arch", default="sm_90", help="nvcc -arch for --compile-only")
    args = ap.parse_args(argv)

    tasks = discover(args.only)
    if not tasks:
        print("no tasks selected")
        return 1
    rows: list[Row] = []
    if not args.no_refs:
        for t in tasks:
            rows.append(check_reference(t, args.full_size))
            print(f"[ref] {t.key}: {'ok' if rows[-1].ok else 'FAIL'} {'; '.join(rows[-1].notes)}", flush=True)
    if not args.refs_only:
        if args.backend == "cuda" and args.compile_only:
            rows += compile_only_cuda(tasks, args.jobs, args.std, args.arch)
        else:
            if args.backend == "cuda":
                if not torch.cuda.is_available():
                    print("--backend cuda needs a GPU (use --compile-only here)")
                    return 2
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            paths = [t.sol_path(args.backend) for t in tasks if t.sol_path(args.backend).exists()]
            t0 = time.time()
            info = prebuild(paths, args.jobs)
            print(f"[build] {len(paths)} extensions ready in {time.time() - t0:.0f}s wall", flush=True)
            for p, (dt, err) in info.items():
                if err:
                    print(f"[build] FAILED {p}:\n{err}\n")
            for t in tasks:
                rows.append(run_solution(t, args.backend, args.seeds, info))
                print(f"[{args.backend}] {t.key}: {'ok' if rows[-1].ok else 'FAIL'}", flush=True)
    print_table(rows)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
