"""What a jailed reference costs: `python -m launch.bench.reference_jail [--backend cpu|cuda] [--n N]
[--tasks a,b]`.

One verifier verifies each task's shipped solution (made distinct by a comment: no verdict-cache hit,
the same build) N times against its reference run in the verifier's process (the operator's task set)
and N times against the same source sent as a client's (jailed_reference.py: its own jailed process),
the two alternating so that a busy host weighs on both alike. The first verification of each side
pays the reference's load (for the jailed one: its process's start) and its baselines; it is printed
apart. Per side: the mean wall of a verification and of its phases that run the reference
(`reference`: the plan's draws; `correctness`; `timed_draw` and `timed_check`: the timed stage's fresh
inputs and its check of every timed call), and the eager baseline both sides measured.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = ("reference", "correctness", "timed_draw", "timed_check")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--n", type=int, default=5, help="verifications per side after the first")
    p.add_argument("--tasks", default="level1/01_relu,level2/06_rmsnorm")
    args = p.parse_args(argv)
    from actors.verifier.verifier import KernelVerifier
    from configs import load_config
    from protocols import KernelSpec, Task, VerifyRequest
    from tasks.loader import load_tasks

    cache = Path(tempfile.mkdtemp(prefix="kiln-reference-jail-"))
    cfg = load_config(
        None, [f"verifier.backend={args.backend}", f"verifier.cache_dir={cache}", "verifier.compile_baseline=never"]
    ).verifier
    tasks = {
        t.task_id: t for level in ("level1", "level2") for t in load_tasks(str(REPO / "tasks" / level), args.backend)
    }
    verifier = KernelVerifier(cfg)
    rows = []
    try:
        for task_id in args.tasks.split(","):
            own = tasks[task_id]
            spec = KernelSpec(
                name="client", reference=own.kernel.reference, backend=args.backend, level=0, reference_origin="client"
            )
            client = Task(task_id=f"inline/{task_id}", kind="kernel", kernel=spec)
            solution = (REPO / "tasks" / "solutions" / args.backend / f"{task_id}.py").read_text()
            runs: dict[str, list] = {"in process": [], "jailed": []}
            for i in range(args.n + 1):
                for side, task in (("in process", own), ("jailed", client))[:: 1 if i % 2 else -1]:
                    started = time.perf_counter()
                    r = verifier.verify(
                        VerifyRequest(
                            request_id=uuid.uuid4().hex, task=task, candidate=f"{solution}\n# {uuid.uuid4().hex}\n"
                        )
                    )
                    if not r.passed:
                        print(f"{task_id} ({side}): {r.error_class}: {r.feedback[:200]}", file=sys.stderr)
                        return 1
                    runs[side].append((time.perf_counter() - started, r.timings, r.diagnostics["times_s"]["eager"]))
            for side, got in runs.items():
                first, later = got[0], got[1:]
                mean = {k: statistics.fmean(t.get(k, 0.0) for _, t, _ in later) for k in PHASES}
                rows.append(
                    (
                        task_id,
                        side,
                        first[0],
                        statistics.fmean(w for w, _, _ in later),
                        mean,
                        statistics.fmean(e for _, _, e in got),
                    )
                )
    finally:
        verifier.close()
        shutil.rmtree(cache, ignore_errors=True)
    print(
        f"{'task':<22}{'side':<12}{'first s':>9}{'then s':>9}"
        + "".join(f"{k:>13}" for k in PHASES)
        + f"{'eager us':>10}"
    )
    for task_id, side, first, then, mean, eager in rows:
        print(
            f"{task_id:<22}{side:<12}{first:>9.2f}{then:>9.2f}"
            + "".join(f"{mean[k]:>13.3f}" for k in PHASES)
            + f"{eager * 1e6:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
