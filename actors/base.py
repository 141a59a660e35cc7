"""The lifecycle every Kiln actor follows, so one class runs in-process (tests, the embedded default)
and as a Ray actor (`as_ray_actor(cls)`) with the same code.

An actor is a plain class constructed from the config sections it reads and a `RunContext`: where
the run lives (its directory and the address registry in it), which actor this is (name, rank) and
where the placement plan put it (`Slot`). Nothing else: an actor finds its peers through the
registry, not through arguments, so a restarted actor is built exactly like the first one.

`start()` binds its channels on OS-chosen ports, registers them, starts its serving threads and
returns its endpoints by name (for logs). `stop()` stops the threads and closes the channels.
`health()` returns the role's typed health record, an `ActorHealth`. Ray only places and supervises
actors; records move over the actors' ZMQ channels.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from configs import ConfigError
from protocols.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bind:
    """How an actor's channels listen (from the cluster section)."""

    host: str = "127.0.0.1"  # interface to bind on
    transport: str = "tcp"  # "tcp" or "ipc"
    advertise: str | None = None  # the host peers dial when `host` is 0.0.0.0


@dataclass(frozen=True)
class Slot:
    """Where the placement plan puts an actor: its logical GPUs and the GPU share Ray reserves."""

    gpus: tuple[int, ...] = ()  # the plan's logical GPU ids (0 .. N-1 over the cluster); () = none
    num_gpus: float = 0.0  # the share of GPUs reserved for it (colocated residents split a GPU)
    bundle: int | None = None  # its bundle in the run's placement group; None = no GPU
    colocated: bool = False  # a learner and engines share these GPUs (cluster.layout=colocated)
    isolated: bool = False  # a Ray actor: its process sees only the GPUs Ray gave it from its bundle

    def device_ids(self) -> tuple[str, ...]:
        """The slot's GPUs as CUDA_VISIBLE_DEVICES entries for a process this actor launches: the
        plan's ids in-process (the driver's machine numbers its GPUs like the plan), or, in a Ray
        actor, the devices Ray assigned from the slot's bundle (the plan's ids are cluster-logical)."""
        if self.isolated:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            return tuple(d.strip() for d in visible.split(",") if d.strip())
        return tuple(str(g) for g in self.gpus)


@dataclass(frozen=True)
class RunContext:
    """What an actor knows of the run it is part of, besides its config sections."""

    run_dir: str  # the run directory (replay's log, checkpoints, the registry)
    name: str = ""  # unique in the run: "replay", "learner", "learner-1", "rollout-0", "verifier-2"
    rank: int = 0  # index among its role's actors (a learner's process rank, a rollout actor's index)
    world_size: int = 1  # actors of its role (a learner's ranks)
    slot: Slot = field(default_factory=Slot)
    bind: Bind = field(default_factory=Bind)
    # An actor in a process of its own (Ray) logs at this level into RUN_DIR/logs/NAME.log; "" = the
    # process's logging is left as it is (in-process: the driver's).
    log_level: str = ""

    @property
    def registry(self) -> Registry:
        return Registry(self.run_dir)

    @property
    def path(self) -> Path:
        return Path(self.run_dir)


@dataclass(frozen=True, kw_only=True)
class ActorHealth:
    """What the supervisor reads of every actor; each role's record adds its own counters."""

    role: str
    alive: bool  # started and not stopped
    looping: bool = True  # its work threads run; False = one of them died (the supervisor restarts it)
    finished: bool = False  # its work is done: not dead, though its threads have ended
    busy_s: float | None = None  # seconds spent working so far, for the driver's busy shares; None = not counted
    pid: int = field(default_factory=os.getpid)  # the actor's process (benchmarks account its CPU time)

    @property
    def healthy(self) -> bool:
        """Working, or done with its work; False means dead or wedged."""
        return self.finished or (self.alive and self.looping)


class Actor:
    role = "actor"

    def __init__(self, ctx: RunContext | None = None) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        if ctx is not None and ctx.log_level:  # a process of its own (Ray)
            log_to_run_dir(ctx)
            end_process_on_sigterm()

    def start(self) -> dict[str, str]:
        """Bind channels, register them, start serving; return {endpoint name: address}."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Do ahead what `start()` needs and involves no peer (imports, building a model), so that a
        standby (`ActorSpec.standby`) takes over at once when started. Nothing by default."""

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()

    def health(self) -> ActorHealth:
        raise NotImplementedError

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def threads_running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def ended(self) -> bool:
        """Stopped, or every work thread it started has ended (its work done, or a thread died):
        `health()` says which. Cheap, so the driver can look often."""
        return self._stop.is_set() or (bool(self._threads) and not self.threads_running)

    def vigil(self, poll_s: float = 0.1) -> None:
        """Return once the actor has ended. The driver calls it through Ray right after `start()` and
        never waits on it: the pending call fails the moment the actor's process dies, so a death is
        noticed at once instead of at the next health check (the dead actor's peers wait until then)."""
        while not self.ended():
            self._stop.wait(poll_s)

    def spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Run `target` on a daemon thread; an exception is logged, never silently lost."""

        def guarded() -> None:
            try:
                target()
            except Exception:
                log.exception("%s: thread %s died", self.role, name)
                raise

        t = threading.Thread(target=guarded, name=f"kiln-{self.role}-{name}", daemon=True)
        t.start()
        self._threads.append(t)
        return t


def end_process_on_sigterm() -> None:
    """In an actor's own process, SIGTERM ends the process at once, as SIGKILL would: the actor dies and
    its supervisor restarts it (each role's state is durable or rebuilt, docs/training.md "Faults").
    Ray's worker otherwise turns SIGTERM into a SystemExit for a main thread blocked in its task loop,
    and the process lingers, answering nothing, for about 30 s until the driver's health call gives up
    (a chaos run's SIGTERMed actors recovered in 31 s against 1-3 s for SIGKILL). Only the main
    thread may set a handler; Ray builds an actor there."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))


LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s [%(process)d %(threadName)s] %(message)s"
_logging_to: set[str] = set()  # the log files this process writes


def log_to_run_dir(ctx: RunContext) -> Path:
    """Send this process's log records, at `ctx.log_level`, to RUN_DIR/logs/NAME.log, with the time to
    the millisecond, the process and the thread: an actor's own account of a run, beside the driver's
    (a replacement appends to its predecessor's file, so a failover reads in order). Warnings still go
    to stderr too, which Ray shows on the driver's console. Once per process and file."""
    path = Path(ctx.run_dir) / "logs" / f"{ctx.name or 'actor'}.log"
    root = logging.getLogger()
    if str(path) in _logging_to:
        return path
    if not _logging_to and not root.handlers:
        console = logging.StreamHandler()
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
        root.addHandler(console)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as err:  # a read-only or full run directory: the actor runs, logging to stderr only
        log.warning("cannot write the log file %s: %s", path, err)
        return path
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(ctx.log_level)
    _logging_to.add(str(path))
    return path


def as_ray_actor(cls: type, **ray_options):
    """The Ray actor class for `cls` (e.g. `as_ray_actor(ReplayActor, num_cpus=1).remote(cfg, ctx)`)."""
    import ray

    return ray.remote(**ray_options)(cls) if ray_options else ray.remote(cls)


class PluginError(ConfigError):
    """A dotted path in the config does not name a usable plug-in; the message says why, in one line."""


def load_plugin(path: str, interface: type, *, key: str) -> type:
    """The class named by `path` ("package.module.Class") for config field `key`, checked against
    `interface`: every public method `interface` declares must be callable on the class. Optional hooks
    are declared in the interface with a default body, so a plug-in gets them by subclassing it;
    nothing is looked up by `getattr` later. Raises `PluginError` naming `key` and the problem."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{key}={path!r} is not a dotted path of the form package.module.ClassName")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - ImportError, or the module itself failed while importing
        raise PluginError(
            f"{key}={path!r}: cannot import module {module_name!r}: {type(err).__name__}: {err}"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise PluginError(f"{key}={path!r}: module {module_name!r} has no attribute {attr!r}")
    if not isinstance(cls, type):
        raise PluginError(f"{key}={path!r} names a {type(cls).__name__}, not a class")
    missing = [name for name in interface_methods(interface) if not _provides(cls, name)]
    if missing:
        raise PluginError(
            f"{key}={path!r}: {attr} lacks {', '.join(m + '()' for m in missing)} of "
            f"{interface.__name__} (subclass {interface.__module__}.{interface.__name__} "
            "to inherit its optional hooks)"
        )
    return cls


def _provides(cls: type, name: str) -> bool:
    value = inspect.getattr_static(cls, name, None)
    return isinstance(value, property) or callable(getattr(cls, name, None))


def interface_methods(interface: type) -> list[str]:
    """The public methods (properties included) that `interface` and its bases declare."""
    names = []
    for base in interface.__mro__:
        if base is object or base.__module__ in ("typing", "abc", "typing_extensions"):
            continue
        for name, value in vars(base).items():
            if name.startswith("_") or name in names:
                continue
            if inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod)):
                names.append(name)
    return names
