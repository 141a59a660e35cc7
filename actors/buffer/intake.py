"""Intake checks: is a decoded Episode consistent with the group it claims to belong to?

The codec has already checked types and each record's own rules (e.g. one version per response
token). Here are the rules that need replay's knowledge: the group exists, the sample slot is in
range and free, the task is the one served, and the numbers are finite. A failing episode is
rejected (EpisodeAck status "rejected" with the reason), counted, and never stored.
"""

from __future__ import annotations

import numpy as np

from actors.buffer.groups import Group
from protocols import Episode


def rejection(ep: Episode, group: Group | None) -> tuple[str, str] | None:
    """(counter key, explanation) when `ep` must be rejected, None when it may be stored. The key
    names the rejected-by-reason counter; the explanation goes back in the EpisodeAck.
    `group` is None for an unknown (or already closed) group id."""
    if ep.task.split == "val":
        return "validation", "validation episodes are evaluated, never sent to replay for training"
    if group is None:
        return "unknown_group", f"group {ep.group_id!r} was never handed out or is already closed"
    if not 0 <= ep.sample_index < group.size:
        return "sample_index", f"sample_index {ep.sample_index} outside [0, {group.size}) of group {group.group_id}"
    held = group.episodes.get(ep.sample_index)
    if held is not None and held.episode_id != ep.episode_id:
        return (
            "slot_taken",
            f"sample {ep.sample_index} of group {group.group_id} already holds episode {held.episode_id}",
        )
    if ep.task.task_id != group.task.task_id:
        return "task_mismatch", f"task {ep.task.task_id!r} is not group {group.group_id}'s task {group.task.task_id!r}"
    if (ep.task.repair is not None) != group.is_retry or ep.is_retry != group.is_retry:
        return "retry_mismatch", (
            f"group {group.group_id} was served as a {'repair' if group.is_retry else 'fresh'} "
            f"task; the episode must carry the served task and is_retry={group.is_retry}"
        )
    return content_problem(ep)


def content_problem(ep: Episode) -> tuple[str, str] | None:
    """Numbers that would poison training: non-finite rewards or logprobs, negative versions."""
    if not np.all(np.isfinite(np.asarray(ep.rewards, dtype=np.float64))):
        return "non_finite", f"rewards {ep.rewards} are not all finite"
    for k, turn in enumerate(ep.turns):
        if len(turn.logprobs) and not np.all(np.isfinite(np.asarray(turn.logprobs, dtype=np.float64))):
            return "non_finite", f"turn {k} has non-finite behaviour logprobs"
        if len(turn.versions) and np.asarray(turn.versions).min() < 0:
            return "bad_version", f"turn {k} has a negative weight version"
    return None
