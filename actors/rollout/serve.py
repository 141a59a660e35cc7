"""Run the embedded torch engine as a standalone HTTP server with SGLang's launch flags:

    python -m actors.rollout.serve --model-path DIR --host 127.0.0.1 --port 30000 [--tp-size 1]
        [--mem-fraction-static F] [--skip-tokenizer-init] [--seed N]

so `rollout.sglang.launch_module: actors.rollout.serve` launches Kiln's engine where SGLang would run
(tests do this on CPU). Serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import threading

from actors.rollout.engines import resolve_device
from actors.rollout.http_server import EngineServer
from actors.rollout.torch_engine import TorchEngine
from configs import ModelConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float, default=None, help="accepted for SGLang compatibility")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="accepted: the engine never tokenizes")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tp_size != 1:
        ap.error("the torch engine runs on one device (--tp-size 1)")
    cfg = ModelConfig(path=args.model_path)
    engine = TorchEngine(cfg, max_batch=args.max_batch, device=resolve_device(args.device), seed=args.seed)
    # Like SGLang with --skip-tokenizer-init: token ids in and out, no text.
    server = EngineServer(engine, host=args.host, port=args.port, model_path=args.model_path)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    server.start()
    done.wait()
    server.stop()
    engine.close()


if __name__ == "__main__":
    main()
