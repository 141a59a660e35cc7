"""`VerifierActor`: serves VerifyRequest -> VerifyResult over a ZMQ ROUTER (the reward service, docs/architecture.md).

It wraps the reward actor named by `verifier.reward_actor` (the kernel verifier by default), loaded
when the actor is constructed so a bad dotted path fails at start-up with a clear message.

Concurrency: one thread owns the ROUTER socket (zmq sockets are not thread-safe). It receives
requests into a queue that `verifier.max_concurrent_requests` worker threads drain, and it sends the replies those
workers put into an outbox, in whatever order they finish (ROUTER replies go to the right peer
whatever the order). With the kernel verifier, compiles of later requests (a CPU process pool) thus
overlap the execution of earlier ones, and the GPU never waits on nvcc. A request resent by a
client while still in flight is not verified twice.

It registers its address in the run's registry under its name (role "verifier"); rollout actors send
to every registered verifier as one pool and pick up a restarted one from the registry.

Timeline: every verification is recorded as "verifying" (protocols.timeline), pushed to the driver;
`busy_s` is the time with at least one verification under way.

Benchmarks: `verifier.modelled_latency` (off by default) adds a long-tailed sleep after each
verification, standing in for GPU-side work on a CPU machine (actors/verifier/latency.py).

Guard: each verify() runs on its own thread under `verifier.reward_timeout_s`. An exception, a hang, or a
return value that is not a valid VerifyResult for that request becomes an `infra` result (score 0;
replay excludes infra results from training), and the actor keeps serving.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future

from actors.base import Actor, RunContext, load_plugin
from actors.verifier.health import LATENCY_BUCKETS, VerifierHealth, latency_bucket
from actors.verifier.interface import DEFAULT_REWARD_ACTOR, RewardActor
from actors.verifier.latency import ModelledLatency
from actors.verifier.workers import compile_workers
from configs import VerifierConfig
from protocols import ErrorReply, ProtocolError, VerifyRequest, VerifyResult, encode, infra_result
from protocols.channels import ReplyServer, Request
from protocols.timeline import SpanRecorder

log = logging.getLogger(__name__)


class VerifierActor(Actor):
    role = "verifier"

    def __init__(self, cfg: VerifierConfig, ctx: RunContext | None = None) -> None:
        """Without a run context (tools, tests) it serves on loopback and registers nowhere."""
        super().__init__(ctx)
        if cfg.compile_workers == 0:  # follow the node's cores, shared by the run's verifiers
            cfg = dataclasses.replace(cfg, compile_workers=compile_workers(0, ctx.world_size if ctx else 1).count)
        self.cfg, self.ctx = cfg, ctx
        self.reward_cls = load_plugin(
            cfg.reward_actor or DEFAULT_REWARD_ACTOR, RewardActor, key="verifier.reward_actor"
        )
        self.timeout_s = cfg.reward_timeout_s or (cfg.compile_timeout_s + cfg.run_timeout_s + 120.0)
        self.impl = None
        self._warm_thread: threading.Thread | None = None
        self.server: ReplyServer | None = None
        self._work: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._inflight: set[tuple[bytes, bytes]] = set()
        self.stats = {
            "received": 0,
            "replied": 0,
            "infra": 0,
            "hung": 0,
            "rejected": 0,
            "compiled": 0,
            "modelled_s": 0.0,
        }
        self._latency_counts = [0] * LATENCY_BUCKETS  # verifications by slot time (health.latency_bucket)
        self._stats_lock = threading.Lock()
        self.latency = ModelledLatency(cfg.modelled_latency, rank=ctx.rank if ctx is not None else 0)
        metrics = ctx.registry.address("driver", "metrics") if ctx is not None else ""
        self.timeline = SpanRecorder(ctx.name if ctx is not None else "verifier", metrics or None)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, str]:
        # An opt-in class attribute (interface.py), not a signature sniff; a plug-in that does not
        # subclass RewardActor lacks it and is constructed as before.
        placed = {"slot": self.ctx.slot if self.ctx else None} if getattr(self.reward_cls, "takes_slot", False) else {}
        self.impl = self.reward_cls(self.cfg, **self.cfg.reward_actor_args, **placed)
        self._warm_thread = self.spawn(self.impl.warm, "warm")
        if self.ctx is not None:
            b = self.ctx.bind
            self.server = ReplyServer(b.host, b.transport, b.advertise)
        else:
            self.server = ReplyServer()
        self.spawn(self._serve_socket, "router")
        for i in range(self.cfg.max_concurrent_requests):
            self.spawn(self._worker, f"worker{i}")
        if self.ctx is not None:
            self.ctx.registry.register(self.ctx.name, self.role, {"verifier": self.server.address})
        return {"verifier": self.server.address}

    def stop(self) -> None:
        super().stop()
        self.timeline.close()
        if self.server is not None:
            self.server.close()
        if self.impl is not None:
            try:
                self.impl.close()
            except Exception:
                log.exception("verifier: reward actor close() failed")

    def cancel(self, request_id: str) -> bool:
        """End the reward actor's call on `request_id` early, through its `cancel` hook where it has
        one (a service whose deadline for the call passed); callable directly and through Ray. A hook
        that raises cancels nothing: the call runs to its end."""
        hook = getattr(self.impl, "cancel", None)
        if hook is None:
            return False
        try:
            return bool(hook(request_id))
        except Exception:
            log.exception("verifier: reward actor cancel() failed")
            return False

    def health(self) -> VerifierHealth:
        with self._stats_lock:
            stats = dict(self.stats)
            latency_counts = tuple(self._latency_counts)
        return VerifierHealth(
            role=self.role,
            alive=not self.stopping,
            looping=self.threads_running,
            busy_s=self.timeline.busy_s(),
            address=self.server.address if self.server else "",
            **stats,
            queued=self._work.qsize(),
            inflight=len(self._inflight),
            reward_actor=f"{self.reward_cls.__module__}.{self.reward_cls.__qualname__}",
            warming=self._warm_thread is not None and self._warm_thread.is_alive(),
            latency_counts=latency_counts,
        )

    # --------------------------------------------------------------------------------- serving

    def _serve_socket(self) -> None:
        while not self.stopping:
            req = self.server.recv(timeout_s=0.005)
            if req is not None:
                self._accept(req)
            while True:
                try:
                    done, answer = self._outbox.get_nowait()
                except queue.Empty:
                    break
                self._count("replied")  # before the send: a client that has its answer sees it counted
                self._inflight.discard((done.peer, done.corr))
                self.server.reply(done, answer)

    def _accept(self, req: Request) -> None:
        if not isinstance(req.record, VerifyRequest):
            self._count("rejected")
            self.server.reply(
                req, ErrorReply(message=f"the verifier answers VerifyRequest, not {type(req.record).__name__}")
            )
            return
        key = (req.peer, req.corr)
        if key in self._inflight:  # a client resent a request we are still working on
            return
        self._inflight.add(key)
        self._count("received")
        self._work.put(req)

    def _worker(self) -> None:
        while not self.stopping:
            try:
                req = self._work.get(timeout=0.1)
            except queue.Empty:
                continue
            self._outbox.put((req, self.verify(req.record)))

    def verify(self, request: VerifyRequest) -> VerifyResult:
        """Run the reward actor on one request under the guard (also callable directly / via Ray), then
        sleep the modelled GPU-side latency if one is configured; all of it is "verifying" and counts
        in the latency histogram."""
        started = time.perf_counter()
        with self.timeline.span("verifying"):
            result = self._guarded(request)
            if result.error_class != "infra":
                self._model_gpu_work()
        bucket = latency_bucket(time.perf_counter() - started)
        with self._stats_lock:
            self._latency_counts[bucket] += 1
        return result

    def _model_gpu_work(self) -> None:
        seconds = self.latency.draw()
        if seconds > 0:
            self._stop.wait(seconds)
            with self._stats_lock:
                self.stats["modelled_s"] += seconds

    def _guarded(self, request: VerifyRequest) -> VerifyResult:
        done: Future = Future()

        def call() -> None:
            try:
                done.set_result(self.impl.verify(request))
            except BaseException as err:  # noqa: BLE001 - any failure of a plug-in becomes infra
                done.set_exception(err)

        threading.Thread(target=call, name="kiln-verifier-call", daemon=True).start()
        try:
            result = done.result(timeout=self.timeout_s)
        except TimeoutError:
            self._count("hung")
            return self._infra(request, f"the reward actor did not answer within {self.timeout_s:g} s")
        except BaseException as err:
            log.exception("verifier: reward actor raised on %s", request.request_id)
            return self._infra(request, f"the reward actor raised {type(err).__name__}: {err}")
        problem = validate_result(result, request)
        if problem:
            return self._infra(request, f"the reward actor returned an invalid result: {problem}")
        if compiled(result):
            self._count("compiled")
        return result

    def _infra(self, request: VerifyRequest, message: str) -> VerifyResult:
        self._count("infra")
        return infra_result(request, message)

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self.stats[key] += 1


def compiled(result: VerifyResult) -> bool:
    """Whether the verification ran a real compile: the kernel verifier reports its build stage in
    `timings["compile"]` and whether the build came from its cache in `diagnostics["build"]`."""
    build = result.diagnostics.get("build") if not result.cached else None
    return "compile" in result.timings and isinstance(build, dict) and build.get("cached") is False


def validate_result(result, request: VerifyRequest) -> str:
    """'' when `result` is a valid VerifyResult answering `request`, else what is wrong with it."""
    if not isinstance(result, VerifyResult):
        return f"expected a VerifyResult, got {type(result).__name__}"
    try:
        encode(result)  # every field's type and the record's own cross-field rules
    except ProtocolError as err:
        return str(err)
    if result.request_id != request.request_id or result.task_id != request.task.task_id:
        return (
            f"it answers request {result.request_id!r} / task {result.task_id!r}, not "
            f"{request.request_id!r} / {request.task.task_id!r}"
        )
    if not math.isfinite(result.score):
        return f"score {result.score} is not a finite number"
    return ""
