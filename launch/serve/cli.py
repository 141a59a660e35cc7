"""`kiln serve`: the verifier as an HTTP service.

    kiln serve [--config F] [--host H] [--port P] [--token-file F] [--backend cpu|cuda] [section.key=value ...]

It prints one line when it listens (`kiln serve: listening on http://H:P ...`) and serves until
Ctrl-C or SIGTERM. It refuses to start, with one line and exit status 2, on a bind address other than
loopback without a token file, or on a token file it cannot read.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from configs import KilnConfig
from launch.config_args import add_config_arguments, load_for_backend
from launch.serve.auth import AuthError, Tokens
from launch.serve.queue import FairQueue

log = logging.getLogger(__name__)


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the verifier over HTTP (Kiln's API and KernelGYM's)")
    p.add_argument("--host", help="bind address (default: serve.host, loopback)")
    p.add_argument("--port", type=int, help="TCP port (default: serve.port; 0 = any free one)")
    p.add_argument("--token-file", help="client tokens, 'name token' a line (required off loopback)")
    p.add_argument("--backend", help="cpu or cuda (default: verifier.backend from the config)")
    add_config_arguments(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.backend is not None and args.backend not in ("cpu", "cuda"):
        print(f"kiln serve: unknown backend {args.backend!r} (choose cpu or cuda)", file=sys.stderr)
        return 2
    cfg = load_for_backend(args.config, args.overrides, args.backend)
    for key, value in (("host", args.host), ("port", args.port), ("token_file", args.token_file)):
        if value is not None:
            setattr(cfg.serve, key, value)
    try:
        running = start(cfg)
    except (AuthError, OSError, ValueError) as err:
        print(f"kiln serve: {err}", file=sys.stderr)
        return 2
    print(f"kiln serve: listening on {running.url} ({running.summary})", flush=True)
    try:
        while running.thread.is_alive():
            running.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
    return 0


class Running:
    """A service running on a thread of its own (its event loop), until `stop`."""

    def __init__(self, service, verifiers, url: str, loop, runner, thread: threading.Thread, summary: str) -> None:
        self.service, self.verifiers, self.url = service, verifiers, url
        self._loop, self._runner, self.thread, self.summary = loop, runner, thread, summary

    def stop(self) -> None:
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join(timeout=30)
        self.service.dispatcher.close()
        self.verifiers.close()


def start(cfg: KilnConfig, verifiers_factory: Callable | None = None) -> Running:
    """Start the service for `cfg` (its verifiers in this process) and return once it listens."""
    from aiohttp import web

    from launch.serve.app import Service, build_app
    from launch.serve.dispatch import Dispatcher
    from launch.serve.verifiers import InProcessVerifiers

    tokens = Tokens(cfg.serve.host, cfg.serve.token_file)  # the token rule, before anything starts
    tasks = _task_set(cfg)
    if verifiers_factory is None and cfg.serve.pool == "ray":
        from launch.driver.cluster import start_ray
        from launch.serve.verifiers import RayVerifiers

        start_ray(cfg.cluster)
        verifiers_factory = RayVerifiers
    verifiers = (verifiers_factory or InProcessVerifiers)(cfg.verifier, cfg.serve.verifiers)
    dispatcher = Dispatcher(
        FairQueue(cfg.serve.queue_capacity, cfg.serve.client_share), verifiers, keep_s=cfg.serve.keep_results_s
    )
    service = Service(cfg.serve, cfg.verifier.backend, tokens, dispatcher, tasks)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(service), access_log=None)
    ready: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, cfg.serve.host, cfg.serve.port)
            loop.run_until_complete(site.start())
            ready["port"] = runner.addresses[0][1]
        except Exception as err:  # noqa: BLE001 - reported to the starting thread, which says it in one line
            ready["error"] = err
            return
        loop.run_forever()

    thread = threading.Thread(target=run, name="kiln-serve", daemon=True)
    thread.start()
    while not ready and thread.is_alive():
        time.sleep(0.02)
    if "error" in ready or "port" not in ready:
        dispatcher.close()
        verifiers.close()
        err = ready.get("error")
        raise OSError(f"cannot listen on {cfg.serve.host}:{cfg.serve.port}: {err}")
    host = f"[{cfg.serve.host}]" if ":" in cfg.serve.host else cfg.serve.host
    summary = (
        f"{cfg.serve.verifiers} verifier(s) on {cfg.verifier.backend} ({cfg.serve.pool}), {len(tasks)} task(s) by id, "
        f"{'tokens from ' + cfg.serve.token_file if cfg.serve.token_file else 'no token: loopback only'}"
    )
    return Running(service, verifiers, f"http://{host}:{ready['port']}", loop, runner, thread, summary)


def _task_set(cfg: KilnConfig) -> dict:
    """{task id: Task} of serve.tasks ({} when it names no directory)."""
    from tasks.loader import TaskLoadError, discover, to_task

    path = Path(cfg.serve.tasks)
    if not path.exists():
        return {}
    try:
        return {tf.task_id: to_task(tf, cfg.verifier.backend) for tf in discover(path)}
    except TaskLoadError as err:
        raise ValueError(f"serve.tasks: {err}") from None
