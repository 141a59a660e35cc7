"""Shared pieces of the task-set maintainer tools: task discovery, result rows, the result table, and
the verifier's own rules of correct and legal as the tools apply them (used by check_solutions.py and
check_cuda_compile.py): its output comparison and tolerance, its allowlist of ATen ops, its static
scans. The tools keep no tables of their own, so a shipped solution passes them exactly when it
passes the verifier's rules.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/kiln-task-builds")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TASKS_DIR = Path(__file__).resolve().parent
LEVELS = ("level1", "level2", "level3", "level4")

# The verifier's own rules judge the shipped solutions (one definition of correct and legal): its
# comparison (scale-relative tolerance by dtype, or the task's KILN_TOLERANCE), its allowlist of ATen
# ops and its static scans of Python and C++/CUDA sources. Run as a script from tasks/, the
# repository root is not on the path yet.
if str(TASKS_DIR.parent) not in sys.path:
    sys.path.insert(0, str(TASKS_DIR.parent))

from actors.verifier import compare, legality


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


# --------------------------------------------------------------------------- legality and correctness
class OpRecorder(TorchDispatchMode):
    """Counts the ATen ops a forward call dispatches (by overload packet name)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def compute_ops(ops: dict[str, int]) -> list[str]:
    """The recorded ops the verifier's compute fence would refuse (outside `legality.ALLOWED_OPS`)."""
    return sorted(k for k in ops if k not in legality.ALLOWED_OPS)


def compare_with_reference(got, expected, ref_module) -> compare.Comparison:
    """The verifier's comparison of a solution's outputs with the reference's, under the task's
    declared tolerance (KILN_TOLERANCE) or the verifier's tolerance by dtype."""
    got_list = list(got) if isinstance(got, (tuple, list)) else [got]
    expected_list = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    return compare.compare_outputs(got_list, expected_list, compare.declared_tolerance(ref_module))


def static_forward_issues(sol_mod) -> list[str]:
    """The verifier's static scan of a solution's source (Python, and the C++/CUDA in its strings)."""
    try:
        src = Path(sol_mod.__file__).read_text()
        found, _ = legality.static_scan(src)
    except (OSError, SyntaxError) as e:  # pragma: no cover
        return [f"cannot parse solution: {e}"]
    return [v.describe() for v in found]


def static_native_issues(sources: str) -> list[str]:
    """The verifier's scan of C++/CUDA sources for ATen compute and dispatcher bypasses."""
    return sorted({v.describe() for v in legality.native_scan(sources)})


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
    w = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(hdr)]
    fmt = "  ".join(f"{{:<{x}}}" for x in w[:-1]) + "  {}"
    print()
    print(fmt.format(*hdr))
    print(fmt.format(*("-" * x for x in w)))
    for line in lines:
        print(fmt.format(*line))
    npass = sum(r.ok for r in rows)
    print(f"\n{npass}/{len(rows)} checks passed")


# --------------------------------------------------------------------------- reference checks
