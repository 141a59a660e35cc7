"""A verifier in a process of its own, for tests/verifier/test_boundary.py: it verifies a candidate that
spins forever in forward (with a run limit far longer than the test) and prints its zygote's pid,
then waits to be killed."""

from __future__ import annotations

import sys
import threading
import time

from actors.verifier.suite import load_suite, request_for
from actors.verifier.verifier import KernelVerifier
from configs import load_config
from tasks.loader import load_tasks


def main() -> None:
    cache_dir = sys.argv[1]
    cfg = load_config(
        None,
        [
            f"verifier.cache_dir={cache_dir}",
            "verifier.run_timeout_s=600",
            "verifier.trials=2",
            "verifier.compile_baseline=never",
            "verifier.memory_limit_mb=1536",
        ],
    ).verifier
    verifier = KernelVerifier(cfg)
    case = next(c for c in load_suite("cpu") if c.name == "infinite_loop")
    tasks = {t.task_id: t for t in load_tasks("tasks/level1", "cpu")}
    threading.Thread(target=verifier.verify, args=(request_for(case, tasks),), daemon=True).start()
    print(f"zygote {verifier.zygote.pid}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
