"""The `cuda_ipc` transport, for engines on the learner's own GPU (NCCL refuses two ranks on one GPU).

The learner copies each version into one flat buffer per bucket (`protocols.weights.bucket_layout`)
and keeps that snapshot; an engine asks for the buffers' CUDA IPC handles (`WeightRequest`, answered
with `WeightHandles`), copies the tensors out into its own memory and confirms. An announcement only
says that a new snapshot exists: the engine asks again. A snapshot lives until every live engine has
confirmed it or a newer one, and at most `MAX_IPC_SNAPSHOTS` are kept; the newest is always kept.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable

import torch

from actors.policy.weights.base import EngineWeights, Load, Loader, Published, Sender, SenderSettings, specs
from protocols import Record, WeightAnnouncement, WeightHandles, WeightRequest
from protocols.weights import bucket_layout, plan_buckets

MAX_IPC_SNAPSHOTS = 3


def export_ipc(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[list[torch.Tensor], list[bytes]]:
    """Copy a version into one flat uint8 buffer per bucket on the tensors' GPU and pickle each buffer's
    CUDA IPC handle. The buffers must stay alive while engines may open them."""
    from torch.multiprocessing.reductions import reduce_tensor

    tensors = dict(named)
    buffers, handles = [], []
    for bucket in plan_buckets(specs(named), bucket_bytes):
        offsets, total = bucket_layout(bucket)
        device = tensors[bucket[0].name].device
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for spec, off in zip(bucket, offsets, strict=True):
            src = tensors[spec.name]
            buf[off : off + src.numel() * src.element_size()].view(src.dtype).view(src.shape).copy_(src)
        buffers.append(buf)
    torch.cuda.synchronize()
    for buf in buffers:
        handles.append(pickle.dumps(reduce_tensor(buf)))
    return buffers, handles


def open_ipc(handles: WeightHandles, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a CUDA IPC version, copied out of the learner's shared bucket buffers (the
    copies are the engine's own: the learner may free its buffers once this engine confirmed)."""
    buckets = plan_buckets(handles.manifest, handles.bucket_bytes)
    if len(buckets) != len(handles.handles):
        raise ValueError(f"{len(handles.handles)} IPC handles for a plan of {len(buckets)} buckets")
    named = []
    for bucket, handle in zip(buckets, handles.handles, strict=True):
        rebuild, args = pickle.loads(handle)  # the learner's own reply, on this host: trusted
        buf = rebuild(*args)
        offsets, _ = bucket_layout(bucket)
        for spec, off in zip(bucket, offsets, strict=True):
            dtype = getattr(torch, spec.dtype)
            n = dtype.itemsize * int(torch.Size(spec.shape).numel())
            named.append((spec.name, buf[off : off + n].view(dtype).view(spec.shape).to(device, copy=True)))
        del buf
    torch.cuda.synchronize()
    return named


class IpcSender(Sender):
    name = "cuda_ipc"
    waits = False  # the handles of the newest snapshot are ready: answered at once

    def __init__(self, settings: SenderSettings) -> None:
        self.snapshots: dict[int, tuple[list[torch.Tensor], WeightHandles]] = {}  # version -> (buffers, handles)
        self.newest = -1
        self._lock = threading.Lock()  # confirmations retire snapshots from the server's serving thread

    def publish(self, current: Published, named: list[tuple[str, torch.Tensor]]) -> str:
        buffers, handles = export_ipc(named, current.bucket_bytes)
        with self._lock:
            self.snapshots[current.version] = (
                buffers,
                WeightHandles(
                    version=current.version,
                    manifest=current.manifest,
                    bucket_bytes=current.bucket_bytes,
                    handles=handles,
                ),
            )
            self.newest = current.version
        return ""

    def answer(self, request: WeightRequest, current: Published, reply: Callable[[Record], None]) -> bool:
        with self._lock:
            snapshot = self.snapshots.get(current.version)
        # nothing published yet: the engine serves its initial weights
        reply(snapshot[1] if snapshot is not None else WeightAnnouncement(version=-1, manifest=[], transport=self.name))
        return False

    def retire(self, oldest_needed: int) -> None:
        with self._lock:
            for v in sorted(self.snapshots):
                if v != self.newest and (v < oldest_needed or len(self.snapshots) > MAX_IPC_SNAPSHOTS):
                    del self.snapshots[v]

    def close(self) -> None:
        with self._lock:
            self.snapshots.clear()


class IpcLoader(Loader):
    name = "cuda_ipc"

    def join(
        self, engine: EngineWeights, engine_id: str, reply: WeightAnnouncement | WeightHandles, have: int
    ) -> Load | None:
        if not isinstance(reply, WeightHandles):  # nothing published yet
            return None
        return lambda: engine.update_weights_from_tensors(open_ipc(reply, device_of(engine)), reply.version)

    def receive(self, engine: EngineWeights, announcement: WeightAnnouncement) -> Load | None:
        return None  # the handles come only as the answer to a WeightRequest: ask again


def device_of(engine: EngineWeights) -> torch.device:
    return getattr(engine, "device", torch.device("cuda"))
