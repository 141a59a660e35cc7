"""Where an evaluation's tasks come from: Kiln's tasks/, any directory of KernelBench-format files,
or a KernelBench repository clone given by its root (its tasks live in `KernelBench/levelN/`).

Nothing is downloaded: the user points at files on disk. Every file that looks like a task but
cannot be used is listed with its reason (`FailedLoad`), and so is a task id that two directories
both provide (the first one given is kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocols import Task
from tasks.loader import TaskLoadError, scan, to_task


@dataclass(frozen=True)
class FailedLoad:
    path: str
    reason: str


@dataclass(frozen=True)
class TaskSet:
    tasks: list[Task]  # sorted by level, then task id
    failed: list[FailedLoad]
    roots: list[str]  # the directories actually scanned (a clone's root resolves to its KernelBench/)


def task_root(path: Path) -> Path:
    """The directory to scan: a KernelBench clone's root holds its tasks under KernelBench/levelN/
    (beside scripts and sources that mention get_inputs and are not tasks)."""
    inner = path / "KernelBench"
    if path.is_dir() and inner.is_dir() and any(inner.glob("level*")):
        return inner
    return path


def load_task_set(paths: list[str], backend: str) -> TaskSet:
    """The tasks of every path; TaskLoadError when a path does not exist or none holds a task."""
    tasks: dict[str, Task] = {}
    failed: list[FailedLoad] = []
    roots = []
    for given in paths:
        root = task_root(Path(given))
        roots.append(str(root))
        found, broken = scan(root)  # raises TaskLoadError for a missing path
        failed += [FailedLoad(path=str(b.path), reason=b.reason) for b in broken]
        for tf in found:
            if tf.task_id in tasks:
                first = tasks[tf.task_id].kernel.source_path
                failed.append(FailedLoad(path=str(tf.path), reason=f"task id {tf.task_id} already loaded from {first}"))
                continue
            try:
                tasks[tf.task_id] = to_task(tf, backend, split="val")
            except (OSError, UnicodeDecodeError) as err:
                failed.append(FailedLoad(path=str(tf.path), reason=f"cannot be read: {err}"))
    if not tasks:
        raise TaskLoadError(
            f"no KernelBench-format reference file (Model, get_inputs, get_init_inputs) in {' '.join(paths)}"
        )
    ordered = sorted(tasks.values(), key=lambda t: (t.kernel.level, t.task_id))
    return TaskSet(tasks=ordered, failed=failed, roots=roots)
