"""Start Kiln's actors in-process or as Ray actors, and keep them alive.

The driver describes each actor by an `ActorSpec`: its class, the config sections it is built from,
its place in the run (name, rank, placement slot) and its handle type. `Supervisor.launch` builds the
actor from those and a `RunContext`, calls `start()` (the actor registers its endpoints in the run's
registry) and returns the typed handle. `Supervisor.check` finds the dead ones (a Ray actor that died,
or an actor whose work threads stopped), removes them from the registry and starts them again from
the same spec; the new actor registers its new addresses and its peers look them up. The driver runs
`check` once a second, and at once when `end_seen()` says an actor ended: each started actor has a
call to its `vigil()` pending, which ends when the actor stops or its process dies. Ray places
(each actor into its bundle of the run's placement group) and supervises; records move over the
actors' own ZMQ channels, never through Ray.

Actors that only work together (the ranks of one learner: each `start()` blocks until all have
joined, and a dead rank stalls the others' collectives) share a `group`: `launch_group` builds them
all before starting any, and when one dies `check` restarts the whole group.

An actor whose spec asks for a `standby` (a one-rank CPU learner, a rollout actor without GPUs) has a spare built next to it and
prepared ahead (`Actor.prepare()`: its process started, its imports done, its model built), holding
nothing and registering nothing. When the actor dies, `check` starts the spare instead of building a
new one, so the takeover costs only `start()` (for the learner: restore the latest checkpoint and
serve), and a new spare is prepared behind it without the driver waiting for it (with Ray).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.base import Bind, RunContext, Slot, as_ray_actor
from launch.driver.handles import CALL_TIMEOUT_S, ActorHandle
from protocols.registry import Registry

log = logging.getLogger(__name__)

# A replacement that fails to start is tried again, cold, at the next check: what it needs at start
# may be restarting too (a rollout actor joins the learner for its weights). A third failure in a row
# ends the run with its error.
MAX_START_ATTEMPTS = 3


@dataclass(frozen=True)
class ActorSpec:
    name: str  # unique, e.g. "rollout-1"; also its registry name
    cls: type
    handle: type[ActorHandle]
    args: tuple = ()  # the config sections the constructor takes before the context
    kwargs: dict[str, Any] = field(default_factory=dict)  # its keyword settings
    rank: int = 0  # index among its role's actors
    world_size: int = 1
    slot: Slot = field(default_factory=Slot)
    restartable: bool = True
    group: str | None = None  # actors that start, die and restart together (a learner's ranks)
    standby: bool = False  # keep a prepared spare that takes over when this actor dies (not for groups)
    prefer_node: str = ""  # a node label "key=value" it runs on while such a node is alive (cluster.prefer_nodes)


@dataclass
class Restart:
    """Replacements of a dead actor (or group) being started: their handles, their start() calls (Ray
    ObjectRefs; none in-process, where start() has returned) and since when."""

    handles: list[ActorHandle]
    calls: list
    since: float  # time.monotonic()
    standby: bool = False  # a spare took over


@dataclass(frozen=True)
class RestartRecord:
    """One actor brought back: when (time.time()), which, whether its standby took over, and how long
    from the death being seen to the replacement started (as the supervisor saw it: with Ray, at the
    check that collected it)."""

    time: float
    actor: str
    standby: bool
    seconds: float


LOCAL_BIND = Bind()  # the default: channels on loopback TCP


class Supervisor:
    def __init__(
        self, run_dir: Path, *, use_ray: bool, bind: Bind = LOCAL_BIND, placement_group=None, log_level: str = "INFO"
    ) -> None:
        self.run_dir, self.use_ray, self.bind = run_dir, use_ray, bind
        self.log_level = log_level  # Ray actors log at this level into RUN_DIR/logs/NAME.log
        self.registry = Registry(run_dir)
        self.placement_group = placement_group  # the plan's GPU bundles (Ray with GPUs), else None
        self.handles: dict[str, ActorHandle] = {}
        # Standbys, by the name of the actor each would replace: built, and prepared (in-process) or
        # preparing in the background (Ray: their prepare() calls are not waited for).
        self.spares: dict[str, ActorHandle] = {}
        self.restarting: dict[str, Restart] = {}  # Ray replacements still starting, by actor name
        self.restarts: list[RestartRecord] = []
        self._end_seen = False  # an actor's vigil said it ended since the last check
        self._start_failures: dict[str, int] = {}  # replacements that failed to start in a row, by actor
        self._preparing: dict[str, Any] = {}  # Ray: the spares' prepare() calls, by actor name

    def standbys_preparing(self) -> list[str]:
        """The actors whose spare is still being prepared (Ray: its prepare() has not answered). On a
        machine short of cores a spare's preparation (a new process, its imports, its model) takes
        CPU from the running actors for a few seconds."""
        if not self._preparing:
            return []
        import ray

        done, _ = ray.wait(list(self._preparing.values()), num_returns=len(self._preparing), timeout=0)
        ready = {id(ref) for ref in done}
        self._preparing = {n: ref for n, ref in self._preparing.items() if id(ref) not in ready}
        return sorted(self._preparing)

    def end_seen(self) -> bool:
        """Whether an actor has ended (stopped, died, or its work threads ended) since the last
        `check`: cheap (no call to any actor), so the driver looks often and checks at once, instead
        of leaving a dead actor's peers waiting on it until the next periodic check."""
        if not self._end_seen:
            self._end_seen = any(h.ended() for name, h in list(self.handles.items()) if name not in self.restarting)
        return self._end_seen

    def launch(self, spec: ActorSpec) -> ActorHandle:
        return self.launch_group([spec])[0]

    def launch_group(self, specs: list[ActorSpec], built: list[ActorHandle] | None = None) -> list[ActorHandle]:
        """Build every actor (or take the `built` ones: a standby), then start them all at once
        (in-process: one after the other) and wait. An actor with `standby` gets its spare prepared."""
        handles = built or [spec.handle(spec=spec, ref=self._build(spec), ray=self.use_ray) for spec in specs]
        if self.use_ray and len(handles) > 1:
            import ray

            replies = ray.get([h.ref.start.remote() for h in handles], timeout=CALL_TIMEOUT_S)
        else:
            replies = [h.start() for h in handles]
        self._install(handles, replies)
        return handles

    def _install(self, handles: list[ActorHandle], replies: list) -> None:
        """Make started actors the current ones (their start() replies are their endpoints), and prepare
        the spare of each that asks for a standby."""
        for handle, endpoints in zip(handles, replies, strict=True):
            handle.endpoints = endpoints or {}
            handle.keep_vigil()
            previous = self.handles.get(handle.name)
            if previous is not None:
                handle.restarts = previous.restarts + 1
            self.handles[handle.name] = handle
            log.info("started %s %s", handle.name, handle.endpoints)
        for spec in (h.spec for h in handles):
            if spec.standby and spec.group is None and spec.name not in self.spares:
                self._prepare_spare(spec)

    def _prepare_spare(self, spec: ActorSpec) -> None:
        """Build `spec`'s spare and prepare it: with Ray in the background (the driver does not wait),
        in-process now. A spare that cannot be built is logged; the actor then restarts cold."""
        try:
            handle = spec.handle(spec=spec, ref=self._build(spec), ray=self.use_ray)
            if self.use_ray:
                self._preparing[spec.name] = handle.ref.prepare.remote()
            else:
                handle.ref.prepare()
        except Exception:
            log.exception("%s: preparing its standby failed (a restart will start a new actor)", spec.name)
            return
        self.spares[spec.name] = handle

    def _take_spare(self, name: str) -> ActorHandle | None:
        """The spare of `name`, or None. One still preparing is taken too (it started earlier than a new
        actor would; its start() waits for its prepare()); one whose prepare() failed builds in start()."""
        self._preparing.pop(name, None)
        return self.spares.pop(name, None)

    def context(self, spec: ActorSpec) -> RunContext:
        return RunContext(
            run_dir=str(self.run_dir),
            name=spec.name,
            rank=spec.rank,
            world_size=spec.world_size,
            slot=dataclasses.replace(spec.slot, isolated=self.use_ray and spec.slot.num_gpus > 0),
            bind=self.bind,
            log_level=self.log_level if self.use_ray else "",
        )

    def _build(self, spec: ActorSpec):
        ctx = self.context(spec)
        if not self.use_ray:
            return spec.cls(*spec.args, ctx, **spec.kwargs)
        cls = as_ray_actor(spec.cls, num_cpus=0, num_gpus=spec.slot.num_gpus, max_concurrency=8)
        return cls.options(**self.ray_options(spec.slot, spec.prefer_node)).remote(*spec.args, ctx, **spec.kwargs)

    def ray_options(self, slot: Slot, prefer_node: str = "") -> dict[str, Any]:
        """Schedule an actor into its bundle of the run's placement group; one without a GPU onto a node
        labelled `prefer_node` ("key=value") while one is alive, else anywhere (nothing to say: Ray picks)."""
        if slot.bundle is None or self.placement_group is None:
            if not prefer_node:
                return {}
            key, _, value = prefer_node.partition("=")
            # The fallback is any node: when the labelled node is lost, its actors restart on the others.
            return {"label_selector": {key: value}, "fallback_strategy": [{"label_selector": {}}]}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=slot.bundle
            )
        }

    def __getitem__(self, name: str) -> ActorHandle:
        return self.handles[name]

    def role(self, prefix: str) -> list[ActorHandle]:
        return [h for name, h in self.handles.items() if name.startswith(prefix)]

    def alive(self, handle: ActorHandle) -> bool:
        try:
            return handle.health().healthy
        except Exception as err:  # noqa: BLE001 - RayActorError, a timeout: the actor is gone or wedged
            log.warning("%s: health check failed: %s", handle.name, err)
            return False

    def check(
        self, on_restart: Callable[[str], None] | None = None, on_death: Callable[[str], None] | None = None
    ) -> list[str]:
        """Restart every dead restartable actor; returns the names of those restarted (with Ray: whose
        replacements finished starting since the last check). `on_death(name)` runs once the dead actor
        is gone (and unregistered) and before its replacement starts, `on_restart(name)` once it has.

        With Ray the driver does not wait for a replacement's start() (seconds for a rollout actor
        that loads a model): it is collected at a later check, and meanwhile the driver records steps
        and supervises the others. In-process, start() runs here."""
        self._end_seen = False
        restarted = self._collect_restarts(on_restart)
        # Those whose vigil ended first: a dead one is replaced before the others' health calls.
        for name, handle in sorted(self.handles.items(), key=lambda item: not (item[1].ended() or item[1].end_seen)):
            if name in restarted or name in self.restarting or not handle.spec.restartable or self.alive(handle):
                continue
            group = self.group_of(handle)
            log.error("%s died; restarting %s", name, ", ".join(h.name for h in group))
            for member in group:  # live ranks would wait in collectives with the dead one: kill them too
                member.discard()
                self.registry.unregister(member.name)
                if on_death is not None:
                    on_death(member.name)
            spare = self._take_spare(name) if len(group) == 1 else None
            if self.use_ray:
                handles = (
                    [spare]
                    if spare is not None
                    else [h.spec.handle(spec=h.spec, ref=self._build(h.spec), ray=True) for h in group]
                )
                pending = Restart(
                    handles, [h.ref.start.remote() for h in handles], time.monotonic(), standby=spare is not None
                )
                self.restarting.update({h.name: pending for h in handles})
                continue
            started = time.monotonic()
            try:
                self.launch_group([h.spec for h in group], built=[spare] if spare is not None else None)
            except Exception as err:
                if not self._start_again(group, err):
                    raise
                continue
            for member in group:
                self._start_failures.pop(member.name, None)
            self._restarted(Restart(group, [], started, standby=spare is not None), restarted, on_restart)
        return restarted

    def _collect_restarts(self, on_restart: Callable[[str], None] | None, timeout_s: float = 0.0) -> list[str]:
        """Install the Ray replacements whose start() has answered (waiting up to `timeout_s`). One whose
        start() raised ends the run with that error, as a first start that fails does."""
        restarted: list[str] = []
        if not self.restarting:
            return restarted
        import ray

        for pending in {id(r): r for r in self.restarting.values()}.values():
            done, _ = ray.wait(pending.calls, num_returns=len(pending.calls), timeout=timeout_s)
            if len(done) < len(pending.calls):
                continue
            for handle in pending.handles:
                self.restarting.pop(handle.name, None)
            try:
                replies = ray.get(pending.calls)
            except Exception as err:
                for handle in pending.handles:
                    handle.discard()
                if not self._start_again(pending.handles, err):
                    raise
                continue
            for handle in pending.handles:
                self._start_failures.pop(handle.name, None)
            self._install(pending.handles, replies)
            self._restarted(pending, restarted, on_restart)
        return restarted

    def _start_again(self, handles: list[ActorHandle], err: Exception) -> bool:
        """A replacement failed to start: True to try again at the next check (the dead actor is still
        the current one, so the check restarts it, cold), False once it failed MAX_START_ATTEMPTS times
        in a row (the run then ends with its error, as a first start that fails does)."""
        names = ", ".join(h.name for h in handles)
        failures = 1 + max(self._start_failures.get(h.name, 0) for h in handles)
        for handle in handles:
            self._start_failures[handle.name] = failures
        if failures >= MAX_START_ATTEMPTS:
            log.error("%s: the replacement failed to start %d times in a row: %s", names, failures, err)
            return False
        log.error("%s: the replacement failed to start (%s); starting another", names, err)
        return True

    def _restarted(self, pending: Restart, restarted: list[str], on_restart: Callable[[str], None] | None) -> None:
        seconds = time.monotonic() - pending.since
        log.info(
            "%s %s in %.2f s",
            "standby took over from" if pending.standby else "restarted",
            ", ".join(h.name for h in pending.handles),
            seconds,
        )
        for handle in pending.handles:
            self.restarts.append(RestartRecord(time.time(), handle.name, pending.standby, seconds))
            restarted.append(handle.name)
            if on_restart is not None:
                on_restart(handle.name)

    def settle(self, on_restart: Callable[[str], None] | None = None, timeout_s: float = CALL_TIMEOUT_S) -> list[str]:
        """Wait for the replacements still starting (before the end of a run uses every actor)."""
        return self._collect_restarts(on_restart, timeout_s)

    def group_of(self, handle: ActorHandle) -> list[ActorHandle]:
        """`handle` and the actors it starts and restarts with, in launch order."""
        if handle.spec.group is None:
            return [handle]
        return [h for h in self.handles.values() if h.spec.group == handle.spec.group]

    def stop_all(self, order: list[str], on_stopped: Callable[[str], None] | None = None) -> None:
        """Stop actors by role prefix in `order`, then any left; `on_stopped(name)` runs after each."""
        names = [n for prefix in order for n in self.handles if n.startswith(prefix)]
        names += [n for n in self.handles if n not in names]
        for name in names:
            handle = self.handles[name]
            try:
                handle.stop()
            except Exception as err:  # noqa: BLE001 - one failed stop must not leave the other actors running
                log.warning("%s: stop failed: %s", name, err)
            handle.discard()
            self.registry.unregister(name)
            if on_stopped is not None:
                on_stopped(name)
        self.handles.clear()
        for pending in self.restarting.values():  # replacements still starting: end them
            for handle in pending.handles:
                handle.discard()
        self.restarting.clear()
        for spare in self.spares.values():  # never started: nothing to stop, only the Ray process to end
            spare.discard()
        self.spares.clear()
        self._preparing.clear()
