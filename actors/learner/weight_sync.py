"""`WeightServer`: the learner's end of the weight push to the rollout engines.

Endpoints: a ROUTER ("weights") where engines ask for the current weights (`WeightRequest`) and confirm
what they loaded (`WeightsLoaded`, acknowledged with the same record), and a PUB ("announce",
"announce_sync") that announces every new version (`WeightAnnouncement`).

How a version moves is the transport's business (`learner.weight_sync`; one class per transport in
actors/policy/weights, chosen by name once): this server is the same for all of them.

* `gloo` (CPU) / `nccl` (GPU): one 2-rank process group per engine (learner rank 0, engine rank 1),
  formed when the engine sends a `WeightRequest`; `publish` broadcasts into every group at once, and a
  dead engine's group is dropped without stalling the others (`group.py` says why a group per engine).
  With `flat_buckets` (the default) each bucket holds one dtype and goes as one flat broadcast,
  packed while the previous one is on the wire; otherwise one broadcast per tensor.
* `cuda_ipc` (engine on the learner's GPU; NCCL refuses two ranks on one GPU): each version is copied
  into one flat buffer per bucket; engines ask for the buffers' IPC handles (`WeightHandles`), copy
  them into their model and confirm. A snapshot lives until every engine confirmed it or a newer one
  (at most `MAX_IPC_SNAPSHOTS` are kept).
* `disk`: `<run_dir>/weights/v{version}` (HF safetensors + config.json), written atomically, the
  last `keep_disk` kept. It is also the fallback for an engine whose process-group join failed: any
  engine may ask for the current version on disk (`WeightRequest.transport = "disk"`).

Ordering: one lock serialises joins and publishes, so every publish after a join includes that engine
and none before it does; the engine ignores announcements at or below the version it joined with. The
learner also holds that lock (`updating()`) while it changes its weights, and a join that reads them
waits until the changed weights are published, so a join never reads a half-stepped model nor one
labelled with the version before its step. An engine that rejoins holding the current version (the
learner restarted) reads no weights: its group forms outside the lock, while the learner steps, and
the next publish waits for it. Tied tensors (an lm_head sharing the embedding's storage) are pushed once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from actors.policy.weights import Sender, SenderSettings, sender
from actors.policy.weights.base import NamedTensors, Published, specs, unique_tensors
from actors.policy.weights.disk import DiskSender
from protocols import Control, ErrorReply, Record, TensorSpec, WeightAnnouncement, WeightRequest, WeightsLoaded
from protocols.announcements import Publisher
from protocols.channels import ReplyServer, Request
from protocols.weights import manifest_bytes

log = logging.getLogger(__name__)


@dataclass
class EngineState:
    """What the learner knows of one engine."""

    engine_id: str
    confirmed: int = -1  # newest version the engine said it serves
    live: bool = True  # False once its link failed; it comes back with its next WeightRequest
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


class WeightServer:
    """The learner's weight endpoints. `start()` binds them; `publish(version, named_tensors)` pushes a
    version to every engine; `updating()` is held while the learner changes its weights; `stop()`."""

    def __init__(
        self,
        run_dir: str | Path,
        transport: str = "gloo",
        bucket_mb: float = 256,
        *,
        host: str = "127.0.0.1",
        advertise: str | None = None,
        timeout_s: float = 120.0,
        join_timeout_s: float = 30.0,
        keep_disk: int = 2,
        hf_config=None,
        flat_buckets: bool = True,
    ) -> None:
        settings = SenderSettings(
            run_dir=Path(run_dir),
            host=host,
            advertise=advertise or host,
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
            keep_disk=keep_disk,
            hf_config=hf_config,
        )
        self.sender: Sender = sender(transport, settings)
        if not bucket_mb > 0 or keep_disk < 1:
            raise ValueError("bucket_mb must be > 0 and keep_disk >= 1")
        self.transport = transport
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.flat = flat_buckets and transport in ("gloo", "nccl")  # the process-group bucket format
        self.host, self.advertise = host, advertise or host
        self.timeout_s = timeout_s  # each broadcast to an engine (a slower engine is dropped)
        self.join_timeout_s = join_timeout_s
        # What an engine may ask for: the learner's transport, or the current version on disk.
        fallback = DiskSender(settings)
        self._senders: dict[str, Sender] = {fallback.name: fallback, transport: self.sender}
        self.engines: dict[str, EngineState] = {}
        self.version = -1
        self.last_push: PushReport | None = None
        self.stats = {
            "publishes": 0,
            "joins": 0,
            "join_failures": 0,
            "dropped_groups": 0,
            "bad_requests": 0,
            "disk_fallbacks": 0,
        }
        self._named: NamedTensors | None = None
        self._manifest: list[TensorSpec] = []
        self._published_at: dict[int, float] = {}
        self._lock = threading.RLock()  # joins, publishes and the learner's own weight changes
        self._forming = 0  # joins forming a group outside the lock (their engines hold the current version)
        self._stepped = False  # the weights changed (`updating`) since the current version was published
        self._settled = threading.Condition(self._lock)  # a forming join ended, or a publish cleared _stepped
        self._confirmed = threading.Condition()
        self._outbox: queue.SimpleQueue[tuple[Request, Record]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._router: ReplyServer | None = None
        self._publisher: Publisher | None = None

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        self._router = ReplyServer(self.host, advertise=self.advertise if self.advertise != self.host else None)
        self._publisher = Publisher(self.host, advertise=self.advertise if self.advertise != self.host else None)
        self._spawn(self._serve, "serve")
        return {
            "weights": self._router.address,
            "announce": self._publisher.address,
            "announce_sync": self._publisher.sync_address,
        }

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 5)
        with self._lock:
            for each in self._senders.values():
                each.close()
        for channel in (self._router, self._publisher):
            if channel is not None:
                channel.close()

    def health(self) -> dict:
        last = self.last_push
        return {
            "transport": self.transport,
            "version": self.version,
            **self.stats,
            "engines": {
                e.engine_id: {"confirmed": e.confirmed, "live": e.live, "latency_s": e.latency_s, "error": e.last_error}
                for e in list(self.engines.values())
            },
            "last_push": None
            if last is None
            else {
                "version": last.version,
                "seconds": last.seconds,
                "bytes": last.bytes,
                "gbps": last.gbps,
                "engines": last.engines,
                "dropped": last.dropped,
            },
        }

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Hold while the learner changes the weights that `publish` reads (an optimizer step, a
        checkpoint restore): a late engine's join waits instead of reading a half-updated model."""
        with self._lock:
            try:
                yield
            finally:
                self._stepped = True  # until the next publish, these weights are no published version

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
            # A group forming now is pushed this version once it has formed; one still forming after
            # the join timeout misses it (its engine then fails to receive it and joins again).
            if not self._settled.wait_for(lambda: not self._forming, self.join_timeout_s):
                log.warning(
                    "weights: publishing version %d while %d engine group(s) still form", version, self._forming
                )
            named = unique_tensors(named_tensors())
            self._named, self._manifest, self.version = named_tensors, specs(named), version
            self._stepped = False
            self._settled.notify_all()
            report = PushReport(version=version, bytes=manifest_bytes(self._manifest))
            current = self._current()
            location = self.sender.publish(current, named)
            self.sender.retire(self._oldest_needed())
            self._published_at[version] = time.monotonic()
            self._publisher.publish(
                WeightAnnouncement(
                    version=version,
                    manifest=self._manifest,
                    transport=self.transport,
                    location=location,
                    bucket_bytes=self.bucket_bytes,
                    flat=self.flat,
                )
            )
            for engine_id, err in self.sender.push(current, named).items():
                if err is None:
                    report.engines += 1
                    continue
                state = self.engines[engine_id]
                if state.live:
                    self._drop(state, f"push of version {version} failed: {err}")
                report.dropped.append(engine_id)
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

    def drop(self, engine_id: str, why: str, *, expected: bool = False) -> bool:
        """Forget a dead engine now (the driver saw it die, or `expected`: stopped it at the run's end):
        its link is closed, so a push blocked on it fails at once instead of at the transport's timeout,
        and wait_confirmed stops waiting for it. Not under the publish lock, which a push blocked on
        this engine holds. True if it was live."""
        state = self.engines.get(engine_id)
        if state is None or not state.live:
            return False
        self.sender.forget(engine_id, wait=False)
        self._drop(state, why, expected=expected)
        return True

    def _drop(self, state: EngineState, why: str, *, expected: bool = False) -> None:
        (log.info if expected else log.warning)("weights: dropping engine %s: %s", state.engine_id, why)
        state.live, state.last_error = False, why
        self.sender.forget(state.engine_id)
        self.stats["dropped_groups"] += 1
        with self._confirmed:
            self._confirmed.notify_all()  # wait_confirmed no longer waits for it

    def _current(self) -> Published:
        return Published(
            version=self.version,
            manifest=self._manifest,
            bucket_bytes=self.bucket_bytes,
            named=self._named,
            flat=self.flat,
        )

    def _oldest_needed(self) -> int:
        """The oldest version a live engine may still load: the lowest that any live engine confirmed."""
        live = [s.confirmed for s in list(self.engines.values()) if s.live]
        return min(live) if live else self.version

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
            answering = self._senders[rec.transport or self.transport]
            if answering.waits:  # joins and disk writes wait for the lock: off the serving thread
                self._spawn(
                    lambda: self._answer(rec, answering, lambda answer: self._outbox.put((req, answer))),
                    f"join-{rec.engine_id}",
                )
            else:
                self._answer(rec, answering, lambda answer: self._router.reply(req, answer))
        else:
            self.stats["bad_requests"] += 1
            self._router.reply(
                req,
                ErrorReply(
                    message=f"the weight endpoint takes WeightRequest or WeightsLoaded, not {type(rec).__name__}"
                ),
            )

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
        self.sender.retire(self._oldest_needed())

    def _answer(self, rec: WeightRequest, answering: Sender, reply: Callable[[Record], None]) -> None:
        """A starting, late or restarted engine asks for the current version: `answering` (the learner's
        transport, or the disk fallback) tells it how to get it and, for process groups, forms its group
        and pushes the version into it, all under the lock. An engine that holds the current version
        already (it rejoins a restarted learner) reads no weights: its group forms outside the lock, so
        the learner's step goes on meanwhile (the engine's end of a join waits for that process to get
        around to it), and the next publish waits for the group instead (`_forming`)."""
        with self._lock:
            state = self.engines.setdefault(rec.engine_id, EngineState(rec.engine_id))
            state.live = True
            if answering is not self.sender:
                self.stats["disk_fallbacks"] += 1
            current = self._current()
            if not (answering.links_without_weights and rec.have_version >= current.version):
                # A join that reads the weights waits while the learner's stepped weights are not yet
                # published: read now, they would go out labelled with the version before the step.
                self._settled.wait_for(lambda: not self._stepped, self.join_timeout_s)
                self._join(state, answering, rec, self._current(), reply)
                return
            self._forming += 1
        try:
            self._join(state, answering, rec, current, reply)
        finally:
            with self._lock:
                self._forming -= 1
                self._settled.notify_all()

    def _join(
        self,
        state: EngineState,
        answering: Sender,
        rec: WeightRequest,
        current: Published,
        reply: Callable[[Record], None],
    ) -> None:
        """`answering` answers `rec` (under the lock, or not: see `_answer`); the outcome is recorded."""
        started = time.monotonic()
        try:
            joined = answering.answer(rec, current, reply)
            log.info(
                "weights: %s joined at version %d (it had %d) in %.3f s",
                rec.engine_id,
                current.version,
                rec.have_version,
                time.monotonic() - started,
            )
        except Exception as err:  # noqa: BLE001 - any failed join drops this engine; the others keep syncing
            with self._lock:
                self.stats["join_failures"] += 1
                self._drop(state, f"join failed: {err}")
            return
        with self._lock:
            if joined:
                state.last_error = ""
                self.stats["joins"] += 1
