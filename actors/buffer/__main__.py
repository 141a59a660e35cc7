"""Run the replay actor as a standalone process:

    python -m actors.buffer --run-dir runs/x [--config FILE] [section.key=value ...]

It recovers whatever `<run-dir>/replay/` holds, serves until SIGTERM or SIGINT, snapshots and exits.
The first stdout line is JSON: {"replay": address, "pid": ..., "recovered": {...}}; the address is
also registered in `<run-dir>/registry.json` (as "replay"), where peers look it up. Used for debugging a run's replay on its own and by
the kill -9 test.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from actors.base import Bind, RunContext
from actors.buffer.actor import ReplayActor
from configs import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actors.buffer", description="Serve the replay actor on its own")
    p.add_argument("--run-dir", required=True, help="run directory; replay state lives in <run-dir>/replay")
    p.add_argument("--config", metavar="FILE", help="YAML preset (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        c = cfg.cluster
        ctx = RunContext(
            run_dir=args.run_dir,
            name="replay",
            bind=Bind(host=c.bind_host, transport=c.transport, advertise=c.advertise_host),
        )
        actor = ReplayActor(cfg.replay, cfg.algo, ctx, backend=cfg.verifier.backend)
    except ConfigError as err:
        print(f"replay: config error: {err}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    endpoints = actor.start()
    print(json.dumps({**endpoints, "pid": os.getpid(), "recovered": actor.recovered}), flush=True)
    while not done.wait(0.5):
        pass
    actor.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
