"""`WeightClient`: a rollout engine's end of the weight push (DESIGN.md §2, §7; the learner's end is
`actors.learner.weight_sync.WeightServer`).

`bootstrap(engine)` runs before the engine serves (at start and after every engine restart): it
subscribes to the learner's announcements first, then asks for the current weights (`WeightRequest`,
as an engine holding none: its own initial weights need not be the learner's version 0, which a
warm start changes) and loads them — joining a fresh 2-rank process group and receiving the buckets
(gloo/nccl), copying from CUDA IPC handles (cuda_ipc), or loading a directory (disk) — and confirms
(`WeightsLoaded`). If the group path fails it falls back to disk. `run(stop)` then applies
announcements in order and confirms each; announcements at or below the version served are skipped
(the learner pushed those before this engine joined). An engine without a group (its push failed)
rejoins, which also brings it to the current version.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import Callable, Mapping

import torch

from actors.rollout.engine import Engine, EngineError
from protocols import Control, ErrorReply, WeightAnnouncement, WeightHandles, WeightRequest, WeightsLoaded
from protocols.channels import ChannelTimeout, ReconnectingClient, RemoteError, Subscriber
from protocols.schema import Record
from protocols.weights import bucket_layout, group_name, parse_location, plan_buckets

log = logging.getLogger(__name__)

LEARNER_CHECK_S = 2.0  # how often the endpoints are re-read to follow a restarted learner
LearnerEndpoints = Mapping[str, str]  # WeightServer.start(): "weights", "announce", "announce_sync"


class WeightSyncError(RuntimeError):
    """The engine could not get the learner's current weights."""


def open_ipc(handles: WeightHandles, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a CUDA IPC version, copied out of the learner's shared bucket buffers (the
    copies are the engine's own: the learner may free its buffers once this engine confirmed)."""
    buckets = plan_buckets(handles.manifest, handles.bucket_bytes)
    if len(buckets) != len(handles.handles):
        raise ValueError(f"{len(handles.handles)} IPC handles for a plan of {len(buckets)} buckets")
    named = []
    for bucket, handle in zip(buckets, handles.handles):
        rebuild, args = pickle.loads(handle)  # the learner's own reply, on this host: trusted
        buf = rebuild(*args)
        offsets, _ = bucket_layout(bucket)
        for spec, off in zip(bucket, offsets):
            dtype = getattr(torch, spec.dtype)
            n = dtype.itemsize * int(torch.Size(spec.shape).numel())
            named.append((spec.name, buf[off:off + n].view(dtype).view(spec.shape).to(device, copy=True)))
        del buf
    torch.cuda.synchronize()
    return named


class WeightClient:
    def __init__(self, engine_id: str, learner: LearnerEndpoints | Callable[[], LearnerEndpoints], *,
                 request_timeout_s: float = 120.0, confirm_timeout_s: float = 10.0, poll_s: float = 0.2) -> None:
        self.engine_id = engine_id
        self._learner = learner if callable(learner) else (lambda: learner)
        # Requests follow the learner's registered "weights" address across restarts.
        self._req = ReconnectingClient(lambda: dict(self._learner()).get("weights", ""),
                                       timeout_s=request_timeout_s, retries=0)
        self.request_timeout_s, self.confirm_timeout_s, self.poll_s = request_timeout_s, confirm_timeout_s, poll_s
        self.engine: Engine | None = None
        self.group: str | None = None  # the process group this engine joined, if any
        # Newest version the learner pushed (or chose not to push) into that group: every later
        # announcement is pushed into it, whatever version the engine serves, and must be received.
        self.group_version = -1
        self.stats = {"releases": 0, "bootstraps": 0, "loaded": 0, "skipped": 0, "failures": 0, "disk_fallbacks": 0,
                      "last_seconds": 0.0}
        self.last_error = ""
        self._endpoints: dict[str, str] = {}
        self._joined: dict[str, str] = {}  # the endpoints of the learner whose weights we last joined
        self._sub: Subscriber | None = None
        self._lock = threading.RLock()  # one weight operation at a time, bootstrap included

    # ------------------------------------------------------------------------------ lifecycle

    def bootstrap(self, engine: Engine) -> None:
        """Attach `engine` and bring it to the learner's current version before it serves. Raises
        WeightSyncError when neither the transport nor the disk fallback worked."""
        with self._lock:
            self.engine, self.group = engine, None
            self._connect()
            self._join(fresh=True)
            self._joined = dict(self._endpoints)
            self.stats["bootstraps"] += 1

    def run(self, stop: threading.Event) -> None:
        """Apply announcements until `stop` is set (the rollout actor runs this on a thread). A learner
        that restarted (new endpoints) is joined again, which brings the engine to its version."""
        next_check = time.monotonic() + LEARNER_CHECK_S
        while not stop.is_set():
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + LEARNER_CHECK_S
                self._follow_learner()
            sub = self._sub
            if sub is None:  # between a close and the next bootstrap
                stop.wait(self.poll_s)
                continue
            try:
                ann = sub.recv(timeout_s=self.poll_s)
            except Exception as err:  # the publisher went away: resubscribe at the next bootstrap
                if stop.is_set():
                    return
                log.warning("%s: announcements: %s", self.engine_id, err)
                stop.wait(1.0)
                continue
            if ann is None:
                continue
            if isinstance(ann, Control):
                self._memory(ann.command)
                continue
            if not isinstance(ann, WeightAnnouncement):
                log.warning("%s: ignored %s on the announcement channel", self.engine_id, type(ann).__name__)
                continue
            with self._lock:
                try:
                    self._memory("resume")  # colocated: the learner's step is over once it announces
                    self._apply(ann)
                except Exception:  # a bug here must not end weight updates for the engine's life
                    log.exception("%s: applying version %d failed", self.engine_id, ann.version)
                    self.stats["failures"] += 1

    def _memory(self, command: str) -> None:
        """Colocated mode: "pause" gives the engine's accelerator memory back for the learner's step,
        "resume" takes it again (the next announcement resumes too, so a lost "resume" costs nothing)."""
        engine = self.engine
        if engine is None or command not in ("pause", "resume"):
            return
        released = bool(engine.health().get("released", False))
        try:
            if command == "pause" and not released:
                engine.release_memory()
                self.stats["releases"] += 1
            elif command == "resume" and released:
                engine.resume_memory()
        except Exception as err:  # the engine keeps its memory: slower for the learner, never wrong
            log.warning("%s: %s memory failed: %s", self.engine_id, command, err)

    def _follow_learner(self) -> None:
        try:
            endpoints = dict(self._learner())
        except Exception as err:
            log.warning("%s: reading the learner's endpoints: %s", self.engine_id, err)
            return
        if not endpoints or endpoints == self._joined or self.engine is None:
            return
        log.warning("%s: the learner moved to %s; joining it again", self.engine_id, endpoints.get("weights"))
        try:
            self.bootstrap(self.engine)
        except Exception as err:  # the new learner may still be starting: try again at the next check
            self.stats["failures"] += 1
            self.last_error = f"rejoining the learner: {err}"
            log.warning("%s: %s", self.engine_id, self.last_error)

    def close(self) -> None:
        with self._lock:
            if self._sub is not None:
                self._sub.close()
            self._sub = None
            self._req.close()

    def health(self) -> dict:
        return {**self.stats, "group": self.group, "error": self.last_error,
                "version": self.engine.weight_version if self.engine is not None else None}

    # ------------------------------------------------------------------------------ protocol

    def _connect(self) -> None:
        """(Re)connect to the learner's endpoints; subscribe BEFORE asking for weights, so no
        announcement after the join can be missed."""
        endpoints = dict(self._learner())
        if not endpoints:
            raise WeightSyncError("the learner has not registered its weight endpoints")
        if endpoints == self._endpoints and self._sub is not None:
            return
        self.close()
        sub = Subscriber(endpoints["announce"], endpoints["announce_sync"])
        try:
            sub.connect(timeout_s=self.request_timeout_s)
        except ChannelTimeout:
            sub.close()
            raise WeightSyncError(f"the learner's announcements at {endpoints['announce']} did not answer") from None
        self._sub = sub
        self._endpoints = endpoints

    def _request(self, rec: Record, timeout_s: float | None = None) -> Record:
        try:
            reply = self._req.request(rec, timeout_s=timeout_s)
        except (ChannelTimeout, RemoteError) as err:
            raise WeightSyncError(f"{type(rec).__name__}: {err}") from None
        if isinstance(reply, ErrorReply):
            raise WeightSyncError(reply.message)
        return reply

    def _join(self, fresh: bool = False) -> None:
        """Ask for the current weights and load them (falling back to disk if the group path fails).
        A `fresh` engine (just built) holds its own initial weights whatever version it reports, so it
        asks as one holding none: the learner then sends even version 0, whose weights a warm start
        has changed."""
        engine = self.engine
        have = -1 if fresh else engine.weight_version
        reply = self._request(WeightRequest(engine_id=self.engine_id, have_version=have))
        try:
            if isinstance(reply, WeightHandles):
                self._load(reply.version, lambda: engine.update_weights_from_tensors(
                    open_ipc(reply, _device(engine)), reply.version))
            elif reply.transport in ("gloo", "nccl"):
                self._join_group(reply, have)
            else:
                self._load_disk(reply, have)
        except (EngineError, ValueError, RuntimeError) as err:
            if not isinstance(reply, WeightAnnouncement) or reply.transport not in ("gloo", "nccl"):
                raise WeightSyncError(f"loading version {reply.version} failed: {err}") from None
            log.warning("%s: joining the weight group failed (%s); loading from disk", self.engine_id, err)
            self.group = None
            self.stats["disk_fallbacks"] += 1
            self._load_disk(self._request(WeightRequest(engine_id=self.engine_id, have_version=have,
                                                        transport="disk")), have)

    def _join_group(self, ann: WeightAnnouncement, have: int) -> None:
        host, port = parse_location(ann.location)
        name = group_name(self.engine_id, ann.location)
        self.engine.init_weights_update_group(host, port, 1, 2, group_name=name, backend=ann.transport)
        self.group, self.group_version = name, ann.version
        if ann.version > have:  # the learner pushes exactly when the version is newer than ours
            self._load(ann.version, lambda: self._receive(ann))

    def _receive(self, ann: WeightAnnouncement) -> None:
        buckets = plan_buckets(ann.manifest, ann.bucket_bytes)
        for i, bucket in enumerate(buckets):
            self.engine.update_weights_from_distributed(
                [s.name for s in bucket], [s.dtype for s in bucket], [list(s.shape) for s in bucket], ann.version,
                group_name=self.group, last=i == len(buckets) - 1)

    def _load_disk(self, ann: WeightAnnouncement, have: int | None = None) -> None:
        if ann.version > (self.engine.weight_version if have is None else have):
            self._load(ann.version, lambda: self.engine.update_weights_from_disk(ann.location, ann.version))

    def _load(self, version: int, load: Callable[[], None]) -> None:
        """Run one load and confirm it (or its failure) to the learner; a failure is re-raised."""
        start = time.monotonic()
        try:
            load()
        except Exception as err:
            self.stats["failures"] += 1
            self.last_error = f"version {version}: {err}"
            self._confirm(version, ok=False, error=str(err)[:2000], seconds=time.monotonic() - start)
            raise
        seconds = time.monotonic() - start
        self.stats["loaded"] += 1
        self.stats["last_seconds"] = seconds
        self._confirm(version, ok=True, seconds=seconds)

    def _confirm(self, version: int, *, ok: bool, seconds: float, error: str = "") -> None:
        rec = WeightsLoaded(engine_id=self.engine_id, version=version, ok=ok, error=error, seconds=seconds)
        try:
            self._request(rec, timeout_s=self.confirm_timeout_s)
        except WeightSyncError as err:  # the learner may be restarting; the version is loaded either way
            log.warning("%s: confirming version %d: %s", self.engine_id, version, err)

    def _apply(self, ann: WeightAnnouncement) -> None:
        engine = self.engine
        pushed = ann.transport in ("gloo", "nccl") and self.group is not None
        newest = self.group_version if pushed else (engine.weight_version if engine is not None else None)
        if newest is None or ann.version <= newest:  # announced before this engine joined (or loaded)
            self.stats["skipped"] += 1
            return
        try:
            if pushed:
                self.group_version = ann.version
                self._load(ann.version, lambda: self._receive(ann))
            elif ann.transport == "disk":
                self._load_disk(ann)
            else:  # cuda_ipc, or a process-group engine without a group: (re)join at the current version
                self._join()
        except (EngineError, WeightSyncError, ValueError, RuntimeError) as err:
            log.warning("%s: version %d not loaded: %s", self.engine_id, ann.version, err)
            self.group = None  # the learner dropped (or will drop) this group: rejoin next time
            if engine.health().get("alive"):
                try:
                    self._join()
                except (EngineError, WeightSyncError, ValueError, RuntimeError) as again:
                    self.last_error = f"rejoin failed: {again}"
                    log.warning("%s: rejoin failed: %s", self.engine_id, again)


def _device(engine: Engine) -> torch.device:
    return getattr(engine, "device", torch.device("cuda"))
