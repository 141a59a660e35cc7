"""The weight-transport interface: how one version of the learner's weights reaches an engine.

A transport has two ends, one class each. The learner's end is a `Sender`, driven by the learner's
`WeightServer` (actors/learner/weight_sync.py), which owns the endpoints, the engine registry, the
ordering lock and the confirmations. An engine's end is a `Loader`, driven by the engine's
`WeightClient` (actors/rollout/weight_client.py), which owns the subscription, the requests and the
confirmations. Neither driver knows a transport by name: everything that differs between gloo, nccl,
cuda_ipc and disk lives in that transport's module.

A version travels like this. The server calls `Sender.publish` (make the version reachable: write it,
export it), announces it, then calls `Sender.push` (deliver it to the engines it pushes into). An
engine that asks for the current weights (`WeightRequest`: at start, after a restart, or when an
announcement cannot reach it otherwise) gets `Sender.answer`, which its client hands to
`Loader.join`; each later announcement goes to `Loader.receive`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from protocols import Record, TensorSpec, WeightAnnouncement, WeightHandles, WeightRequest

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]
Load = Callable[[], None]  # one load into an engine; the client times it and confirms it to the learner


@dataclass(frozen=True)
class SenderSettings:
    """What the learner's ends of the transports are built with (each takes the fields it uses)."""

    run_dir: Path  # the learner's directory: disk versions go to run_dir/weights
    host: str = "127.0.0.1"  # where process-group rendezvous listen
    advertise: str = "127.0.0.1"  # the host engines are told to reach them at
    timeout_s: float = 120.0  # each broadcast to an engine (a slower engine is dropped)
    join_timeout_s: float = 30.0  # an engine told where to join must arrive within this
    keep_disk: int = 2  # disk versions kept
    hf_config: object = None  # written as config.json beside each disk version


@dataclass(frozen=True)
class Published:
    """The version the learner serves now, as the transports see it."""

    version: int  # -1 before the first publish
    manifest: list[TensorSpec]
    bucket_bytes: int  # the bucket plan: protocols.weights.plan_buckets(manifest, bucket_bytes, by_dtype=flat)
    named: NamedTensors | None  # re-reads the learner's current tensors (for a late join); None before any
    flat: bool = False  # process groups: one flat broadcast per (single-dtype) bucket, else one per tensor


def unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors to push, detached, dropping any that shares storage, shape and strides with an
    earlier one (tied weights: the engine's model ties them too)."""
    seen, out = set(), []
    for name, tensor in named:
        tensor = tensor.detach()
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
        )
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def specs(named: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape)) for n, t in named]


class Sender(abc.ABC):
    """The learner's end of a transport. `WeightServer` calls its methods under the ordering lock,
    except `retire` after a confirmation and `forget(wait=False)` from `drop`: those two must be safe
    without it (a push may hold the lock for as long as a broadcast to a dead engine takes)."""

    name: ClassVar[str]
    # True when `answer` may wait (a disk write, a group forming): the server then answers on a thread
    # of its own, not on the thread that serves every other request.
    waits: ClassVar[bool] = True
    # True when `answer` reads no weights for an engine that holds the current version already (it only
    # forms the engine's link): the server then lets the learner step while that link forms.
    links_without_weights: ClassVar[bool] = False

    def publish(self, current: Published, named: list[tuple[str, torch.Tensor]]) -> str:
        """Make `current` reachable before it is announced; returns the announcement's `location`."""
        return ""

    def push(self, current: Published, named: list[tuple[str, torch.Tensor]]) -> dict[str, BaseException | None]:
        """After the announcement: deliver `current` to every engine this transport pushes into.
        Returns each such engine's outcome (None: it received the whole version)."""
        return {}

    @abc.abstractmethod
    def answer(self, request: WeightRequest, current: Published, reply: Callable[[Record], None]) -> bool:
        """Answer an engine's `WeightRequest` with how to get `current` (`reply` exactly once), and
        deliver it if this transport pushes. True when the engine now holds a link that later versions
        are pushed into; an exception means the engine could not join and the server drops it."""

    # retire, forget and close are optional hooks: a transport with nothing to free keeps the no-op.
    def retire(self, oldest_needed: int) -> None:  # noqa: B027
        """Free what no live engine needs any more: each has confirmed `oldest_needed` or newer."""

    def forget(self, engine_id: str, wait: bool = True) -> None:  # noqa: B027
        """Close the engine's link, if it has one (it died, or it joins again). `wait=False` closes it
        off the caller's thread."""

    def close(self) -> None:  # noqa: B027
        """Release everything (the server stops)."""


class EngineWeights(Protocol):
    """The weight methods of an engine that a Loader calls (the rollout engine interface has them)."""

    @property
    def weight_version(self) -> int: ...

    def update_weights_from_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def update_weights_from_disk(self, path: str, version: int) -> None: ...

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None: ...

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
        *,
        last: bool = True,
        flat: bool = False,
    ) -> None: ...


class Loader(abc.ABC):
    """An engine's end of a transport: one per transport per `WeightClient`, which calls it under its
    lock and runs the loads it returns. A failed load makes the client `detach` it and join again."""

    name: ClassVar[str]
    # The transport an engine asks for (`WeightRequest.transport`) when joining through this one failed.
    fallback: ClassVar[str | None] = None

    def __init__(self) -> None:
        self.link: str | None = None  # the link this engine holds with the learner (a group's name), if any

    @abc.abstractmethod
    def join(
        self, engine: EngineWeights, engine_id: str, reply: WeightAnnouncement | WeightHandles, have: int
    ) -> Load | None:
        """Take the learner's answer to a WeightRequest sent with `have_version=have`, joining what it
        names; returns the load that brings the engine to `reply.version`, or None if there is none."""

    def newest(self, engine: EngineWeights) -> int:
        """Announcements at or below this version are not for this engine (skipped)."""
        return engine.weight_version

    @abc.abstractmethod
    def receive(self, engine: EngineWeights, announcement: WeightAnnouncement) -> Load | None:
        """The load for an announcement newer than `newest`, or None when this transport reaches the
        engine only through a new `WeightRequest` (the client then joins again)."""

    def detach(self) -> None:
        """Forget the link: a load through it failed, so the learner drops it too."""
        self.link = None
