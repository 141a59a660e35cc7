"""Weights over a process group (the separate-GPU path of DESIGN.md §7): the learner is rank 0 and
broadcasts HF-named tensors; each engine joins at its rank and receives them in the announced order.

The group is built directly on a TCPStore (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU), never
through `torch.distributed.init_process_group`, so it does not touch the process's default group (a
learner or an engine may have its own). This is the contract of SGLang's `/init_weights_update_group`
and `/update_weights_from_distributed`: the same learner code feeds an SGLang server or this engine.
"""

from __future__ import annotations

import datetime
from typing import Iterable

import torch
import torch.distributed as dist


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
           timeout_s: float):
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    group = (dist.ProcessGroupGloo(prefixed, rank, world_size, timeout) if backend == "gloo"
             else dist.ProcessGroupNCCL(prefixed, rank, world_size))
    return store, group


class WeightReceiver:
    """An engine's end of the group (rank >= 1)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, *,
                 group_name: str = "weight_update_group", backend: str = "gloo", device: str | torch.device = "cpu",
                 timeout_s: float = 600.0) -> None:
        if not 1 <= rank < world_size:
            raise ValueError(f"an engine's rank must lie in [1, {world_size}), got {rank}")
        self.device = torch.device(device)
        self._store, self.group = _group(master_address, master_port, rank, world_size, group_name, backend,
                                         timeout_s)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
        """Receive one bucket: the tensors the learner broadcasts next, in this order."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=_dtype(dtype), device=self.device)
            self.group.broadcast(tensor, 0).wait()
            out.append((name, tensor))
        return out


class WeightBroadcaster:
    """The learner's end (rank 0): it creates the group's store, then broadcasts buckets."""

    def __init__(self, master_address: str, master_port: int, world_size: int, *,
                 group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = 600.0) -> None:
        self._store, self.group = _group(master_address, master_port, 0, world_size, group_name, backend, timeout_s)

    def broadcast(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in tensors:
            self.group.broadcast(tensor.contiguous(), 0).wait()


def manifest(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of a bucket, as announced before its broadcast."""
    return ([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors])
