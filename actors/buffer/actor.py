"""The replay actor (docs/replay.md): one ReplyServer that serves the task feed, episode intake and the
learner's batches, with every state change made durable before its reply.

    TaskRequest         -> TaskReply     (a task to sample G times, wait with retry_after_s, or stop)
    Episode             -> EpisodeAck    (stored / duplicate / rejected with a reason)
    BatchRequest        -> BatchReply    (a TrainBatch for the learner's version, wait, or stop)
    TaskListRequest     -> TaskList      (a whole split: the warm start's and the evaluation's tasks)
    VersionsSeenRequest -> VersionsSeen  (the highest version seen: a restored learner starts above it)
    anything else       -> ErrorReply

It registers its address as "replay" in the run's registry, where rollouts and the learner look it up.

The serving loop takes every request that is ready, applies them in order to the `ReplayState`,
appends the ones that changed the state to the write-ahead log, fsyncs once (group commit), and only
then replies. A request told to wait (the admission bound is reached, no batch is ready) is held for
up to `replay.retry_after_s` and tried again whenever the state changes, so the rollout or learner
waiting on it hears the moment it can go on instead of at its next ask; a request still waiting at
the end of its hold is told to ask again at once. The rollout actors' requests for more groups also
wait while their actor holds its share of the admission window (actors/buffer/shares.py). So an acknowledged episode is on disk and a handed-out group or batch is remembered,
and a kill -9 at any point loses nothing that anyone was told about. If the disk fails, the actor
stops accepting work (fail-stop: every request gets an ErrorReply) rather than acknowledge what it
cannot keep; a restart recovers the last durable state.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import msgpack
import numpy as np

import protocols
from actors.base import Actor, RunContext
from actors.buffer.health import Latency, LedgerIds, ReplayHealth, replay_health
from actors.buffer.shares import AdmissionShares
from actors.buffer.state import ReplayState
from actors.buffer.storage import EntryKind, ReplayStore
from actors.buffer.task_source import load_task_set
from configs import AlgoConfig, ConfigError, ReplayConfig
from protocols import (
    BatchReply,
    BatchRequest,
    Episode,
    ErrorReply,
    Record,
    TaskListRequest,
    TaskReply,
    TaskRequest,
    VersionsSeenRequest,
)
from protocols.channels import ReplyServer, Request

log = logging.getLogger(__name__)

MAX_GROUP_COMMIT = 64  # requests applied per fsync at most, so one burst cannot delay replies for long
EXPIRY_CHECK_S = 1.0  # at most this long between expiry checks (sooner for short timeouts)


class ReplayActor(Actor):
    role = "replay"

    def __init__(
        self, replay: ReplayConfig, algo: AlgoConfig, ctx: RunContext, *, backend: str = "cpu", poll_s: float = 0.05
    ) -> None:
        """`backend` is the verifier's kernel backend: the task set holds the tasks it can run."""
        super().__init__(ctx)
        if algo.group_size < 2:  # the schema's bound too; also refused here for configs built in code
            raise ConfigError(
                f"algo.group_size={algo.group_size}: group-normalised advantages need at least 2 samples per group"
            )
        self.replay, self.algo, self.ctx = replay, algo, ctx
        self.dir = ctx.path / "replay"
        self._poll_s = poll_s
        self._state = ReplayState(replay, algo, load_task_set(replay, backend))
        self._store = ReplayStore(self.dir)
        self._lock = threading.Lock()
        self._server: ReplyServer | None = None
        self.address = ""
        self._failure = ""  # set when the disk failed: the actor then refuses all work
        self._handler_errors = 0
        self._ack_latency_s: collections.deque[float] = collections.deque(maxlen=20_000)
        self._next_expiry_check = 0.0
        self._shares = AdmissionShares.for_retry_interval(replay.retry_after_s)
        self._changed = False  # the state changed since the held requests were last tried
        self._incarnations: dict[str, str] = {}  # rollout actor id -> the process that last asked under it
        self._released: set[str] = set()  # processes whose groups were released: dead, never given a group
        self.recovered = self._recover()

    # ------------------------------------------------------------------------------- lifecycle

    def start(self) -> dict[str, str]:
        b = self.ctx.bind
        self._server = ReplyServer(b.host, b.transport, b.advertise)
        self.address = self._server.address
        self.spawn(self._serve, "serve")
        self.ctx.registry.register(self.ctx.name or "replay", self.role, {"replay": self.address})
        log.info("replay: serving on %s (%s)", self.address, self.recovered)
        return {"replay": self.address}

    def stop(self) -> None:
        super().stop()
        with self._lock:
            if not self._failure and self._store.since_snapshot:
                try:
                    self._store.snapshot(self._state.dump())
                except OSError as err:
                    log.error("replay: final snapshot failed (the log still holds everything): %s", err)
            self._store.close()
        if self._server is not None:
            self._server.close()
            self._server = None

    def health(self) -> ReplayHealth:
        with self._lock:
            lat = np.asarray(self._ack_latency_s) * 1e3
            return replay_health(
                self._state,
                self._store,
                role=self.role,
                alive=not self.stopping,
                looping=self.threads_running,
                address=self.address,
                failure=self._failure,
                ack_latency_ms=Latency(
                    n=int(lat.size),
                    p50=float(np.percentile(lat, 50)) if lat.size else None,
                    p99=float(np.percentile(lat, 99)) if lat.size else None,
                ),
                handler_errors=self._handler_errors,
                recovered=self.recovered,
            )

    def episode_ids(self) -> dict[str, list[str]]:
        """Every stored episode id by status ('pending', 'trained', 'filtered:<reason>')."""
        with self._lock:
            return self._state.ledger.ids()

    # --------------------------------------------------------------------------------- serving

    def handle(self, rec: Record) -> Record:
        """Answer one request durably. The serving loop does the same for groups of requests; this
        entry point serves in-process drivers (the simulation, the throughput benchmark)."""
        with self._lock:
            (reply,) = self._apply_and_commit([rec], time.monotonic())
        return reply

    def _serve(self) -> None:
        server = self._server
        held: list[tuple[Request, float]] = []  # told to wait: kept, and answered once served or at their hold's end
        while not self.stopping:
            requests, received = [], {}
            first = server.recv(self._poll_s)
            while first is not None:
                requests.append(first)
                received[id(first)] = time.perf_counter()
                if len(requests) >= MAX_GROUP_COMMIT:
                    break
                first = server.recv(0)
            now = time.monotonic()
            with self._lock:
                replies = self._apply_and_commit([r.record for r in requests], now)
                self._expire_overdue(now)
                # What just arrived (the episode that completed a batch, the step that opened admission)
                # may serve a request held since: it is answered now, not when its client asks again.
                changed, self._changed = self._changed, False
                again = self._apply_and_commit([r.record for r, _ in held], now) if held and changed else []
            answers = [
                (req, until, reply) for (req, until), reply in zip(held, again or [None] * len(held), strict=True)
            ]
            answers += [
                (req, now + self.replay.retry_after_s, reply) for req, reply in zip(requests, replies, strict=True)
            ]
            held, latencies = [], []
            for req, until, reply in answers:
                if reply is None or _is_wait(reply):  # None: held, and nothing changed that could serve it
                    if now < until:
                        held.append((req, until))
                        continue
                    reply = self._answer_waited(req.record)
                server.reply(req, reply)
                if isinstance(req.record, Episode):
                    latencies.append(time.perf_counter() - received[id(req)])
            if latencies:
                with self._lock:
                    self._ack_latency_s.extend(latencies)

    def _apply_and_commit(self, records: list[Record], now: float) -> list[Record]:
        """Apply requests in order, log those that changed the state, fsync once, snapshot when due.
        Called with the lock held."""
        if self._failure or self._store.closed:
            return [self._refusal() for _ in records]
        replies = [self._apply(rec, now) for rec in records]
        try:
            self._store.commit()
        except OSError as err:  # nothing of this group is known to be durable: acknowledge none of it
            self._fail(err)
            return [self._refusal() for _ in records]
        if self._store.since_snapshot >= self.replay.snapshot_every:
            try:
                self._store.snapshot(self._state.dump())
            except OSError as err:  # these replies are durable in the log; refuse only what comes next
                self._fail(err)
        return replies

    def _apply(self, rec: Record, now: float) -> Record:
        try:
            reply, changed = self._dispatch(rec, now, live=True)
        except Exception as err:  # a bug must not take the replay down; the request was not logged
            self._handler_errors += 1
            log.exception("replay: handling %s failed", type(rec).__name__)
            return ErrorReply(message=f"replay failed to handle {type(rec).__name__}: {type(err).__name__}: {err}")
        if changed:
            self._changed = True
            try:
                self._store.append(EntryKind.RECORD, protocols.encode(rec))
            except OSError as err:
                self._fail(err)
                return self._refusal()
        return reply

    def _dispatch(self, rec: Record, now: float, live: bool = False) -> tuple[Record, bool]:
        """`live`: a request just received (not one re-applied from the log at recovery)."""
        if isinstance(rec, Episode):
            return self._state.on_episode(rec, now)
        if isinstance(rec, TaskRequest):
            return self._state.on_task_request(rec, now, (lambda: self._actor_room(rec, now)) if live else None)
        if isinstance(rec, BatchRequest):
            return self._state.on_batch_request(rec)
        if isinstance(rec, TaskListRequest):
            return self._state.on_task_list(rec), False
        if isinstance(rec, VersionsSeenRequest):
            return self._state.versions_seen(), False
        return ErrorReply(
            message=f"replay serves TaskRequest, Episode, BatchRequest, TaskListRequest and "
            f"VersionsSeenRequest, not {type(rec).__name__}"
        ), False

    def _answer_waited(self, rec: Record) -> Record:
        """The answer to a request held for its whole hold: still wait, and ask again at once."""
        cls = TaskReply if isinstance(rec, TaskRequest) else BatchReply
        return cls(status="wait", retry_after_s=0.0)

    def _actor_room(self, req: TaskRequest, now: float) -> int:
        """The attempts a live request (never a re-applied one) that the staleness bound lets in may
        start: none from a process whose groups were released (it is dead: a request of its still
        queued, or held, would open a group nobody works on until it expires), else what its actor's
        share of the running window leaves (actors/buffer/shares.py)."""
        if req.incarnation and req.incarnation in self._released:
            return 0
        if req.incarnation:
            self._incarnations[req.actor_id] = req.incarnation
        state = self._state
        return self._shares.room(
            req.actor_id, state.running_by_actor(), state.running_window, state.algo.group_size, now
        )

    def release_actor(self, actor_id: str) -> int:
        """A rollout actor died: expire the groups it was working on now (their tasks are re-issued,
        late samples from them are stored but never trained). Logged like a timeout expiry, so a
        restart replays the same decision. Returns how many groups were released."""
        with self._lock:
            self._shares.release(actor_id)
            if actor_id in self._incarnations:
                self._released.add(self._incarnations.pop(actor_id))
            if self._failure:
                return 0
            held = self._state.held_by(actor_id)
            if not held:
                return 0
            try:
                self._store.append(EntryKind.EXPIRE, msgpack.packb(held))
                self._store.commit()
            except OSError as err:
                self._fail(err)
                return 0
            self._state.expire(held)
            self._changed = True
            return len(held)

    def ledger_ids(self) -> LedgerIds:
        """Replay's side of the no-loss check: every stored id by status (launch/observe/id_check.py)."""
        with self._lock:
            return self._state.ledger_ids()

    def release_earlier_session(self) -> int:
        """A session starts its rollout actors: every group running now was handed to an actor of an
        earlier session (a driver that crashed took its actors along) and would hold its place in the
        admission window until it expired (`replay.group_timeout_s`). Release them all now; returns
        how many groups were re-issued."""
        with self._lock:
            holders = sorted({g.actor_id for g in self._state.running.values()})
        return sum(self.release_actor(actor_id) for actor_id in holders)

    def _expire_overdue(self, now: float) -> None:
        if self._failure or now < self._next_expiry_check:
            return
        self._next_expiry_check = now + min(EXPIRY_CHECK_S, self.replay.group_timeout_s / 4)
        overdue = self._state.overdue(now, self.replay.group_timeout_s)
        if not overdue:
            return
        try:  # log the decision first: expiry depends on the clock, so recovery must not re-decide it
            self._store.append(EntryKind.EXPIRE, msgpack.packb(overdue))
            self._store.commit()
        except OSError as err:
            self._fail(err)
            return
        self._state.expire(overdue)
        self._changed = True

    def _fail(self, err: OSError) -> None:
        self._failure = f"{type(err).__name__}: {err}"
        log.error("replay: storage failed, refusing all work until restarted: %s", self._failure)

    def _refusal(self) -> ErrorReply:
        if not self._failure:
            return ErrorReply(message="replay is stopped")
        return ErrorReply(message=f"replay storage failed ({self._failure}); restart the replay actor")

    # -------------------------------------------------------------------------------- recovery

    def _recover(self) -> dict:
        start = time.perf_counter()
        found = self._store.recover()
        now = time.monotonic()
        if found.snapshot is not None:
            self._state.load(found.snapshot, now)
        for kind, payload in found.entries:
            if kind == EntryKind.EXPIRE:
                self._state.expire(msgpack.unpackb(payload))
                continue
            _, changed = self._dispatch(protocols.decode(payload), now)
            if not changed:  # the handlers are deterministic, so this means a changed task set or a bug
                log.error(
                    "replay: logged %s changed nothing on re-apply; state may differ from before the restart",
                    type(protocols.decode(payload)).__name__,
                )
        return {
            "snapshot": found.snapshot is not None,
            "log_entries": len(found.entries),
            "truncated_bytes": found.truncated_bytes,
            "seconds": round(time.perf_counter() - start, 3),
        }


def _is_wait(reply: Record) -> bool:
    """A "not yet" (admission bound reached, no batch ready): held, not sent, while it may still change."""
    return isinstance(reply, (TaskReply, BatchReply)) and reply.status == "wait"
