"""Kiln's shipped task set (KernelBench format; see tasks/README.md) and the loader for task paths."""

from tasks.loader import (
    SHIPPED,
    BrokenTask,
    TaskFile,
    TaskLoadError,
    discover,
    load_tasks,
    probe_reference,
    scan,
    solution_for,
    to_task,
)

__all__ = [
    "SHIPPED",
    "BrokenTask",
    "TaskFile",
    "TaskLoadError",
    "discover",
    "load_tasks",
    "probe_reference",
    "scan",
    "solution_for",
    "to_task",
]
