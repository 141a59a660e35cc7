"""Weights over a process group (the separate-GPU path of DESIGN.md §7): the learner is rank 0 and
broadcasts HF-named tensors; each engine joins at its rank and receives them in the announced order.

The group is built directly on a TCPStore (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU), never
through `torch.distributed.init_process_group`, so it does not touch the process's default group (a
learner or an engine may have its own). This is the contract of SGLang's `/init_weights_update_group`
and `/update_weights_from_distributed`: the same learner code feeds an SGLang server or this engine.
"""

from __future__ import annotations

import datetime
import socket
from typing import Iterable

import torch
import torch.distributed as dist


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _store(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float):
    return dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                         timeout=datetime.timedelta(seconds=timeout_s))


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the learner names it to an engine before listening on it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _form(store, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float,
          device: torch.device | None = None):
    """The process group over `store`; blocks until every rank has joined (or the timeout)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s))
    group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    # NCCL creates its communicator at the first collective: make it now, so a failed join fails here.
    group.broadcast(torch.zeros(1, device=device if device is not None else torch.cuda.current_device()), 0).wait()
    return group


def _group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
           timeout_s: float, device: torch.device | None = None):
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    store = _store(master_address, master_port, rank, world_size, timeout_s)
    return store, _form(store, rank, world_size, group_name, backend, timeout_s, device)


class WeightReceiver:
    """An engine's end of the group (rank >= 1)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, *,
                 group_name: str = "weight_update_group", backend: str = "gloo", device: str | torch.device = "cpu",
                 timeout_s: float = 600.0) -> None:
        if not 1 <= rank < world_size:
            raise ValueError(f"an engine's rank must lie in [1, {world_size}), got {rank}")
        self.device = torch.device(device)
        self._store, self.group = _group(master_address, master_port, rank, world_size, group_name, backend,
                                         timeout_s, self.device)

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
    """The learner's end (rank 0): it creates the group's store, then broadcasts buckets.

    With `form=False` the constructor only picks the port (`.port`; 0 = a free one), so the learner can
    tell the engines where to join first; `form()` then listens and waits for them: `join_timeout_s`
    for every engine to reach the store, then `timeout_s` (also each broadcast's limit) for the group.
    An engine that never comes thus costs the join timeout, not the push timeout."""

    def __init__(self, master_address: str, master_port: int, world_size: int, *,
                 group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = 600.0,
                 join_timeout_s: float | None = None, form: bool = True) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.address, self.port = master_address, master_port or free_port(master_address)
        self._args = (world_size, group_name, backend, timeout_s, join_timeout_s or timeout_s)
        self._store = None
        self.group = None
        if form:
            self.form()

    def form(self, group_name: str | None = None) -> None:
        """Listen, wait for the engines, form the group; `group_name` overrides the constructor's."""
        world_size, default_name, backend, timeout_s, join_timeout_s = self._args
        self._store = dist.TCPStore(self.address, self.port, world_size, is_master=True,
                                    timeout=datetime.timedelta(seconds=join_timeout_s), wait_for_workers=True)
        self.group = _form(self._store, 0, world_size, group_name or default_name, backend, timeout_s)

    def broadcast(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in tensors:
            self.group.broadcast(tensor.contiguous(), 0).wait()

    def close(self) -> None:
        """Drop the group (an NCCL communicator is aborted, so a dead peer holds nothing)."""
        group, self.group = self.group, None
        if group is not None and hasattr(group, "abort"):
            try:
                group.abort()
            except RuntimeError:
                pass
        self._store = None


def manifest(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of a bucket, as announced before its broadcast."""
    return ([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors])
