"""Start Kiln's actors in-process or as Ray actors, and keep them alive.

The driver describes each actor by an `ActorSpec` (its class, a factory for its constructor
arguments, and its Ray resources). `Supervisor.launch` builds it and calls `start()`, which returns
its endpoints. `Supervisor.check` finds the dead ones (a Ray actor that died, or an in-process actor
whose threads stopped) and starts them again from the same spec; the factory runs again, so a
restarted actor is wired to the current endpoints of its peers. Ray places and supervises; records
move over the actors' own ZMQ channels, never through Ray.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.base import as_ray_actor

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 30.0


@dataclass
class ActorSpec:
    name: str  # unique, e.g. "rollout-1"
    cls: type
    kwargs: Callable[[], dict[str, Any]]  # constructor arguments, built at each (re)start
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    restartable: bool = True
    after_start: Callable[["Handle"], None] | None = None  # e.g. start the learner's loop


@dataclass
class Handle:
    """One running actor, whichever way it runs."""

    spec: ActorSpec
    ref: Any  # the in-process object, or the Ray actor handle
    ray: bool
    endpoints: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    def call(self, method: str, *args, timeout_s: float = CALL_TIMEOUT_S, **kwargs):
        if not self.ray:
            return getattr(self.ref, method)(*args, **kwargs)
        import ray

        return ray.get(getattr(self.ref, method).remote(*args, **kwargs), timeout=timeout_s)

    def kill(self) -> None:
        """Kill the actor without a clean stop (fault-injection tests; a Ctrl-C uses stop)."""
        if self.ray:
            import ray

            ray.kill(self.ref, no_restart=True)
        else:
            self.ref.stop()


class Supervisor:
    def __init__(self, use_ray: bool) -> None:
        self.use_ray = use_ray
        self.handles: dict[str, Handle] = {}
        self.restarts: list[tuple[float, str]] = []

    def launch(self, spec: ActorSpec) -> Handle:
        if self.use_ray:
            cls = as_ray_actor(spec.cls, num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_concurrency=8)
            ref = cls.options(name=None).remote(**spec.kwargs())
        else:
            ref = spec.cls(**spec.kwargs())
        handle = Handle(spec=spec, ref=ref, ray=self.use_ray)
        handle.endpoints = handle.call("start") or {}
        if spec.after_start is not None:
            spec.after_start(handle)
        previous = self.handles.get(spec.name)
        if previous is not None:
            handle.restarts = previous.restarts + 1
        self.handles[spec.name] = handle
        log.info("started %s %s", spec.name, handle.endpoints)
        return handle

    def __getitem__(self, name: str) -> Handle:
        return self.handles[name]

    def role(self, prefix: str) -> list[Handle]:
        return [h for name, h in self.handles.items() if name.startswith(prefix)]

    def alive(self, handle: Handle) -> bool:
        try:
            health = handle.call("health", timeout_s=HEALTH_TIMEOUT_S)
        except Exception as err:  # RayActorError, a timeout: the actor is gone or wedged
            log.warning("%s: health check failed: %s", handle.spec.name, err)
            return False
        if health.get("finished"):  # done with its work, not dead
            return True
        return bool(health.get("alive", False)) and health.get("looping", True) is not False

    def check(self, on_restart: Callable[[str], None] | None = None) -> list[str]:
        """Restart every dead restartable actor; returns their names."""
        restarted = []
        for name, handle in list(self.handles.items()):
            if not handle.spec.restartable or self.alive(handle):
                continue
            log.error("%s died; restarting it", name)
            self._discard(handle)
            self.launch(handle.spec)
            self.restarts.append((time.time(), name))
            restarted.append(name)
            if on_restart is not None:
                on_restart(name)
        return restarted

    def stop_all(self, order: list[str]) -> None:
        """Stop actors by role prefix in `order`, then any left."""
        names = [n for prefix in order for n in self.handles if n.startswith(prefix)]
        names += [n for n in self.handles if n not in names]
        for name in names:
            handle = self.handles[name]
            try:
                handle.call("stop", timeout_s=60.0)
            except Exception as err:
                log.warning("%s: stop failed: %s", name, err)
            self._discard(handle)
        self.handles.clear()

    def _discard(self, handle: Handle) -> None:
        if handle.ray:
            import ray

            try:
                ray.kill(handle.ref, no_restart=True)
            except Exception:
                pass
