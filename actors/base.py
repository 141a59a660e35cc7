"""The lifecycle every Kiln actor follows, so one class runs in-process (tests, the embedded default)
and as a Ray actor (`as_ray_actor(cls)`) with the same code.

An actor is a plain class constructed from its own config section. `start()` binds its channels on
OS-chosen ports, starts its serving threads and returns its endpoints by name; the driver wires
endpoints between actors. `stop()` stops the threads and closes the channels. `health()` reports
counters. Ray only places and supervises actors; records move over the actors' ZMQ channels.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

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
