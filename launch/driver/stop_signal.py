"""SIGTERM stops a `kiln` command the way Ctrl-C does: as a KeyboardInterrupt in the main thread, so
`kiln train` checkpoints the learner and stops everything in order, and the CLI prints one line.

Python's default for SIGTERM ends the process at once (no checkpoint, nothing stopped in order), and
ray.init replaces whatever handler there was, twice: first with a Python handler that calls
sys.exit(15), then (connecting the driver) with its C++ failure handler, which prints
`*** SIGTERM received ***` with a stack dump and aborts. So the CLI installs Kiln's handler for its
own process (`stop_on_sigterm`), and the code that starts Ray does so inside `ray_start()`: the C++
handler is not installed in the driver (Ray's workers keep theirs), a SIGTERM that lands while Ray
starts (its sys.exit(15)) becomes the same KeyboardInterrupt, and Kiln's handler is back once Ray is
up. Where the CLI did not install it (a test, a library user), `ray_start()` changes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_handler = None  # the CLI's handler now (None: the CLI did not ask; Ray's start leaves signals alone)


def stop_on_sigterm() -> None:
    """From now on the first SIGTERM raises KeyboardInterrupt in the main thread."""
    _install(_interrupt)


@contextlib.contextmanager
def ray_start() -> Iterator[None]:
    """Around ray.init in the driver: no C++ SIGTERM handler, Ray's sys.exit(15) read as the stop it is,
    Kiln's handler put back afterwards."""
    if _handler is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    from ray._private import ray_constants

    # Read by the driver's core worker when ray.init connects it (the environment variable of the same
    # name would reach every Ray worker too, and cost them their crash stack dumps).
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    except SystemExit as stop:
        if stop.code != signal.SIGTERM:
            raise
        _install(_ignore)
        raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGTERM, _handler)


def _install(handler) -> None:
    global _handler
    _handler = handler
    signal.signal(signal.SIGTERM, handler)


def _interrupt(signum, frame) -> None:
    # One stop: a second SIGTERM (a supervisor repeating itself) must not cut the checkpoint short.
    # A Python-level no-op, not SIG_IGN, which programs started during the stop would inherit.
    _install(_ignore)
    raise KeyboardInterrupt


def _ignore(signum, frame) -> None:
    return None
