"""Find and load KernelBench-format reference files (Kiln's own tasks/ or a KernelBench checkout).

A reference file is recognised without running it: a module that defines `class Model`,
`get_inputs()` and `get_init_inputs()`. Paths may name one file, a level directory
(`KernelBench/level1`) or a tree of them (`tasks/`); `solutions/` trees are skipped.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from protocols import KernelSpec, Task

SHIPPED = Path(__file__).resolve().parent
_LEVEL = re.compile(r"level[_-]?(\d+)$", re.IGNORECASE)


class TaskLoadError(ValueError):
    """A task path does not exist or holds no reference file."""


@dataclass(frozen=True)
class TaskFile:
    path: Path
    task_id: str  # "level1/01_relu": stable across machines and checkouts
    name: str
    level: int


def is_reference(path: Path) -> bool:
    """True when the file parses and defines Model, get_inputs and get_init_inputs at top level."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return False
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    return {"Model", "get_inputs", "get_init_inputs"} <= names


def _level_of(path: Path) -> int:
    for parent in path.parents:
        m = _LEVEL.match(parent.name)
        if m:
            return int(m.group(1))
    return 0


def discover(path: str | Path) -> list[TaskFile]:
    """Every reference file under `path` (or `path` itself), sorted by level then name."""
    root = Path(path)
    if not root.exists():
        raise TaskLoadError(f"task path not found: {root}")
    if root.is_file():
        files = [root]
    else:
        files = [p for p in root.rglob("*.py") if "solutions" not in p.relative_to(root).parts]
    found = []
    for f in files:
        if f.name.startswith("_") or not is_reference(f):
            continue
        level = _level_of(f.resolve())
        found.append(TaskFile(path=f, task_id=f"level{level}/{f.stem}", name=f.stem, level=level))
    if not found:
        raise TaskLoadError(f"no KernelBench-format reference file (Model, get_inputs, get_init_inputs) in {root}")
    return sorted(found, key=lambda t: (t.level, t.name))


def to_task(tf: TaskFile, backend: str, split: str = "train") -> Task:
    spec = KernelSpec(name=tf.name, reference=tf.path.read_text(encoding="utf-8"), backend=backend,
                      level=tf.level, source_path=str(tf.path))
    return Task(task_id=tf.task_id, kind="kernel", split=split, kernel=spec)


def load_tasks(path: str | Path, backend: str) -> list[Task]:
    return [to_task(tf, backend) for tf in discover(path)]


def solution_for(tf: TaskFile, solutions: str | Path) -> Path | None:
    """The solution file for a task: same file name, in `solutions/levelN/` or directly in `solutions/`."""
    root = Path(solutions)
    for candidate in (root / f"level{tf.level}" / tf.path.name, root / tf.path.name):
        if candidate.is_file():
            return candidate
    return None
