"""`WeightClient`: a rollout engine's end of the weight push (the learner's end is
`actors.learner.weight_sync.WeightServer`).

`bootstrap(engine)` runs before the engine serves (at start and after every engine restart): it
subscribes to the learner's announcements first, then asks for the current weights (`WeightRequest`,
as an engine holding none: its own initial weights need not be the learner's version 0, which a
warm start changes), hands the answer to the `Loader` of the transport that answered
(actors/policy/weights: joining a process group and receiving, copying from CUDA IPC handles, or
loading a directory), runs the load and confirms it (`WeightsLoaded`). If joining fails and the
transport has a fallback (process groups fall back to disk), it asks for that. `run(stop)` then
applies announcements in order and confirms each; announcements at or below the loader's newest
version are skipped (the learner pushed those before this engine joined). An engine that a
transport cannot reach by announcement alone (no group, or CUDA IPC) asks again, which also brings it
to the current version.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping

from actors.policy.weights import Loader, loader
from actors.rollout.engine import Engine, EngineError
from protocols import Control, ErrorReply, WeightAnnouncement, WeightRequest, WeightsLoaded
from protocols.announcements import Subscriber
from protocols.channels import ChannelTimeout, ReconnectingClient, RemoteError
from protocols.schema import Record
from protocols.timeline import SpanRecorder

log = logging.getLogger(__name__)

LEARNER_CHECK_S = 0.05  # how often the endpoints are re-read (a small file) to follow a restarted learner at once
LearnerEndpoints = Mapping[str, str]  # WeightServer.start(): "weights", "announce", "announce_sync"


class WeightSyncError(RuntimeError):
    """The engine could not get the learner's current weights."""


class WeightClient:
    def __init__(
        self,
        engine_id: str,
        learner: LearnerEndpoints | Callable[[], LearnerEndpoints],
        *,
        request_timeout_s: float = 120.0,
        confirm_timeout_s: float = 10.0,
        poll_s: float = LEARNER_CHECK_S,
        timeline: SpanRecorder | None = None,
    ) -> None:
        """`timeline`: where the engine's weight loads are recorded as "syncing" (the rollout actor's)."""
        self.engine_id = engine_id
        self.timeline = timeline
        self._learner = learner if callable(learner) else (lambda: learner)
        # Requests follow the learner's registered "weights" address across restarts.
        self._req = ReconnectingClient(
            lambda: dict(self._learner()).get("weights", ""), timeout_s=request_timeout_s, retries=0
        )
        self.request_timeout_s, self.confirm_timeout_s, self.poll_s = request_timeout_s, confirm_timeout_s, poll_s
        self.engine: Engine | None = None
        self.loaders: dict[str, Loader] = {}  # the engine's end of each transport it was answered through
        self.stats = {
            "releases": 0,
            "bootstraps": 0,
            "loaded": 0,
            "skipped": 0,
            "failures": 0,
            "disk_fallbacks": 0,
            "last_seconds": 0.0,
        }
        self.last_error = ""
        self._endpoints: dict[str, str] = {}
        self._joined: dict[str, str] = {}  # the endpoints of the learner whose weights we last joined
        self._sub: Subscriber | None = None
        self._lock = threading.RLock()  # one weight operation at a time, bootstrap included

    # ------------------------------------------------------------------------------ lifecycle

    def bootstrap(self, engine: Engine, fresh: bool = True) -> None:
        """Attach `engine` and bring it to the learner's current version before it serves. `fresh`: the
        engine was just built; False: it serves the weights of the version it reports (it rejoins a
        restarted learner, and nothing moves when that learner continues at the same version). Raises
        WeightSyncError when neither the transport nor the disk fallback worked."""
        with self._lock:
            started = time.monotonic()
            self.engine, self.loaders = engine, {}
            self._await_learner()
            self._connect()
            connected = time.monotonic()
            self._join(fresh=fresh)
            self._joined = dict(self._endpoints)
            self.stats["bootstraps"] += 1
            log.info(
                "%s: joined the learner's weights at version %d in %.3f s (%.3f s to connect)",
                self.engine_id,
                engine.weight_version,
                time.monotonic() - started,
                connected - started,
            )

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
            except Exception as err:  # noqa: BLE001 - the publisher went away: resubscribe at the next bootstrap
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
        released = engine.health().released
        try:
            if command == "pause" and not released:
                engine.release_memory()
                self.stats["releases"] += 1
            elif command == "resume" and released:
                engine.resume_memory()
        except Exception as err:  # noqa: BLE001 - the engine keeps its memory: slower for the learner, never wrong
            log.warning("%s: %s memory failed: %s", self.engine_id, command, err)

    def _follow_learner(self) -> None:
        try:
            endpoints = dict(self._learner())
        except Exception as err:  # noqa: BLE001 - the learner may be gone: try again at the next check
            log.warning("%s: reading the learner's endpoints: %s", self.engine_id, err)
            return
        if not endpoints or endpoints == self._joined or self.engine is None:
            return
        log.warning("%s: the learner moved to %s; joining it again", self.engine_id, endpoints.get("weights"))
        try:
            self.bootstrap(self.engine, fresh=False)
        except Exception as err:  # noqa: BLE001 - the new learner may still be starting: try again at the next check
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
        return {
            **self.stats,
            "group": self.group,
            "error": self.last_error,
            "version": self.engine.weight_version if self.engine is not None else None,
        }

    # ------------------------------------------------------------------------------ protocol

    def _await_learner(self) -> None:
        """Wait (up to the request timeout) for the learner's endpoints to be registered: an engine that
        starts while the learner restarts (both replaced after one failure) joins the new learner
        instead of failing its start."""
        deadline = time.monotonic() + self.request_timeout_s
        while not dict(self._learner()) and time.monotonic() < deadline:
            time.sleep(LEARNER_CHECK_S)

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

    @property
    def group(self) -> str | None:
        """The process group this engine joined, if any."""
        return next((each.link for each in self.loaders.values() if each.link is not None), None)

    def _loader(self, transport: str) -> Loader:
        if transport not in self.loaders:
            self.loaders[transport] = loader(transport)
        return self.loaders[transport]

    def _join(self, fresh: bool = False) -> None:
        """Ask for the current weights and load them (through the transport's fallback if joining
        fails). A `fresh` engine (just built) holds its own initial weights whatever version it
        reports, so it asks as one holding none: the learner then sends even version 0, whose weights a
        warm start has changed."""
        engine = self.engine
        have = -1 if fresh else engine.weight_version
        reply = self._request(WeightRequest(engine_id=self.engine_id, have_version=have))
        joining = self._loader(reply.transport)
        try:
            self._load(reply.version, joining.join(engine, self.engine_id, reply, have))
        except (EngineError, ValueError, RuntimeError) as err:
            joining.detach()
            if joining.fallback is None:
                raise WeightSyncError(f"loading version {reply.version} failed: {err}") from None
            log.warning(
                "%s: joining over %s failed (%s); asking for %s", self.engine_id, joining.name, err, joining.fallback
            )
            self.stats["disk_fallbacks"] += 1
            reply = self._request(
                WeightRequest(engine_id=self.engine_id, have_version=have, transport=joining.fallback)
            )
            self._load(reply.version, self._loader(reply.transport).join(engine, self.engine_id, reply, have))

    def _load(self, version: int, load: Callable[[], None] | None) -> None:
        """Run one load and confirm it (or its failure) to the learner; a failure is re-raised. None:
        nothing to load (the engine already serves that version)."""
        if load is None:
            return
        start = time.monotonic()
        try:
            with self._syncing():
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

    def _syncing(self):
        return self.timeline.span("syncing") if self.timeline is not None else contextlib.nullcontext()

    def _confirm(self, version: int, *, ok: bool, seconds: float, error: str = "") -> None:
        rec = WeightsLoaded(engine_id=self.engine_id, version=version, ok=ok, error=error, seconds=seconds)
        try:
            self._request(rec, timeout_s=self.confirm_timeout_s)
        except WeightSyncError as err:  # the learner may be restarting; the version is loaded either way
            log.warning("%s: confirming version %d: %s", self.engine_id, version, err)

    def _apply(self, ann: WeightAnnouncement) -> None:
        engine = self.engine
        applying = self._loader(ann.transport)
        if engine is None or ann.version <= applying.newest(engine):  # announced before this engine joined
            self.stats["skipped"] += 1
            return
        try:
            with self._syncing():  # receiving (a broadcast, a copy) is part of the sync
                load = applying.receive(engine, ann)
            if load is None:  # the transport reaches this engine only through a new request
                self._join()
            else:
                self._load(ann.version, load)
        except (EngineError, WeightSyncError, ValueError, RuntimeError) as err:
            log.warning("%s: version %d not loaded: %s", self.engine_id, ann.version, err)
            applying.detach()  # the learner dropped (or will drop) its link: rejoin
            if engine.health().alive:
                try:
                    self._join()
                except (EngineError, WeightSyncError, ValueError, RuntimeError) as again:
                    self.last_error = f"rejoin failed: {again}"
                    log.warning("%s: rejoin failed: %s", self.engine_id, again)
