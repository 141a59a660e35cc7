"""The driver's typed handles on running actors: one class per role, with the role's control calls
as methods and its health record as the answer to `health()`.

A handle hides whether the actor runs in the driver's process or as a Ray actor: each method names
the actor's own method (an attribute, not a string) and `_invoke` calls it directly or through Ray
with a timeout. Only control travels this way: start, stop, health, a few commands, small reports.
Records (tasks, episodes, batches, weights, metrics) move over the actors' ZMQ channels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.base import ActorHealth
from actors.buffer.health import LedgerIds, ReplayHealth
from actors.learner.health import LearnerHealth
from actors.rollout.evaluation import EvalAttempt
from actors.rollout.health import RolloutHealth
from actors.verifier.health import VerifierHealth

if TYPE_CHECKING:
    from launch.driver.supervisor import ActorSpec

CALL_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 30.0


@dataclass
class ActorHandle:
    """One running actor, whichever way it runs."""

    spec: ActorSpec
    ref: Any  # the in-process object, or the Ray actor handle
    ray: bool
    endpoints: dict[str, str] = field(default_factory=dict)  # what start() returned (for logs)
    restarts: int = 0
    vigil: Any = field(default=None, repr=False)  # Ray: the pending `Actor.vigil()` call (keep_vigil)
    end_seen: bool = False  # ended() said so already: it says so once

    @property
    def name(self) -> str:
        return self.spec.name

    def _invoke(self, method: Callable, *args, timeout_s: float = CALL_TIMEOUT_S):
        """Call one of the actor's methods (`self.ref.<method>`): directly in-process, through Ray
        (waiting at most `timeout_s`) otherwise."""
        if not self.ray:
            return method(*args)
        import ray

        return ray.get(method.remote(*args), timeout=timeout_s)

    def start(self) -> dict[str, str]:
        return self._invoke(self.ref.start) or {}

    def stop(self, timeout_s: float = 60.0) -> None:
        self._invoke(self.ref.stop, timeout_s=timeout_s)

    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> ActorHealth:
        return self._invoke(self.ref.health, timeout_s=timeout_s)

    def keep_vigil(self) -> None:
        """Watch for the actor's end from now on (after its start()): with Ray, a call to its `vigil()`
        that is left pending, and ends when the actor stops or its process dies. A class without one
        is seen dead at the periodic health check only."""
        if self.ray and hasattr(self.ref, "vigil"):  # not every class the supervisor runs is an `Actor`
            self.vigil = self.ref.vigil.remote()

    def ended(self) -> bool:
        """True, once, when the actor has ended since it started (stopped, died, or its work threads
        ended). Cheap: with Ray a local look at the pending vigil, in-process a flag and the threads."""
        if self.end_seen:
            return False
        if self.ray:
            import ray

            self.end_seen = self.vigil is not None and bool(ray.wait([self.vigil], timeout=0)[0])
        elif hasattr(self.ref, "ended"):
            self.end_seen = self.ref.ended()
        return self.end_seen

    def kill(self) -> None:
        """Kill the actor without a clean stop (fault injection; a Ctrl-C uses stop)."""
        if self.ray:
            import ray

            ray.kill(self.ref, no_restart=True)
        else:
            self.ref.stop()

    def discard(self) -> None:
        """Make sure a Ray actor's process is gone (after a stop, or when it died)."""
        if self.ray:
            import ray

            try:
                ray.kill(self.ref, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already gone, however Ray words it
                pass


class ReplayHandle(ActorHandle):
    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> ReplayHealth:
        return super().health(timeout_s)

    def release_actor(self, name: str, timeout_s: float = COMMAND_TIMEOUT_S) -> int:
        """Re-issue the groups a dead rollout actor held; returns how many."""
        return self._invoke(self.ref.release_actor, name, timeout_s=timeout_s)

    def ledger_ids(self, timeout_s: float = COMMAND_TIMEOUT_S) -> LedgerIds:
        """Every stored episode id by status, and the rolled-back version ranges."""
        return self._invoke(self.ref.ledger_ids, timeout_s=timeout_s)

    def release_earlier_session(self, timeout_s: float = COMMAND_TIMEOUT_S) -> int:
        """Re-issue every group an earlier session's rollout actors held (a resumed run); returns how many."""
        return self._invoke(self.ref.release_earlier_session, timeout_s=timeout_s)


class LearnerHandle(ActorHandle):
    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> LearnerHealth:
        return super().health(timeout_s)

    def drop_engine(self, name: str, *, stopped: bool = False, timeout_s: float = COMMAND_TIMEOUT_S) -> bool:
        """Stop pushing weights to a dead rollout actor's engine (`stopped`: one the run stopped)."""
        return self._invoke(self.ref.drop_engine, name, stopped, timeout_s=timeout_s)

    def checkpoint(self, timeout_s: float = 300.0) -> str:
        return self._invoke(self.ref.checkpoint, timeout_s=timeout_s)

    def export_hf(self, path: str, timeout_s: float = CALL_TIMEOUT_S) -> str:
        return self._invoke(self.ref.export_hf, path, timeout_s=timeout_s)


class RolloutHandle(ActorHandle):
    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> RolloutHealth:
        return super().health(timeout_s)

    def evaluate(self, timeout_s: float = CALL_TIMEOUT_S) -> list[EvalAttempt]:
        """Evaluate the current weights on the validation split; returns the verified attempts."""
        return self._invoke(self.ref.evaluate, timeout_s=timeout_s)


class VerifierHandle(ActorHandle):
    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> VerifierHealth:
        return super().health(timeout_s)
