"""The lifecycle every Kiln actor follows, so one class runs in-process (tests, the embedded default)
and as a Ray actor (`as_ray_actor(cls)`) with the same code.

An actor is a plain class constructed from its own config section. `start()` binds its channels on
OS-chosen ports, starts its serving threads and returns its endpoints by name; the driver wires
endpoints between actors. `stop()` stops the threads and closes the channels. `health()` reports
counters. Ray only places and supervises actors; records move over the actors' ZMQ channels.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from typing import Callable

from configs import ConfigError

log = logging.getLogger(__name__)


class Actor:
    role = "actor"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> dict[str, str]:
        """Bind channels, start serving; return {endpoint name: address}."""
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()

    def health(self) -> dict:
        return {"role": self.role, "alive": not self._stop.is_set()}

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

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


def as_ray_actor(cls: type, **ray_options):
    """The Ray actor class for `cls` (e.g. `as_ray_actor(ReplayActor, num_cpus=1).remote(cfg)`)."""
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
    except Exception as err:  # ImportError, or the module itself failed while importing
        raise PluginError(f"{key}={path!r}: cannot import module {module_name!r}: "
                          f"{type(err).__name__}: {err}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise PluginError(f"{key}={path!r}: module {module_name!r} has no attribute {attr!r}")
    if not isinstance(cls, type):
        raise PluginError(f"{key}={path!r} names a {type(cls).__name__}, not a class")
    missing = [name for name in interface_methods(interface) if not _provides(cls, name)]
    if missing:
        raise PluginError(f"{key}={path!r}: {attr} lacks {', '.join(m + '()' for m in missing)} of "
                          f"{interface.__name__} (subclass {interface.__module__}.{interface.__name__} "
                          "to inherit its optional hooks)")
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
