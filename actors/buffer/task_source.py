"""Where the task feed's tasks come from, and the train/validation split.

A task source is any class with this signature (named by dotted path in `replay.task_source`):

    class MySource:
        def __init__(self, cfg: configs.ReplayConfig, backend: str, **args) -> None: ...  # args: replay.task_source_args
        def tasks(self) -> list[protocols.Task]: ...

The built-in source (`replay.task_source: null`) loads KernelBench-format reference files from
`replay.tasks` (Kiln's shipped tasks/, a KernelBench level directory or one file). Every problem with
a source (a bad dotted path, a constructor that raises, a result that is not a non-empty list of
valid Tasks with unique ids) is a `ConfigError` at start-up, never a crash mid-run.

The split is a pure function of (split_seed, task_id): adding a task never moves another task
between train and validation.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import protocols
from actors.base import load_plugin
from configs import ConfigError, ReplayConfig
from protocols import Task
from tasks.loader import SHIPPED, TaskLoadError, load_tasks


class TaskSource(Protocol):
    """The task-source interface (`replay.task_source`); plug-ins may subclass it."""

    def __init__(self, cfg: ReplayConfig, backend: str, **args) -> None: ...

    def tasks(self) -> list[Task]:
        """Every task of the run, train and validation alike (replay splits them)."""
        ...


class KernelTaskDirectory(TaskSource):
    """The built-in source: KernelBench-format references under `cfg.tasks`. A relative path is
    looked up from the working directory first, then from the Kiln checkout (so `tasks` names the
    shipped set wherever Ray starts the actor)."""

    def __init__(self, cfg: ReplayConfig, backend: str) -> None:
        self.path = resolve_task_path(cfg.tasks)
        self.backend = backend

    def tasks(self) -> list[Task]:
        return load_tasks(self.path, self.backend)


def resolve_task_path(path: str) -> Path:
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    in_checkout = SHIPPED.parent / p
    return in_checkout if in_checkout.exists() else p


@dataclass(frozen=True)
class TaskSet:
    """The tasks of a run, split once at start-up."""

    train: list[Task]
    val: list[Task]


def is_validation(task_id: str, split_seed: int, val_fraction: float) -> bool:
    """Deterministic split: a task is held out when the hash of (seed, id) falls below the fraction."""
    digest = hashlib.sha256(f"{split_seed}\x00{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def split_tasks(tasks: list[Task], split_seed: int, val_fraction: float) -> TaskSet:
    train, val = [], []
    for task in tasks:
        if is_validation(task.task_id, split_seed, val_fraction):
            val.append(dataclasses.replace(task, split="val"))
        else:
            train.append(dataclasses.replace(task, split="train"))
    if not train:
        raise ConfigError(f"replay.val_fraction={val_fraction} left no training task out of {len(tasks)}; lower it")
    return TaskSet(train=train, val=val)


def load_task_set(cfg: ReplayConfig, backend: str) -> TaskSet:
    """Build the configured source, check what it returns, and split it."""
    source = _build_source(cfg, backend)
    name = cfg.task_source or "replay.tasks"
    try:
        tasks = source.tasks()
    except TaskLoadError as err:
        raise ConfigError(f"replay.tasks={cfg.tasks!r}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a plug-in's failure becomes a ConfigError that names it
        raise ConfigError(f"task source {name}: tasks() raised {type(err).__name__}: {err}") from None
    _check_tasks(tasks, name)
    return split_tasks(tasks, cfg.split_seed, cfg.val_fraction)


def _build_source(cfg: ReplayConfig, backend: str):
    if cfg.task_source is None:
        return KernelTaskDirectory(cfg, backend)
    cls = load_plugin(cfg.task_source, TaskSource, key="replay.task_source")
    try:
        return cls(cfg, backend, **cfg.task_source_args)
    except Exception as err:  # noqa: BLE001 - a plug-in's failure becomes a ConfigError that names it
        raise ConfigError(
            f"replay.task_source={cfg.task_source!r}: constructing it raised {type(err).__name__}: {err} "
            "(signature: __init__(self, cfg: ReplayConfig, backend: str, **replay.task_source_args))"
        ) from None


def _check_tasks(tasks, name: str) -> None:
    if not isinstance(tasks, list) or not tasks:
        raise ConfigError(
            f"task source {name}: tasks() must return a non-empty list of protocols.Task, "
            f"got {type(tasks).__name__}{'' if tasks else ' (empty)'}"
        )
    seen: set[str] = set()
    for i, task in enumerate(tasks):
        if not isinstance(task, Task):
            raise ConfigError(f"task source {name}: item {i} is a {type(task).__name__}, not a protocols.Task")
        try:
            protocols.encode(task)  # the same validation every receiver applies
        except protocols.ProtocolError as err:
            raise ConfigError(f"task source {name}: task {i} is invalid: {err}") from None
        if task.repair is not None:
            raise ConfigError(
                f"task source {name}: task {task.task_id!r} carries a repair context; "
                "repair tasks come only from the retry buffer"
            )
        if task.task_id in seen:
            raise ConfigError(f"task source {name}: task id {task.task_id!r} appears twice")
        seen.add(task.task_id)
