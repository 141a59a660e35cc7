"""Shared pieces of the task-set maintainer tools: task discovery, result rows, the legality
recorder and static checks, and the result table (used by check_solutions.py and check_cuda_compile.py)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
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
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "zeros",
    "zeros_like",
    "new_zeros",
    "zero_",
    "fill_",
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "permute",
    "transpose",
    "t",
    "contiguous",
    "clone",
    "expand",
    "copy_",
    "detach",
    "alias",
    "as_strided",
    "resize_",
    "squeeze",
    "unsqueeze",
    "flatten",
    "lift_fresh",
    "_to_copy",
    "to",
}

# Static C++/CUDA scan: ATen/torch calls that are allowed from native code.
ALLOWED_NATIVE_NAMES = {
    "torch::Tensor",
    "at::Tensor",
    "torch::empty",
    "torch::empty_like",
    "torch::zeros",
    "torch::zeros_like",
    "at::empty",
    "at::empty_like",
    "at::zeros",
    "at::zeros_like",
    "torch::kFloat32",
    "torch::kFloat",
    "at::kFloat",
    "torch::TensorOptions",
    "at::cuda::getCurrentCUDAStream",
    "torch::IntArrayRef",
    "at::IntArrayRef",
}
FORBIDDEN_METHOD_RE = re.compile(
    r"\.(add|sub|mul|div|matmul|mm|bmm|addmm|baddbmm|sum|mean|amax|amin|max|min|exp|log|relu|"
    r"softmax|log_softmax|pow|sqrt|rsqrt|clamp|tanh|sigmoid|neg|abs|conv\w*|linear|layer_norm|gelu|"
    r"silu|cat|stack|index_select|gather|scatter|masked_fill|where|cumsum|prod|norm|var|std)_?\s*\("
)
# Python names allowed inside ModelNew.forward (static scan).
ALLOWED_FORWARD_ATTRS = {
    "view",
    "reshape",
    "permute",
    "transpose",
    "contiguous",
    "size",
    "dim",
    "numel",
    "stride",
    "expand",
    "flatten",
    "unsqueeze",
    "squeeze",
    "is_contiguous",
    "shape",
    "device",
    "dtype",
    "new_empty",
    "empty",
    "empty_like",
    "zeros",
    "zeros_like",
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
                        if isinstance(sub, ast.BinOp) and isinstance(sub.op, (ast.MatMult,)):
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
        lines.append(
            (
                r.task,
                r.what,
                "PASS" if r.ok else "FAIL",
                f"{r.passed}/{r.cases}" if r.cases else "-",
                f"{r.max_err:.2e}" if r.cases and r.what.endswith("solution") else "-",
                f"{r.secs:.1f}",
                "; ".join(r.notes)[:160],
            )
        )
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
