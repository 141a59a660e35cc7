"""Decontamination of the data stages: `kiln rft`, `kiln sft` and `kiln tasks synth` never train on (or
generate) an evaluation task, and count what they drop.

The evaluation tasks are:
* the validation split: the tasks of a task set (`--tasks`, default `replay.tasks`) that
  `replay.val_fraction` / `replay.split_seed` hold out (the same pure function of the task id replay
  uses, `actors.buffer.task_source.is_validation`, applied to the ids the task set holds), and
* every task under an `--exclude DIR` (a KernelBench clone, another held-out set).

How each stage matches:
* `kiln tasks synth` adds the validation split's files to its `--exclude` list (tasks/synth/decontam.py
  matches generated tasks against them by op structure and normalised source).
* `kiln rft` and `kiln tasks synth` run task files anyway, so a task is dropped when its id is a
  validation id of the task set, or when its Model has the op structure or the normalised source of
  an evaluation task (`tasks.synth.decontam`: torch.fx structure hash, normalised-source hash).
* `kiln sft` reads examples, whose reference code it must not run (a data file is not trusted code):
  an example is dropped when its `task_id` is a validation id, or when the reference its first user
  message shows has the normalised source of an evaluation task.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from actors.buffer.task_source import is_validation, resolve_task_path
from actors.policy.chat_data import ChatExample, reference_of
from configs import ReplayConfig
from tasks.loader import TaskFile, TaskLoadError, scan
from tasks.synth.decontam import ExcludeError, ExcludeIndex, build_index, index_files, normalised_source_hash

DROP_REASONS = ("validation split", "evaluation task (structure)", "evaluation task (source)")


@dataclass
class EvalTasks:
    """The evaluation tasks one run must keep out of its data, and what it dropped because of them."""

    split_seed: int
    val_fraction: float
    index: ExcludeIndex  # the validation split's task files and every --exclude task
    val_files: list[TaskFile] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)  # reason (DROP_REASONS) -> count

    def __post_init__(self) -> None:
        self.val_ids = frozenset(tf.task_id for tf in self.val_files)

    def is_validation(self, task_id: str | None) -> bool:
        """A task id of the task set's validation split (ids of other task sets are never held out by id)."""
        return task_id in self.val_ids

    def task_drop(self, task_id: str, source: str, filename: str) -> str | None:
        """Why a task (which the caller runs anyway) is an evaluation task, counted; None when it is not."""
        reason = None
        if self.is_validation(task_id):
            reason = "validation split"
        else:
            hit = self.index.match(source, filename)
            if hit is not None:
                reason = f"evaluation task ({hit[0]})"
        if reason:
            self.dropped[reason] += 1
        return reason

    def example_drop(self, example: ChatExample) -> str | None:
        """Why an example answers an evaluation task, counted; None when it does not (module docstring)."""
        reason = None
        if self.is_validation(example.task_id):
            reason = "validation split"
        else:
            reference = reference_of(example)
            norm = normalised_source_hash(reference) if reference is not None else None
            if norm is not None and norm in self.index.sources:
                reason = "evaluation task (source)"
        if reason:
            self.dropped[reason] += 1
        return reason

    def summary(self) -> str:
        total = sum(self.dropped.values())
        how = ", ".join(f"{self.dropped[r]} {r}" for r in DROP_REASONS if self.dropped[r])
        return (
            f"decontamination: dropped {total}{f' ({how})' if how else ''}; evaluation tasks: "
            f"{len(self.val_files)} of the validation split, {self.index.files - len(self.val_files)} "
            "under --exclude"
        )


def validation_files(replay: ReplayConfig, tasks: str | Path | None = None) -> list[TaskFile]:
    """The task files of the validation split of `tasks` (default `replay.tasks`), as replay splits it."""
    root = resolve_task_path(str(tasks if tasks is not None else replay.tasks))
    try:
        found, _broken = scan(root)
    except TaskLoadError as err:
        raise ExcludeError(f"task set {root}: {err}") from None
    return [
        tf
        for tf in found
        if replay.val_fraction > 0 and is_validation(tf.task_id, replay.split_seed, replay.val_fraction)
    ]


def eval_tasks(replay: ReplayConfig, tasks: str | Path | None, exclude: list[Path], *, trace: bool = True) -> EvalTasks:
    """The evaluation tasks of the task set `tasks` (default `replay.tasks`) and the `exclude`
    directories. `trace=False` indexes normalised sources only (runs no task code: `kiln sft`).
    Raises ExcludeError naming a path that holds no task."""
    val = validation_files(replay, tasks)
    for path in exclude:
        if not Path(path).exists():
            raise ExcludeError(f"--exclude {path}: no such file or directory")
    index = build_index([Path(p) for p in exclude], trace=trace)
    index_files(index, [tf.path for tf in val], trace=trace)
    return EvalTasks(split_seed=replay.split_seed, val_fraction=replay.val_fraction, index=index, val_files=val)
