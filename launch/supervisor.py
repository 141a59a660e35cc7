"""Start Kiln's actors in-process or as Ray actors, and keep them alive.

The driver describes each actor by an `ActorSpec` (its class, a factory for its constructor
arguments, and its Ray resources). `Supervisor.launch` builds it and calls `start()`, which returns
its endpoints. `Supervisor.check` finds the dead ones (a Ray actor that died, or an in-process actor
whose threads stopped) and starts them again from the same spec; the factory runs again, so a
restarted actor is wired to the current endpoints of its peers. Ray places and supervises; records
move over the actors' own ZMQ channels, never through Ray.

Actors that only work together (the ranks of one learner: each `start()` blocks until all have
joined, and a dead rank stalls the others' collectives) share a `group`: `launch_group` builds them
all before starting any, and when one dies `check` restarts the whole group.
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
    group: str | None = None  # actors that start, die and restart together (a learner's ranks)


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
        return self.launch_group([spec])[0]

    def launch_group(self, specs: list[ActorSpec]) -> list[Handle]:
        """Build every actor, then start them all at once (in-process: one after the other) and wait."""
        handles = [Handle(spec=spec, ref=self._build(spec), ray=self.use_ray) for spec in specs]
        if self.use_ray and len(handles) > 1:
            import ray

            replies = ray.get([h.ref.start.remote() for h in handles], timeout=CALL_TIMEOUT_S)
        else:
            replies = [h.call("start") for h in handles]
        for handle, endpoints in zip(handles, replies):
            handle.endpoints = endpoints or {}
            previous = self.handles.get(handle.spec.name)
            if previous is not None:
                handle.restarts = previous.restarts + 1
            self.handles[handle.spec.name] = handle
            log.info("started %s %s", handle.spec.name, handle.endpoints)
        for handle in handles:
            if handle.spec.after_start is not None:
                handle.spec.after_start(handle)
        return handles

    def _build(self, spec: ActorSpec):
        if self.use_ray:
            cls = as_ray_actor(spec.cls, num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_concurrency=8)
            return cls.options(name=None).remote(**spec.kwargs())
        return spec.cls(**spec.kwargs())

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

    def check(self, on_restart: Callable[[str], None] | None = None,
              on_death: Callable[[str], None] | None = None) -> list[str]:
        """Restart every dead restartable actor; returns their names. `on_death(name)` runs once the dead
        actor is gone and before its replacement starts, `on_restart(name)` after."""
        restarted = []
        for name, handle in list(self.handles.items()):
            if name in restarted or not handle.spec.restartable or self.alive(handle):
                continue
            group = self.group_of(handle)
            log.error("%s died; restarting %s", name, ", ".join(h.spec.name for h in group))
            for member in group:  # live ranks would wait in collectives with the dead one: kill them too
                self._discard(member)
                if on_death is not None:
                    on_death(member.spec.name)
            self.launch_group([h.spec for h in group])
            for member in group:
                self.restarts.append((time.time(), member.spec.name))
                restarted.append(member.spec.name)
                if on_restart is not None:
                    on_restart(member.spec.name)
        return restarted

    def group_of(self, handle: Handle) -> list[Handle]:
        """`handle` and the actors it starts and restarts with, in launch order."""
        if handle.spec.group is None:
            return [handle]
        return [h for h in self.handles.values() if h.spec.group == handle.spec.group]

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
