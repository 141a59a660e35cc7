"""Find and load KernelBench-format reference files (Kiln's own tasks/ or a KernelBench checkout).

A reference file is recognised without running it: a module that defines `class Model`,
`get_inputs()` and `get_init_inputs()`. Paths may name one file, a level directory
(`KernelBench/level1`) or a tree of them (`tasks/`); `solutions/` trees are skipped.

`scan` also lists the broken task files, each with its reason, instead of skipping them silently: a
file that does not parse or is not UTF-8 text (in a level directory, or mentioning `get_inputs` or
`class Model`), and a module that defines some but not all of the three names (or, in a level
directory, none). Other files (helpers beside the tasks) are not tasks. `probe_reference` runs a
reference's `get_init_inputs()` and `get_inputs()` once and says what raised.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from protocols import KernelSpec, Task
from protocols.pyparse import parse_python

SHIPPED = Path(__file__).resolve().parent
_LEVEL = re.compile(r"level[_-]?(\d+)$", re.IGNORECASE)


REFERENCE_NAMES = ("Model", "get_inputs", "get_init_inputs")


class TaskLoadError(ValueError):
    """A task path does not exist or holds no reference file."""


@dataclass(frozen=True)
class BrokenTask:
    path: Path
    reason: str  # one line: why it is not a usable reference


@dataclass(frozen=True)
class TaskFile:
    path: Path
    task_id: str  # "level1/01_relu": stable across machines and checkouts
    name: str
    level: int


def is_reference(path: Path) -> bool:
    """True when the file parses and defines Model, get_inputs and get_init_inputs at top level."""
    return reference_problem(path) == ("", True)


def reference_problem(path: Path) -> tuple[str, bool]:
    """(why `path` is not a reference, "" when it is one; whether it looks like a task at all)."""
    in_level = _level_of(path.resolve()) > 0
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 text (byte {err.start})", in_level
    except OSError as err:
        return f"cannot be read: {err.strerror}", in_level
    looks_like_task = in_level or "get_inputs" in text or "class Model" in text
    try:
        tree = parse_python(text, str(path))
    except SyntaxError as err:
        return f"does not parse: {err.msg} (line {err.lineno})", looks_like_task
    except ValueError as err:  # null bytes
        return f"does not parse: {err}", looks_like_task
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    missing = [n for n in REFERENCE_NAMES if n not in names]
    if not missing:
        return "", True
    defined_some = len(missing) < len(REFERENCE_NAMES)
    listed = ", ".join(f"{n}()" if n != "Model" else "class Model" for n in missing)
    return f"defines no {listed} at module level", defined_some or in_level


def _level_of(path: Path) -> int:
    for parent in path.parents:
        m = _LEVEL.match(parent.name)
        if m:
            return int(m.group(1))
    return 0


def discover(path: str | Path) -> list[TaskFile]:
    """Every reference file under `path` (or `path` itself), sorted by level then name."""
    found, _broken = scan(path)
    if not found:
        raise TaskLoadError(f"no KernelBench-format reference file (Model, get_inputs, get_init_inputs) in {path}")
    return found


def scan(path: str | Path) -> tuple[list[TaskFile], list[BrokenTask]]:
    """The reference files under `path` (sorted by level then name) and the broken task files."""
    root = Path(path)
    if not root.exists():
        raise TaskLoadError(f"task path not found: {root}")
    if root.is_file():
        files = [root]
    else:
        files = sorted(p for p in root.rglob("*.py") if "solutions" not in p.relative_to(root).parts)
    found, broken = [], []
    for f in files:
        if f.name.startswith("_"):
            continue
        problem, task_like = reference_problem(f)
        if problem:
            if task_like or f == root:
                broken.append(BrokenTask(path=f, reason=problem))
            continue
        level = _level_of(f.resolve())
        found.append(TaskFile(path=f, task_id=f"level{level}/{f.stem}", name=f.stem, level=level))
    return sorted(found, key=lambda t: (t.level, t.name)), broken


def probe_reference(source: str, filename: str, backend: str) -> str:
    """Run a reference's get_init_inputs() and get_inputs() once (with KILN_CPU_SHAPES applied on cpu,
    as the verifier does); "" when both return, else one line naming what raised. Runs the
    reference's code in this process, as the verifier's trusted side does."""
    import types

    module = types.ModuleType("kiln_reference_probe")
    module.__file__ = filename
    try:
        # by design: the task's reference is imported to probe it
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102
    except Exception as err:  # noqa: BLE001 - whatever the reference raises is the one-line reason it is refused
        return f"importing it raised {type(err).__name__}: {_one_line(err)}"
    if backend == "cpu":
        for name, value in (getattr(module, "KILN_CPU_SHAPES", None) or {}).items():
            setattr(module, name, value)
    for name in ("get_init_inputs", "get_inputs"):
        try:
            getattr(module, name)()
        except Exception as err:  # noqa: BLE001 - whatever the reference raises is the one-line reason it is refused
            return f"{name}() raised {type(err).__name__}: {_one_line(err)}"
    return ""


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def to_task(tf: TaskFile, backend: str, split: str = "train") -> Task:
    spec = KernelSpec(
        name=tf.name,
        reference=tf.path.read_text(encoding="utf-8"),
        backend=backend,
        level=tf.level,
        source_path=str(tf.path),
    )
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
