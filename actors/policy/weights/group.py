"""Weight broadcast over a torch.distributed process group (gloo or NCCL), and the `gloo`/`nccl`
transport built on it.

The group: world = 1 learner + N engines, the learner (`WeightBroadcaster`, rank 0) broadcasts a
version as buckets; an engine joins at its rank (`WeightReceiver`) and receives them in the
announced order. The group is built directly on a TCPStore (`ProcessGroupGloo` on CPU,
`ProcessGroupNCCL` on GPU), never through `torch.distributed.init_process_group`, so it does not
touch the process's default group (a learner or an engine may have its own). This is the contract
of SGLang's `/init_weights_update_group` and `/update_weights_from_distributed`: the same learner
code feeds an SGLang server or Kiln's engine.

Two bucket formats, named by the announcement (`WeightAnnouncement.flat`). Flat (the default,
`learner.weight_sync.flat_buckets`): every bucket holds one dtype and travels as ONE broadcast of its
tensors flattened and concatenated (`protocols.weights.flat_offsets`; SGLang's
`load_format: flattened_bucket`); the learner packs bucket i+1 while bucket i is on the wire (NCCL
runs on its own stream; at most `FLAT_DEPTH` packed buckets exist at a time) and the engine's
tensors are views of the bucket it received, so nothing is unpacked. Per tensor: one broadcast per
tensor, in the manifest's order (SGLang servers without the flat format).

The transport (`GroupSender`, `GroupLoader`): one 2-rank group per engine (learner rank 0, engine
rank 1), formed when the engine sends a `WeightRequest`. The answer announces the current version and
a fresh rendezvous "host:port"; the learner then forms the group and broadcasts that version's
buckets. A group per engine, not one N-rank group, because a collective with a dead rank hangs or
fails for all: a restarted or dead engine must never stall the pushes to the others. The price: the
learner sends each version once per engine (concurrently, one thread per group) instead of one
tree/ring broadcast, so its outgoing link carries N copies; with few engines per learner that is cheap
next to a training step, and it keeps every failure local to one engine. An engine whose join fails
falls back to disk.
"""

from __future__ import annotations

import collections
import datetime
import math
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from actors.policy.weights.base import EngineWeights, Load, Loader, Published, Sender, SenderSettings, unique_tensors
from protocols import ErrorReply, Record, TensorSpec, WeightAnnouncement, WeightHandles, WeightRequest
from protocols.weights import flat_offsets, parse_location, plan_buckets
from protocols.weights import group_name as unique_group_name

DROP_POLL_S = 0.05  # how soon a push notices that the server took an engine away mid-push
STORE_POLL_S = 0.002  # how often a forming group looks for its engine at the store
FLAT_DEPTH = 2  # flat buckets packed ahead of the one on the wire (bounds the learner's extra memory)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")  # noqa: TRY004 - a bad name on the wire, not a caller's type error
    return dtype


def _store(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float):
    return dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=datetime.timedelta(seconds=timeout_s)
    )


def _form(
    store,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    device: torch.device | None = None,
):
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


def _group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    device: torch.device | None = None,
):
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    store = _store(master_address, master_port, rank, world_size, timeout_s)
    return store, _form(store, rank, world_size, group_name, backend, timeout_s, device)


class WeightReceiver:
    """An engine's end of the group (rank >= 1)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        device: str | torch.device = "cpu",
        timeout_s: float = 600.0,
    ) -> None:
        if not 1 <= rank < world_size:
            raise ValueError(f"an engine's rank must lie in [1, {world_size}), got {rank}")
        self.device = torch.device(device)
        self._store, self.group = _group(
            master_address, master_port, rank, world_size, group_name, backend, timeout_s, self.device
        )

    def receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *, flat: bool = False
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive one bucket: the tensors the learner broadcasts next, in this order. `flat`: the
        bucket comes as one tensor of its single dtype; the tensors returned are views of it."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        if flat:
            specs = [TensorSpec(name=n, dtype=d, shape=list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
            offsets, total = flat_offsets(specs)
            bucket = torch.empty(total, dtype=_dtype(dtypes[0]) if names else torch.uint8, device=self.device)
            self.group.broadcast(bucket, 0).wait()
            return [
                (s.name, bucket[o : o + math.prod(s.shape)].view(s.shape)) for s, o in zip(specs, offsets, strict=True)
            ]
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=_dtype(dtype), device=self.device)
            self.group.broadcast(tensor, 0).wait()
            out.append((name, tensor))
        return out


class WeightBroadcaster:
    """The learner's end (rank 0): it creates the group's store, then broadcasts buckets.

    With `form=False` the constructor opens nothing; `listen()` opens the store (on `.port`, or on a port
    the kernel picks when it is 0: `.port` names it from then on), so the learner can tell the engines
    where to join before it waits; `form()` then waits for them: `join_timeout_s`
    for every engine to reach the store, then `timeout_s` (also each broadcast's limit) for the group.
    An engine that never comes thus costs the join timeout, not the push timeout."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        timeout_s: float = 600.0,
        join_timeout_s: float | None = None,
        form: bool = True,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.address, self.port = master_address, master_port
        self._args = (world_size, group_name, backend, timeout_s, join_timeout_s or timeout_s)
        self._store = None
        self.group = None
        if form:
            self.form()

    def listen(self) -> None:
        """Open the group's store on `port` (without waiting for anyone): done before the engines are
        told where to join, an engine's first connection finds it listening, instead of being refused
        and retried after the store client's back-off (up to ~0.3 s measured)."""
        if self._store is None:
            world_size, _, _, _, join_timeout_s = self._args
            # Its timeout bounds each rendezvous read: an engine that never comes costs join_timeout_s.
            self._store = dist.TCPStore(
                self.address,
                self.port,
                world_size,
                is_master=True,
                timeout=datetime.timedelta(seconds=join_timeout_s),
                wait_for_workers=False,
            )
            # Bound by the store itself: a port picked beforehand and released could be taken by
            # another process before the store binds it (a restarted run died of that race).
            self.port = self._store.port

    def form(self, group_name: str | None = None) -> None:
        """Listen (if not yet), wait for the engines, form the group; `group_name` overrides the
        constructor's."""
        world_size, default_name, backend, timeout_s, join_timeout_s = self._args
        self.listen()
        # A torch store client counts itself in when it connects (one counter key, whatever the
        # world): the engines are here once the store holds a key. Waited for here, within the join
        # timeout; the group's own rendezvous would wait out timeout_s (its broadcasts' limit).
        deadline = time.monotonic() + join_timeout_s
        while self._store.num_keys() < 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine reached the weight group's store within {join_timeout_s:.0f} s")
            time.sleep(STORE_POLL_S)
        self.group = _form(self._store, 0, world_size, group_name or default_name, backend, timeout_s)

    def broadcast(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket, one broadcast per tensor."""
        for _, tensor in tensors:
            self.group.broadcast(tensor.contiguous(), 0).wait()

    def broadcast_flat(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], still_wanted: Callable[[], bool] = lambda: True
    ) -> None:
        """Each bucket (one dtype) as one broadcast of its tensors concatenated; bucket i+1 is packed
        while bucket i is on the wire, and at most FLAT_DEPTH + 1 packed buckets exist. Stops with an
        error when `still_wanted()` turns False (the engine was dropped)."""
        in_flight: collections.deque = collections.deque()
        for bucket in buckets:
            if not still_wanted():
                raise RuntimeError("the engine was dropped")
            flat = pack_flat([t for _, t in bucket])
            in_flight.append((self.group.broadcast(flat, 0), flat))
            if len(in_flight) > FLAT_DEPTH:
                _finished(*in_flight.popleft())
        while in_flight:
            _finished(*in_flight.popleft())

    def close(self) -> None:
        """Drop the group (an NCCL communicator is aborted, so a dead peer holds nothing)."""
        group, self.group = self.group, None
        if group is not None and hasattr(group, "abort"):
            try:
                group.abort()
            except RuntimeError:
                pass
        self._store = None


def pack_flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors (one dtype) flattened and concatenated in order: a view when there is one."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _finished(work, flat: torch.Tensor) -> None:
    """Wait for a broadcast to be done with its packed bucket (NCCL's wait() only orders the streams:
    the host waits too, which is what bounds the packed buckets alive)."""
    work.wait()
    if flat.is_cuda:  # the push runs on a thread of its own: name the device's stream, not the thread's default
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(flat.device))
        done.synchronize()


def manifest(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of a bucket, as announced before its broadcast."""
    return (
        [n for n, _ in tensors],
        [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        [list(t.shape) for _, t in tensors],
    )


def settle(named: list[tuple[str, torch.Tensor]]) -> None:
    """Wait until queued GPU broadcasts have read the tensors (NCCL's wait() only orders streams): the
    learner may change its weights as soon as a push returns."""
    if named and named[0][1].is_cuda:
        torch.cuda.synchronize(named[0][1].device)


class GroupSender(Sender):
    """The learner's end: a `WeightBroadcaster` per engine; `name` is the process-group backend."""

    links_without_weights = True  # `answer` pushes only a version newer than the engine's

    def __init__(self, settings: SenderSettings) -> None:
        self.settings = settings
        self.groups: dict[str, WeightBroadcaster] = {}  # engine id -> its group

    def push(self, current: Published, named: list[tuple[str, torch.Tensor]]) -> dict[str, BaseException | None]:
        """Every group receives the version's buckets, concurrently. One daemon thread per group, and no
        join on a group that `forget` took away meanwhile: a gloo broadcast to a dead peer cannot be
        aborted and would hold the publish until its timeout."""
        targets = dict(self.groups)
        if not targets:
            return {}
        buckets = _buckets(current, dict(named))
        outcome: dict[str, BaseException | None] = {}
        finished = threading.Condition()

        def run(engine_id: str, group: WeightBroadcaster) -> None:
            try:
                # forgotten meanwhile: the engine died
                send(group, buckets, current.flat, still_wanted=lambda: self.groups.get(engine_id) is group)
                settle(named)
                err = None
            except BaseException as e:  # noqa: BLE001 - reported; the server drops the engine
                err = e
            with finished:
                outcome[engine_id] = err
                finished.notify_all()

        for engine_id, group in targets.items():
            threading.Thread(
                target=run, args=(engine_id, group), name=f"kiln-weight-push-{engine_id}", daemon=True
            ).start()
        with finished:
            while any(e not in outcome and self.groups.get(e) is g for e, g in targets.items()):
                finished.wait(DROP_POLL_S)
        return {e: outcome.get(e, RuntimeError("dropped during the push")) for e in targets}

    def answer(self, request: WeightRequest, current: Published, reply: Callable[[Record], None]) -> bool:
        """Name a fresh rendezvous, form the engine's group there and push it `current` if it is newer
        than what the engine has."""
        self.forget(request.engine_id)  # an earlier life of this engine
        s = self.settings
        try:
            group = WeightBroadcaster(
                s.host, 0, 2, backend=self.name, timeout_s=s.timeout_s, join_timeout_s=s.join_timeout_s, form=False
            )
        except Exception as err:
            reply(ErrorReply(message=f"no rendezvous for a weight group: {err}"))
            raise
        try:
            group.listen()
        except Exception as err:
            reply(ErrorReply(message=f"no rendezvous for a weight group: {err}"))
            raise
        location = f"{s.advertise}:{group.port}"
        reply(
            WeightAnnouncement(
                version=current.version,
                manifest=current.manifest,
                transport=self.name,
                location=location,
                bucket_bytes=current.bucket_bytes,
                flat=current.flat,
            )
        )
        try:
            group.form(unique_group_name(request.engine_id, location))
            if current.version > request.have_version:
                tensors = dict(unique_tensors(current.named()))
                send(group, _buckets(current, tensors), current.flat)
                settle(list(tensors.items()))
        except Exception:
            group.close()
            raise
        self.groups[request.engine_id] = group
        return True

    def forget(self, engine_id: str, wait: bool = True) -> None:
        group = self.groups.pop(engine_id, None)
        if group is None:
            return
        if wait:
            group.close()
        else:
            # NCCL's abort ends a broadcast blocked on the dead peer; gloo's waits for it to time out,
            # so it runs off the caller's thread either way.
            threading.Thread(target=group.close, name="kiln-weight-abort", daemon=True).start()

    def close(self) -> None:
        for engine_id in list(self.groups):
            self.forget(engine_id)


def _buckets(current: Published, tensors: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    plan = plan_buckets(current.manifest, current.bucket_bytes, by_dtype=current.flat)
    return [[(s.name, tensors[s.name]) for s in bucket] for bucket in plan]


def send(
    group: WeightBroadcaster,
    buckets: list[list[tuple[str, torch.Tensor]]],
    flat: bool,
    still_wanted: Callable[[], bool] = lambda: True,
) -> None:
    """A version's buckets into one engine's group, in the announced format."""
    if flat:
        group.broadcast_flat(buckets, still_wanted)
        return
    for bucket in buckets:
        if not still_wanted():
            raise RuntimeError("the engine was dropped")
        group.broadcast(bucket)


class GroupLoader(Loader):
    """An engine's end: it joins the group its `WeightRequest` was answered with and receives every
    later version pushed into it."""

    fallback = "disk"

    def __init__(self) -> None:
        super().__init__()
        # Newest version the learner pushed (or chose not to push) into the group: every later
        # announcement is pushed into it, whatever version the engine serves, and must be received.
        self.version = -1

    def join(
        self, engine: EngineWeights, engine_id: str, reply: WeightAnnouncement | WeightHandles, have: int
    ) -> Load | None:
        host, port = parse_location(reply.location)
        name = unique_group_name(engine_id, reply.location)
        engine.init_weights_update_group(host, port, 1, 2, group_name=name, backend=self.name)
        self.link, self.version = name, reply.version
        # the learner pushes exactly when the version is newer than ours
        return (lambda: self._receive(engine, reply)) if reply.version > have else None

    def newest(self, engine: EngineWeights) -> int:
        return self.version if self.link is not None else engine.weight_version

    def receive(self, engine: EngineWeights, announcement: WeightAnnouncement) -> Load | None:
        if self.link is None:  # no group (its push failed, or the join fell back to disk): join again
            return None
        self.version = announcement.version
        return lambda: self._receive(engine, announcement)

    def _receive(self, engine: EngineWeights, announcement: WeightAnnouncement) -> None:
        buckets = plan_buckets(announcement.manifest, announcement.bucket_bytes, by_dtype=announcement.flat)
        for i, bucket in enumerate(buckets):
            engine.update_weights_from_distributed(
                [s.name for s in bucket],
                [s.dtype for s in bucket],
                [list(s.shape) for s in bucket],
                announcement.version,
                group_name=self.link,
                last=i == len(buckets) - 1,
                flat=announcement.flat,
            )
