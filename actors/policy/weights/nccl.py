"""The `nccl` transport: an NCCL process group per engine, for engines on other GPUs than the learner's
(what `learner.weight_sync: auto` picks when they do not share its GPU). NCCL creates a communicator
at its first collective, so the group makes one at once and a failed join fails there; a dropped
engine's communicator is aborted, which ends a broadcast blocked on it (see `group.py`). Two ranks
on one GPU are refused by NCCL: colocated engines use `cuda_ipc`."""

from __future__ import annotations

from actors.policy.weights.group import GroupLoader, GroupSender


class NcclSender(GroupSender):
    name = "nccl"


class NcclLoader(GroupLoader):
    name = "nccl"
