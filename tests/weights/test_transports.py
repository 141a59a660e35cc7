"""The weight transports behind one interface (actors/policy/weights): every transport has a learner end
and an engine end under one name, the factory refuses unknown names, `auto` picks what the placement
allows, and the CUDA IPC snapshot rule (kept until every live engine confirmed it or a newer one, at
most MAX_IPC_SNAPSHOTS, the newest always) holds. The transports themselves move real weights in
tests/weights/test_sync.py (gloo, disk), tests/weights/test_joins.py (joins, rejoins, the disk fallback)
and tests/weights/test_sync_gpu.py (nccl, cuda_ipc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.policy.weights import LOADERS, SENDERS, TRANSPORTS, SenderSettings, choose_transport, loader, sender
from actors.policy.weights.base import Published
from actors.policy.weights.cuda_ipc import MAX_IPC_SNAPSHOTS, IpcSender
from protocols import WeightAnnouncement, WeightHandles, WeightRequest


def test_every_transport_has_both_ends_under_its_name(tmp_path):
    assert set(TRANSPORTS) == {"gloo", "nccl", "cuda_ipc", "disk"} == set(SENDERS) == set(LOADERS)
    for name in TRANSPORTS:
        assert sender(name, SenderSettings(run_dir=tmp_path)).name == name
        assert loader(name).name == name
    with pytest.raises(ValueError, match="transport must be one of .*'musa'"):
        sender("musa", SenderSettings(run_dir=tmp_path))
    with pytest.raises(ValueError, match="transport must be one of"):
        loader("")


def test_process_groups_fall_back_to_disk_and_the_others_do_not():
    assert {name: loader(name).fallback for name in TRANSPORTS} == {
        "gloo": "disk",
        "nccl": "disk",
        "cuda_ipc": None,
        "disk": None,
    }


@pytest.mark.parametrize(
    "device, shares_gpu, expected",
    [("cpu", False, "gloo"), ("cpu", True, "gloo"), ("cuda:0", False, "nccl"), ("cuda:1", True, "cuda_ipc")],
)
def test_auto_picks_the_transport_the_placement_allows(device, shares_gpu, expected):
    assert choose_transport("auto", device, shares_gpu) == expected
    assert choose_transport("disk", device, shares_gpu) == "disk"  # a forced transport is used as given


def snapshot(version: int) -> tuple[list, WeightHandles]:
    return [], WeightHandles(version=version, manifest=[], bucket_bytes=1, handles=[])


def test_ipc_snapshots_live_until_every_engine_moved_past_them(tmp_path: Path):
    ipc = IpcSender(SenderSettings(run_dir=tmp_path))
    for v in (1, 2):
        ipc.snapshots[v], ipc.newest = snapshot(v), v
    ipc.retire(oldest_needed=1)  # an engine still serves version 1: both stay
    assert sorted(ipc.snapshots) == [1, 2]
    ipc.retire(oldest_needed=2)
    assert sorted(ipc.snapshots) == [2]
    for v in range(3, 3 + MAX_IPC_SNAPSHOTS + 1):  # an engine stuck at version 2: the cap still holds
        ipc.snapshots[v], ipc.newest = snapshot(v), v
        ipc.retire(oldest_needed=2)
    assert len(ipc.snapshots) == MAX_IPC_SNAPSHOTS and ipc.newest in ipc.snapshots
    ipc.retire(oldest_needed=10**6)  # every engine past the newest: the newest is kept all the same
    assert sorted(ipc.snapshots) == [ipc.newest]


def test_ipc_answers_the_newest_snapshot_or_that_nothing_is_published(tmp_path: Path):
    ipc = IpcSender(SenderSettings(run_dir=tmp_path))
    replies = []
    empty = Published(version=-1, manifest=[], bucket_bytes=1, named=None)
    assert ipc.answer(WeightRequest(engine_id="e"), empty, replies.append) is False
    assert replies == [WeightAnnouncement(version=-1, manifest=[], transport="cuda_ipc")]
    ipc.snapshots[4], ipc.newest = snapshot(4), 4
    ipc.answer(
        WeightRequest(engine_id="e"), Published(version=4, manifest=[], bucket_bytes=1, named=None), replies.append
    )
    assert replies[-1] == snapshot(4)[1] and replies[-1].transport == "cuda_ipc"
    # an engine's end loads handles and has nothing to load before the first publish
    assert loader("cuda_ipc").join(None, "e", replies[0], -1) is None
