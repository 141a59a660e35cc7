"""The verifier pool behind the service: `verifier.*`'s reward actor (the kernel verifier by default)
in `serve.verifiers` VerifierActors, in the service's process (`InProcessVerifiers`) or as Ray actors
on the cluster (`RayVerifiers`, `serve.pool: ray`). Each has its own sandboxes; all share one verdict
cache (`verifier.cache_dir`, on disk: on a cluster, a shared directory), so every client's repeat of a
candidate is answered from it. A job goes to the live verifier with the fewest jobs in hand.

A verifier that dies while it holds a job (a Ray actor killed; an in-process one stopped) raises
WorkerDied for it, and the dispatcher retries the job once on another (dispatch.py). A dead Ray
actor is replaced by a new one in the background: the fleet keeps its size."""

from __future__ import annotations

import logging
import threading

from actors.base import as_ray_actor
from actors.verifier.actor import VerifierActor
from configs import VerifierConfig
from launch.serve.dispatch import WorkerDied
from protocols import VerifyRequest, VerifyResult

log = logging.getLogger(__name__)


class _Turns:
    """Which of `count` verifiers takes the next job: the live one with the fewest jobs in hand (ties
    in turn). `hold()` picks and counts it; `release(i)` when its job is done."""

    def __init__(self, count: int) -> None:
        self._held = [0] * count
        self._next = 0
        self._lock = threading.Lock()
        self._holder: dict[str, int] = {}  # request id -> the verifier its job is on (cancel)

    def hold(self, live: list[int]) -> int:
        with self._lock:
            if not live:
                raise WorkerDied("no verifier is running")
            turn = self._next
            self._next += 1
            i = min(live, key=lambda k: (self._held[k], (k - turn) % len(self._held)))
            self._held[i] += 1
            return i

    def holds(self, request_id: str, i: int) -> None:
        """Note that verifier `i` runs `request_id` (after `hold`)."""
        with self._lock:
            self._holder[request_id] = i

    def holder(self, request_id: str) -> int | None:
        with self._lock:
            return self._holder.get(request_id)

    def release(self, i: int, request_id: str | None = None) -> None:
        with self._lock:
            self._held[i] -= 1
            if request_id is not None and self._holder.get(request_id) == i:
                del self._holder[request_id]

    def holding(self) -> list[int]:
        """Jobs in hand per verifier."""
        with self._lock:
            return list(self._held)


class InProcessVerifiers:
    def __init__(self, cfg: VerifierConfig, count: int) -> None:
        self.actors = [VerifierActor(cfg) for _ in range(count)]
        for actor in self.actors:
            actor.start()
        self.workers = count * cfg.max_concurrent_requests
        self.turns = _Turns(count)

    def verify(self, request: VerifyRequest, timeout_s: float) -> VerifyResult:
        """One verdict; WorkerDied when the verifier stopped before answering, or none is running. The
        deadline is the dispatcher's to keep (it answers the client when it passes, and cancels the
        work: `cancel`); the actor's own guard (`verifier.reward_timeout_s`) bounds the call."""
        i = self.turns.hold([k for k, a in enumerate(self.actors) if not a.stopping])
        actor = self.actors[i]
        self.turns.holds(request.request_id, i)
        try:
            result = actor.verify(request)
        finally:
            self.turns.release(i, request.request_id)
        if actor.stopping:  # its answer came from a verifier being torn down: not one to trust
            raise WorkerDied(f"verifier {i} stopped while it held the request")
        return result

    def cancel(self, request_id: str) -> None:
        """Cancel the work on `request_id` in the verifier that holds it (its reward actor's hook)."""
        i = self.turns.holder(request_id)
        if i is not None:
            self.actors[i].cancel(request_id)

    def stop(self, i: int) -> None:
        """Stop verifier `i` (an operator's drain; what the tests kill)."""
        self.actors[i].stop()

    def live(self) -> int:
        return sum(not a.stopping for a in self.actors)

    def close(self) -> None:
        for actor in self.actors:
            if not actor.stopping:
                actor.stop()


class RayVerifiers:
    """`count` VerifierActors as Ray actors (Ray started, or joined at `cluster.address`, by the caller)."""

    def __init__(self, cfg: VerifierConfig, count: int) -> None:
        import ray

        # One GPU each on cuda (that spreads them over the cluster's GPUs); no CPU reservation: a
        # verifier sizes its compile pool to its node's cores itself (verifier.compile_workers). Every
        # call is a thread of the actor's, as many as its workers, and one more for health and stop.
        gpus = 1 if cfg.backend == "cuda" else 0
        self._cls = as_ray_actor(
            VerifierActor, num_cpus=0, num_gpus=gpus, max_restarts=0, max_concurrency=cfg.max_concurrent_requests + 1
        )
        self.cfg = cfg
        self.handles = [self._cls.remote(cfg) for _ in range(count)]
        ray.get([h.start.remote() for h in self.handles])
        self.workers = count * cfg.max_concurrent_requests
        self.turns = _Turns(count)
        self._dead = [False] * count
        self._lock = threading.Lock()

    def verify(self, request: VerifyRequest, timeout_s: float) -> VerifyResult:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        with self._lock:
            live = [k for k in range(len(self.handles)) if not self._dead[k]]
        i = self.turns.hold(live)
        handle = self.handles[i]
        self.turns.holds(request.request_id, i)
        try:
            return ray.get(handle.verify.remote(request), timeout=timeout_s)
        except RayActorError as err:
            self._replace(i, handle)
            raise WorkerDied(f"verifier {i} died: {str(err).splitlines()[0][:200]}") from None
        except GetTimeoutError:  # the dispatcher has answered the deadline and cancelled the work
            raise WorkerDied(f"verifier {i} did not answer within the deadline") from None
        finally:
            self.turns.release(i, request.request_id)

    def cancel(self, request_id: str) -> None:
        """Cancel the work on `request_id` in the actor that holds it; not waited for (an actor that
        died meanwhile has nothing left to cancel)."""
        i = self.turns.holder(request_id)
        if i is not None:
            self.handles[i].cancel.remote(request_id)

    def _replace(self, i: int, dead) -> None:
        """Start a new actor in slot `i` (once per death), off the job's thread."""
        with self._lock:
            if self.handles[i] is not dead or self._dead[i]:
                return
            self._dead[i] = True

        def start() -> None:
            import ray

            try:
                handle = self._cls.remote(self.cfg)
                ray.get(handle.start.remote())
            except Exception:
                log.exception("serve: replacing verifier %d failed", i)
                return
            with self._lock:
                self.handles[i], self._dead[i] = handle, False
            log.info("serve: verifier %d replaced", i)

        threading.Thread(target=start, name=f"serve-replace{i}", daemon=True).start()

    def kill(self, i: int) -> None:
        """Kill verifier `i`'s actor (what the tests and the fault benchmark do)."""
        import ray

        ray.kill(self.handles[i], no_restart=True)

    def live(self) -> int:
        with self._lock:
            return self._dead.count(False)

    def close(self) -> None:
        import ray

        for handle in self.handles:
            try:
                ray.get(handle.stop.remote(), timeout=30)
                ray.kill(handle)
            except Exception:  # noqa: BLE001, S110 - an actor already dead has nothing to stop
                pass
