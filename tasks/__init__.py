"""Kiln's shipped task set (KernelBench format; see tasks/README.md) and the loader for task paths."""

from tasks.loader import SHIPPED, TaskFile, TaskLoadError, discover, load_tasks, solution_for, to_task

__all__ = ["SHIPPED", "TaskFile", "TaskLoadError", "discover", "load_tasks", "solution_for", "to_task"]
