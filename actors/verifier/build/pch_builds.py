"""Precompiled headers built in the background, one at a time, by the trusted process.

The build service asks for a variant (a prelude and a flag profile) at start-up (the common ones) or
when a candidate's build reports that it missed one; this queue builds each once, at background
priority (background.py: a compile never takes the CPU of a timed window), and lets a caller wait
until every queued variant is built. A variant is hundreds of MB, so a stream of exotic flag sets
gets at most MAX_PCH_VARIANTS per prelude.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from pathlib import Path

from actors.verifier.background import BACKGROUND_NICE

from .preludes import FACADE_LIB, SHELL, PchAborted, PchStore, flag_profile
from .toolchain import Toolchain

log = logging.getLogger(__name__)

MAX_PCH_VARIANTS = 6  # per prelude and service


def default_pch_dir() -> Path:
    """Precompiled headers depend only on the toolchain, so one machine-wide directory serves every
    run and test session: $KILN_PCH_DIR, else $XDG_CACHE_HOME/kiln/pch, else ~/.cache/kiln/pch."""
    if os.environ.get("KILN_PCH_DIR"):
        return Path(os.environ["KILN_PCH_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln" / "pch"


def default_variants(backend: str) -> list[tuple[str, tuple[str, ...]]]:
    """Built at start-up: what nearly every candidate uses. The rest (no -O, -march=native, the full
    fallback prelude, ...) is built the first time a candidate misses it."""
    # lean serves kernel TUs and thunk bindings (CUDA kernels go to nvcc, which has no PCH);
    # the shell is the one pybind11 object all thunk-bound extensions link.
    # CUDA units are tried first against the facade, whose library every such build links.
    facade = [(FACADE_LIB, ())] if backend == "cuda" else []
    return [("lean", flag_profile(["-O3"])), (SHELL, ()), *facade]


class PchBuilds:
    """The background queue of one build service. `mode` "auto" builds what is asked for; "use" only
    what is asked for with force=True (benchmarks, tests)."""

    def __init__(self, store: PchStore, toolchain: Toolchain, mode: str) -> None:
        self.store, self.toolchain, self.mode = store, toolchain, mode
        self._queue: queue.Queue = queue.Queue()
        self._seen: set = set()
        self._pending = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="kiln-build-pch", daemon=True)
        self._thread.start()

    def request(self, prelude: str, profile: tuple[str, ...], force: bool = False) -> None:
        """Queue a variant for building (once per service)."""
        item = (prelude, tuple(profile))
        if item in self._seen or not self.toolchain.cxx_is_gcc or (self.mode != "auto" and not force):
            return
        if not force and sum(p == prelude for p, _ in self._seen) >= MAX_PCH_VARIANTS:
            return
        self._seen.add(item)
        with self._cond:
            self._pending += 1
        self._queue.put(item)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every queued variant is built; True when idle."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        """Abort the build in progress and stop the queue."""
        self.store.abort()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            prelude, profile = item
            try:
                seconds = self.store.build(prelude, profile, nice=BACKGROUND_NICE)
                if seconds:
                    log.info("precompiled %s prelude %s in %.1f s", prelude, " ".join(profile), seconds)
            except PchAborted as e:  # the service closed (a start-up check's, say): the next one builds it
                log.debug("precompiled header %s %s left for later: %s", prelude, " ".join(profile), e)
            except (RuntimeError, ValueError, OSError) as e:
                log.warning("precompiled header %s %s not built: %s", prelude, " ".join(profile), e)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
