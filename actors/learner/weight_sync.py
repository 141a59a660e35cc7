"""`WeightServer`: the learner's end of the weight push to the rollout engines (DESIGN.md §2, §7).

Endpoints: a ROUTER ("weights") where engines ask for the current weights (`WeightRequest`) and confirm
what they loaded (`WeightsLoaded`, acknowledged with the same record), and a PUB ("announce",
"announce_sync") that announces every new version (`WeightAnnouncement`). Transports:

* `gloo` (CPU) / `nccl` (GPU): one 2-rank process group per engine (learner rank 0, engine rank 1),
  formed when the engine sends a `WeightRequest`. The reply announces the current version J and a
  fresh rendezvous "host:port"; the learner then forms the group and broadcasts J's buckets. A group
  per engine, not one N-rank group, because a collective with a dead rank hangs or fails for all: a
  restarted or dead engine must never stall the pushes to the others. The price: the learner sends
  each version once per engine (concurrently, one thread per group) instead of one tree/ring
  broadcast, so its outgoing link carries N copies; with few engines per learner that is cheap next
  to a training step, and it keeps every failure local to one engine.
* `cuda_ipc` (engine on the learner's GPU; NCCL refuses two ranks on one GPU): each version is copied
  into one flat buffer per bucket; engines ask for the buffers' IPC handles (`WeightHandles`), copy
  them into their model and confirm. A snapshot lives until every engine confirmed it or a newer one
  (at most `MAX_IPC_SNAPSHOTS` are kept).
* `disk`: `<run_dir>/weights/v{version}` (HF safetensors + config.json), written atomically, the
  last `keep_disk` kept. It is also the fallback for an engine whose process-group join failed.

Ordering: one lock serialises joins and publishes, so every publish after a join includes that engine
and none before it does; the engine ignores announcements at or below the version it joined with. The
learner also holds that lock (`updating()`) while it changes its weights, so a join never reads a
half-stepped model. Tied tensors (an lm_head sharing the embedding's storage) are pushed once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from actors.policy.weights.group import WeightBroadcaster
from protocols import Control, ErrorReply, TensorSpec, WeightAnnouncement, WeightHandles, WeightRequest, WeightsLoaded
from protocols.channels import Publisher, ReplyServer, Request
from protocols.weights import bucket_layout, group_name, manifest_bytes, plan_buckets

log = logging.getLogger(__name__)

DROP_POLL_S = 0.05  # how soon a publish notices that drop() took an engine away mid-push

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]
TRANSPORTS = ("gloo", "nccl", "cuda_ipc", "disk")
MAX_IPC_SNAPSHOTS = 3


@dataclass
class EngineState:
    """What the learner knows of one engine."""

    engine_id: str
    confirmed: int = -1  # newest version the engine said it serves
    live: bool = True  # False once its group failed; it comes back with its next WeightRequest
    group: WeightBroadcaster | None = None
    last_error: str = ""
    latency_s: float = 0.0  # publish -> WeightsLoaded of its newest confirmed version


@dataclass
class PushReport:
    """One publish: how long the push took and how much it moved."""

    version: int
    seconds: float = 0.0
    bytes: int = 0
    engines: int = 0  # engines the push reached
    dropped: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """GB/s per engine (each engine receives the whole version)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def choose_transport(weight_sync: str, learner_device: str, shares_gpu: bool) -> str:
    """The transport for `learner.weight_sync`: "auto" is gloo on CPU, cuda_ipc when the engines share
    the learner's GPU (colocated), nccl otherwise; any other value is used as given."""
    if weight_sync != "auto":
        return weight_sync
    if not learner_device.startswith("cuda"):
        return "gloo"
    return "cuda_ipc" if shares_gpu else "nccl"


def unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors to push, detached, dropping any that shares storage, shape and strides with an
    earlier one (tied weights: the engine's model ties them too)."""
    seen, out = set(), []
    for name, tensor in named:
        tensor = tensor.detach()
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride())
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def _settle(named: list[tuple[str, torch.Tensor]]) -> None:
    """Wait until queued GPU broadcasts have read the tensors (NCCL's wait() only orders streams): the
    learner may change its weights as soon as a push returns."""
    if named and named[0][1].is_cuda:
        torch.cuda.synchronize(named[0][1].device)


def specs(named: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape)) for n, t in named]


def write_hf_dir(root: Path, version: int, named: list[tuple[str, torch.Tensor]], hf_config=None) -> Path:
    """Write `root/v{version}` (model.safetensors + config.json) atomically: a temporary directory
    renamed into place, so an engine never reads a half-written version."""
    from safetensors.torch import save_file

    final = root / f"v{version}"
    if final.exists():
        return final
    tmp = root / f".v{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.contiguous().cpu() for n, t in named}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if hf_config is not None:
        text = hf_config.to_json_string() if hasattr(hf_config, "to_json_string") else json.dumps(hf_config)
        (tmp / "config.json").write_text(text)
    os.replace(tmp, final)
    return final


def prune_versions(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` version directories."""
    versions = sorted((int(p.name[1:]), p) for p in root.glob("v*") if p.name[1:].isdigit())
    for _, path in versions[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


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
        for spec, off in zip(bucket, offsets):
            src = tensors[spec.name]
            buf[off:off + src.numel() * src.element_size()].view(src.dtype).view(src.shape).copy_(src)
        buffers.append(buf)
    torch.cuda.synchronize()
    for buf in buffers:
        handles.append(pickle.dumps(reduce_tensor(buf)))
    return buffers, handles


class WeightServer:
    """The learner's weight endpoints. `start()` binds them; `publish(version, named_tensors)` pushes a
    version to every engine; `updating()` is held while the learner changes its weights; `stop()`."""

    def __init__(self, run_dir: str | Path, transport: str = "gloo", bucket_mb: float = 256, *,
                 host: str = "127.0.0.1", advertise: str | None = None, timeout_s: float = 120.0,
                 join_timeout_s: float = 30.0,
                 keep_disk: int = 2, hf_config=None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not bucket_mb > 0 or keep_disk < 1:
            raise ValueError("bucket_mb must be > 0 and keep_disk >= 1")
        self.transport = transport
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.host, self.advertise = host, advertise or host
        self.timeout_s = timeout_s  # each broadcast to an engine (a slower engine is dropped)
        self.join_timeout_s = join_timeout_s  # an engine told where to join must arrive within this
        self.disk_root = Path(run_dir) / "weights"
        self.keep_disk, self.hf_config = keep_disk, hf_config
        self.engines: dict[str, EngineState] = {}
        self.version = -1
        self.last_push: PushReport | None = None
        self.stats = {"publishes": 0, "joins": 0, "join_failures": 0, "dropped_groups": 0, "bad_requests": 0,
                      "disk_fallbacks": 0}
        self._named: NamedTensors | None = None
        self._manifest: list[TensorSpec] = []
        self._published_at: dict[int, float] = {}
        self._ipc: dict[int, tuple[list[torch.Tensor], WeightHandles]] = {}
        self._lock = threading.RLock()  # joins, publishes and the learner's own weight changes
        self._confirmed = threading.Condition()
        self._outbox: queue.SimpleQueue[tuple[Request, object]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._router: ReplyServer | None = None
        self._publisher: Publisher | None = None

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        self._router = ReplyServer(self.host, advertise=self.advertise if self.advertise != self.host else None)
        self._publisher = Publisher(self.host, advertise=self.advertise if self.advertise != self.host else None)
        self._spawn(self._serve, "serve")
        return {"weights": self._router.address, "announce": self._publisher.address,
                "announce_sync": self._publisher.sync_address}

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 5)
        with self._lock:
            for state in self.engines.values():
                if state.group is not None:
                    state.group.close()
                    state.group = None
            self._ipc.clear()
        for channel in (self._router, self._publisher):
            if channel is not None:
                channel.close()

    def health(self) -> dict:
        last = self.last_push
        return {"transport": self.transport, "version": self.version, **self.stats,
                "engines": {e.engine_id: {"confirmed": e.confirmed, "live": e.live, "latency_s": e.latency_s,
                                          "error": e.last_error} for e in list(self.engines.values())},
                "last_push": None if last is None else {"version": last.version, "seconds": last.seconds,
                                                        "bytes": last.bytes, "gbps": last.gbps,
                                                        "engines": last.engines, "dropped": last.dropped}}

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Hold while the learner changes the weights that `publish` reads (an optimizer step, a
        checkpoint restore): a late engine's join waits instead of reading a half-updated model."""
        with self._lock:
            yield

    # ------------------------------------------------------------------------------ publish

    def release_engines(self) -> None:
        """Colocated mode: ask every engine to give its accelerator memory back before a learner step;
        the next announcement brings it back. Best effort and unconfirmed (an engine that misses it
        keeps its memory)."""
        self._publisher.publish(Control(command="pause"))

    def publish(self, version: int, named_tensors: NamedTensors) -> PushReport:
        """Announce `version` and push it to every engine; returns once every live engine received it
        (gloo/nccl), or once it is exported (cuda_ipc) or written (disk). `named_tensors()` yields the
        learner's current HF-named tensors; it is called again for each later join."""
        with self._lock:
            if version <= self.version:
                raise ValueError(f"versions only grow: {version} after {self.version}")
            start = time.monotonic()
            named = unique_tensors(named_tensors())
            self._named, self._manifest, self.version = named_tensors, specs(named), version
            report = PushReport(version=version, bytes=manifest_bytes(self._manifest))
            announcement = WeightAnnouncement(version=version, manifest=self._manifest, transport=self.transport,
                                              bucket_bytes=self.bucket_bytes)
            if self.transport == "disk":
                announcement.location = str(self._write_disk(version, named))
            elif self.transport == "cuda_ipc":
                buffers, handles = export_ipc(named, self.bucket_bytes)
                self._ipc[version] = (buffers, WeightHandles(version=version, manifest=self._manifest,
                                                              bucket_bytes=self.bucket_bytes, handles=handles))
                self._prune_ipc()
            self._published_at[version] = time.monotonic()
            self._publisher.publish(announcement)
            if self.transport in ("gloo", "nccl"):
                self._broadcast_all(named, report)
            report.seconds = time.monotonic() - start
            self.last_push = report
            self.stats["publishes"] += 1
            return report

    def wait_confirmed(self, version: int, engines: Iterable[str] | None = None, timeout_s: float = 60.0) -> bool:
        """Block until the named engines (default: every live one) confirmed `version` or newer."""
        deadline = time.monotonic() + timeout_s

        def done() -> bool:
            names = list(engines) if engines is not None else [e for e, s in self.engines.items() if s.live]
            return all(n in self.engines and self.engines[n].confirmed >= version for n in names)

        with self._confirmed:
            return self._confirmed.wait_for(done, max(deadline - time.monotonic(), 0.0))

    def _broadcast_all(self, named: list[tuple[str, torch.Tensor]], report: PushReport) -> None:
        """Every live group receives the version's buckets, concurrently; a failing group is dropped."""
        targets = [s for s in self.engines.values() if s.live and s.group is not None]
        if not targets:
            return
        tensors = dict(named)
        buckets = [[(s.name, tensors[s.name]) for s in b] for b in plan_buckets(self._manifest, self.bucket_bytes)]

        def push(state: EngineState) -> None:
            for bucket in buckets:
                group = state.group
                if group is None:  # dropped meanwhile (drop())
                    raise RuntimeError("the engine was dropped")
                group.broadcast(bucket)
            _settle(named)

        # One daemon thread per group, and no join on a group that drop() took away meanwhile: a gloo
        # broadcast to a dead peer cannot be aborted and would hold the publish until its timeout.
        outcome: dict[str, BaseException | None] = {}
        finished = threading.Condition()

        def run(state: EngineState) -> None:
            try:
                push(state)
                err = None
            except BaseException as e:  # recorded; the publishing thread drops the engine
                err = e
            with finished:
                outcome[state.engine_id] = err
                finished.notify_all()

        for state in targets:
            threading.Thread(target=run, args=(state,), name=f"kiln-weight-push-{state.engine_id}", daemon=True).start()
        with finished:
            while any(s.engine_id not in outcome and s.live for s in targets):
                finished.wait(DROP_POLL_S)
        for state in targets:
            err = outcome.get(state.engine_id, RuntimeError("dropped during the push"))
            if err is None:
                report.engines += 1
                continue
            if state.live:
                self._drop(state, f"push of version {report.version} failed: {err}")
            report.dropped.append(state.engine_id)

    def drop(self, engine_id: str, why: str) -> bool:
        """Forget a dead engine now (the driver saw it die): its group is aborted, so a push blocked
        on it fails at once instead of at `timeout_s`, and wait_confirmed stops waiting for it. Not
        under the publish lock, which a push blocked on this engine holds. True if it was live."""
        state = self.engines.get(engine_id)
        if state is None or not state.live:
            return False
        group, state.group = state.group, None
        self._drop(state, why)
        if group is not None:
            # NCCL's abort ends a broadcast blocked on the dead peer; gloo's waits for it to time out,
            # so it runs off the caller's thread either way.
            threading.Thread(target=group.close, name="kiln-weight-abort", daemon=True).start()
        return True

    def _drop(self, state: EngineState, why: str) -> None:
        log.warning("weights: dropping engine %s: %s", state.engine_id, why)
        state.live, state.last_error = False, why
        if state.group is not None:
            state.group.close()
            state.group = None
        self.stats["dropped_groups"] += 1
        with self._confirmed:
            self._confirmed.notify_all()  # wait_confirmed no longer waits for it

    def _write_disk(self, version: int, named: list[tuple[str, torch.Tensor]]) -> Path:
        path = write_hf_dir(self.disk_root, version, named, self.hf_config)
        prune_versions(self.disk_root, self.keep_disk)
        return path

    def _prune_ipc(self) -> None:
        live = [s.confirmed for s in self.engines.values() if s.live]
        oldest_needed = min(live) if live else self.version
        for v in sorted(self._ipc):
            if v != self.version and (v < oldest_needed or len(self._ipc) > MAX_IPC_SNAPSHOTS):
                del self._ipc[v]

    # ------------------------------------------------------------------------------ requests

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=f"kiln-weights-{name}", daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self) -> None:
        while not self._stop.is_set():
            req = self._router.recv(timeout_s=0.02)
            if req is not None:
                try:
                    self._handle(req)
                except Exception as err:  # a handler bug must not take the endpoint down
                    log.exception("weights: request %s failed", type(req.record).__name__)
                    self._router.reply(req, ErrorReply(message=f"{type(err).__name__}: {err}"))
            while True:  # replies that join threads prepared (a ZMQ socket belongs to one thread)
                try:
                    pending, answer = self._outbox.get_nowait()
                except queue.Empty:
                    break
                self._router.reply(pending, answer)

    def _handle(self, req: Request) -> None:
        rec = req.record
        if isinstance(rec, WeightsLoaded):
            self._confirm(rec)
            self._router.reply(req, rec)
        elif isinstance(rec, WeightRequest):
            if self.transport == "cuda_ipc" and rec.transport == "":
                self._router.reply(req, self._handles(rec))
            else:  # joins and disk writes wait for the lock: off the serving thread
                self._spawn(lambda: self._join(req, rec), f"join-{rec.engine_id}")
        else:
            self.stats["bad_requests"] += 1
            self._router.reply(req, ErrorReply(message=f"the weight endpoint takes WeightRequest or WeightsLoaded, "
                                                       f"not {type(rec).__name__}"))

    def _confirm(self, rec: WeightsLoaded) -> None:
        with self._confirmed:
            state = self.engines.setdefault(rec.engine_id, EngineState(rec.engine_id))
            if rec.ok:
                state.confirmed = max(state.confirmed, rec.version)
                published = self._published_at.get(rec.version)
                state.latency_s = time.monotonic() - published if published is not None else 0.0
                state.last_error = ""
            else:
                state.last_error = rec.error
                log.warning("weights: engine %s could not load version %d: %s", rec.engine_id, rec.version, rec.error)
            self._confirmed.notify_all()
        if self.transport == "cuda_ipc":
            with self._lock:
                self._prune_ipc()

    def _handles(self, rec: WeightRequest):
        with self._lock:
            self.engines.setdefault(rec.engine_id, EngineState(rec.engine_id)).live = True
            snapshot = self._ipc.get(self.version)
        if snapshot is None:  # nothing published yet: serve the initial weights
            return WeightAnnouncement(version=-1, manifest=[], transport="cuda_ipc")
        return snapshot[1]

    def _join(self, req: Request, rec: WeightRequest) -> None:
        """A late or restarted engine: answer with the current version and, for gloo/nccl, form its
        group and push that version into it, all under the lock."""
        with self._lock:
            state = self.engines.get(rec.engine_id)
            if state is not None and state.group is not None:  # an earlier life of this engine
                state.group.close()
                state.group = None
            state = self.engines.setdefault(rec.engine_id, EngineState(rec.engine_id))
            state.live = True
            if self.transport == "disk" or rec.transport == "disk":
                try:
                    answer = self._disk_answer(rec)
                except Exception as err:  # e.g. the disk is full: the engine learns why and retries
                    log.exception("weights: writing the current version for %s failed", rec.engine_id)
                    answer = ErrorReply(message=f"writing version {self.version} failed: {err}")
                self._outbox.put((req, answer))
                return
            try:
                self._form_group(req, rec, state)
            except Exception as err:
                self.stats["join_failures"] += 1
                self._drop(state, f"join failed: {err}")

    def _disk_answer(self, rec: WeightRequest) -> WeightAnnouncement:
        if rec.transport == "disk" and self.transport != "disk":
            self.stats["disk_fallbacks"] += 1
        if self.version < 0:
            return WeightAnnouncement(version=-1, manifest=[], transport="disk")
        path = self.disk_root / f"v{self.version}"
        if not path.exists():
            path = self._write_disk(self.version, unique_tensors(self._named()))
        return WeightAnnouncement(version=self.version, manifest=self._manifest, transport="disk", location=str(path))

    def _form_group(self, req: Request, rec: WeightRequest, state: EngineState) -> None:
        try:
            group = WeightBroadcaster(self.host, 0, 2, backend=self.transport, timeout_s=self.timeout_s,
                                      join_timeout_s=self.join_timeout_s, form=False)
        except Exception as err:
            self._outbox.put((req, ErrorReply(message=f"no rendezvous for a weight group: {err}")))
            raise
        location = f"{self.advertise}:{group.port}"
        self._outbox.put((req, WeightAnnouncement(version=self.version, manifest=self._manifest,
                                                  transport=self.transport, location=location,
                                                  bucket_bytes=self.bucket_bytes)))
        try:
            group.form(group_name(rec.engine_id, location))
            if self.version > rec.have_version:
                tensors = dict(unique_tensors(self._named()))
                for bucket in plan_buckets(self._manifest, self.bucket_bytes):
                    group.broadcast([(s.name, tensors[s.name]) for s in bucket])
                _settle(list(tensors.items()))
        except Exception:
            group.close()
            raise
        state.group = group
        state.last_error = ""
        self.stats["joins"] += 1
