"""The verifier pool behind the service: `verifier.*`'s reward actor (the kernel verifier by default)
in VerifierActors of this process, `serve.verifiers` of them. Each has its own sandboxes; all share
one verdict cache (`verifier.cache_dir`, on disk), so every client's repeat of a candidate is answered
from it. A job goes to the live verifier with the fewest jobs in hand.

A verifier that stops while it holds a job (`stop`, as a dead one would) raises WorkerDied for it, and
the dispatcher retries the job once on another (dispatch.py)."""

from __future__ import annotations

import threading

from actors.verifier.actor import VerifierActor
from configs import VerifierConfig
from launch.serve.dispatch import WorkerDied
from protocols import VerifyRequest, VerifyResult


class InProcessVerifiers:
    def __init__(self, cfg: VerifierConfig, count: int) -> None:
        self.actors = [VerifierActor(cfg) for _ in range(count)]
        for actor in self.actors:
            actor.start()
        self.workers = count * cfg.max_concurrent_requests
        self._held = [0] * count
        self._next = 0
        self._lock = threading.Lock()

    def verify(self, request: VerifyRequest, timeout_s: float) -> VerifyResult:
        """One verdict; WorkerDied when the verifier stopped before answering, or none is running. The
        deadline is the dispatcher's to keep (it answers the client when it passes); the actor's own
        guard (`verifier.reward_timeout_s`) bounds the call."""
        with self._lock:
            live = [i for i, a in enumerate(self.actors) if not a.stopping]
            if not live:
                raise WorkerDied("no verifier is running")
            turn = self._next
            self._next += 1
            i = min(live, key=lambda k: (self._held[k], (k - turn) % len(self.actors)))
            self._held[i] += 1
        actor = self.actors[i]
        try:
            result = actor.verify(request)
        finally:
            with self._lock:
                self._held[i] -= 1
        if actor.stopping:  # its answer came from a verifier being torn down: not one to trust
            raise WorkerDied(f"verifier {i} stopped while it held the request")
        return result

    def stop(self, i: int) -> None:
        """Stop verifier `i` (an operator's drain; what the tests kill)."""
        self.actors[i].stop()

    def live(self) -> int:
        return sum(not a.stopping for a in self.actors)

    def close(self) -> None:
        for actor in self.actors:
            if not actor.stopping:
                actor.stop()
