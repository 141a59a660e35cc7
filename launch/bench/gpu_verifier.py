"""GPU-machine validation and benchmark of the verifier: `python -m launch.bench.gpu_verifier`.

Through a real VerifierActor (ZMQ ROUTER, cuda backend, a cold cache directory) it verifies, all
submitted at once as a training run would:
  * every shipped CUDA solution (tasks/solutions/cuda) -- each must pass;
  * every CUDA adversarial candidate (tests/adversarial/{cuda,common}) -- each must get its expected verdict,
    including an illegal memory access, a hung kernel, a segfault and a GPU OOM;
then one more fresh control candidate, which must pass: the verifier still serves after all that.
It prints expected vs got per case (a verdict that differs also with its whole feedback), then the benchmark figures for docs/BENCHMARKS.md: compile time
p50/p90 and where it goes, correctness-check time, timing time, and verifications per minute on the
cold mix. Exit status 0 when every verdict is as expected. Run it from the repository root on the
GPU host (about 5-8 minutes on one H100 with 16 cores); `--json FILE` also writes the figures;
`--mix solutions` verifies the shipped solutions alone (a throughput run), `--copies K` each of them K
times as distinct candidates (a run long enough to reach the verifier's steady state). Workers follow
the verifier's own sizing (`verifier.compile_workers` and `verifier.run_workers` at 0) unless set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from actors.rollout.forced import in_kernel_code
from actors.verifier.suite import REPO, SuiteCase, as_expected, load_suite, suite_tasks, verdict
from configs import VerifierConfig
from protocols import VerifyRequest, VerifyResult
from protocols.channels import RequestClient


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu runs the same script on the cpu backend (a dry run of this script without a GPU)",
    )
    p.add_argument("--tasks", default="tasks" if Path("tasks").is_dir() else str(REPO / "tasks"))
    p.add_argument("--solutions", help="default: tasks/solutions/<backend>")
    p.add_argument("--cache-dir", help="verifier cache (default: a fresh temporary directory = cold)")
    p.add_argument(
        "--compile-workers",
        type=int,
        default=0,
        help="compile processes (0 = the verifier's sizing, verifier.compile_workers: the cores this process may use)",
    )
    p.add_argument(
        "--run-workers",
        type=int,
        default=0,
        help="sandbox workers, dealt round-robin over the visible GPUs (0 = the verifier's sizing from the cores and the GPUs' memory, verifier.run_workers; timing windows stay exclusive per GPU)",
    )
    p.add_argument("--inflight", type=int, default=32, help="requests the actor works on at once")
    p.add_argument(
        "--compile-baseline",
        action="store_true",
        help="also time torch.compile per task (adds ~20-40 s per task; off for the throughput run)",
    )
    p.add_argument(
        "--mix",
        default="all",
        choices=["all", "solutions"],
        help="solutions: the shipped solutions only (a throughput run without the adversarial "
        "cases, whose hangs and timeouts dominate the wall clock)",
    )
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        help="each shipped solution this many times, every copy made distinct in its kernel source (a unique "
        "comment, so each one compiles): a throughput run long enough for the verifier to reach its steady "
        "state, rather than one wave of compiles",
    )
    p.add_argument("--json", metavar="FILE", help="write the per-case results and figures as JSON")
    args = p.parse_args(argv)
    if args.copies < 1:
        p.error(f"--copies must be at least 1, got {args.copies}")
    return args


def build_config(args) -> VerifierConfig:
    cfg = VerifierConfig()  # production defaults: trials 4, warmup 3, repeats 20, 60 s run limit
    cfg.backend = args.backend
    cfg.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kiln-gpu-validate-")
    cfg.compile_workers = args.compile_workers
    cfg.run_workers = args.run_workers
    cfg.max_concurrent_requests = args.inflight
    cfg.run_timeout_s = 60.0
    cfg.compile_baseline = "always" if args.compile_baseline else "never"
    return cfg


def jobs(args) -> list[tuple[str, str, VerifyRequest]]:
    """(name, expected verdict, request) for every solution and adversarial case."""
    from tasks.loader import discover, solution_for

    tasks = suite_tasks(args.backend, args.tasks)
    solutions = args.solutions or str(Path(args.tasks) / "solutions" / args.backend)
    out = []
    for copy in range(args.copies):
        for tf in discover(args.tasks):
            sol = solution_for(tf, solutions)
            if sol is None:
                raise SystemExit(f"gpu_verifier: no {args.backend} solution for {tf.task_id} in {solutions}")
            name = f"solution {tf.task_id}" + (f" #{copy + 1}" if args.copies > 1 else "")
            out.append((name, "pass", _request(tasks[tf.task_id], _copy(sol.read_text(), copy))))
    cases: list[SuiteCase] = load_suite(args.backend) if args.mix == "all" else []
    for case in cases:
        if not case.config:  # the ones that hold under other settings run on a verifier of their own
            out.append((f"adversarial {case.name}", case.expect, _request(tasks[case.task_id], case.source())))
    return out


def _copy(source: str, copy: int) -> str:
    """The solution as its `copy`-th distinct candidate: the first as shipped, the others with a unique
    comment in their kernel source, so no copy hits the build cache another one filled."""
    if copy == 0:
        return source
    return in_kernel_code(source, lambda code: f"{code.rstrip()}\n// gpu_verifier copy {uuid.uuid4().hex}\n") or source


def configured(args) -> list[tuple[str, str, VerifyResult]]:
    """The adversarial cases whose verdict holds under other verifier settings, each verified by an
    in-process verifier with them (a few: vendor libraries switched off)."""
    from dataclasses import replace

    from actors.verifier.verifier import KernelVerifier
    from configs import load_config

    cases = [c for c in load_suite(args.backend) if c.config] if args.mix == "all" else []
    tasks = suite_tasks(args.backend, args.tasks)
    rows = []
    for settings in sorted({c.config for c in cases}):
        base = build_config(args)
        cfg = load_config(None, [f"verifier.{k}={v}" for k, v in _flat(base).items()] + list(settings)).verifier
        verifier = KernelVerifier(replace(cfg, cache_dir=base.cache_dir))
        try:
            for case in (c for c in cases if c.config == settings):
                rows.append(
                    (
                        f"adversarial {case.name} ({', '.join(settings)})",
                        case.expect,
                        verifier.verify(_request(tasks[case.task_id], case.source())),
                    )
                )
        finally:
            verifier.close()
    return rows


def _flat(cfg: VerifierConfig) -> dict:
    keys = ("backend", "compile_workers", "run_workers", "max_concurrent_requests", "run_timeout_s", "compile_baseline")
    return {k: getattr(cfg, k) for k in keys}


def _task(args, task_id: str):
    return suite_tasks(args.backend, args.tasks)[task_id]


def _request(task, source: str) -> VerifyRequest:
    return VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=source)


def run(args) -> int:
    import torch

    from actors.verifier.actor import VerifierActor

    if args.backend == "cuda" and not torch.cuda.is_available():
        print("gpu_verifier: no CUDA device visible", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if args.backend == "cuda" else f"cpu ({os.cpu_count()} cores)"
    cfg = build_config(args)
    work = jobs(args)
    actor = VerifierActor(cfg)
    address = actor.start()["verifier"]
    print(
        f"verifier on {device}, cache {cfg.cache_dir}, {actor.impl.compile_workers.count} compile workers"
        f"{' (0 = the cores here)' if not args.compile_workers else ''}, {actor.impl.run_workers.count} run workers "
        f"({actor.impl.run_workers.why}), {len(work)} candidates",
        flush=True,
    )
    actor.impl.warm()
    pch_s = _wait_pch(actor)
    started = time.perf_counter()

    def ask(job):  # a line per verdict as it comes: a run cut short still shows how far it got
        r = _ask(address, job[2])
        print(f"  [{time.perf_counter() - started:6.1f} s] {job[0]:<45} {verdict(r)}", flush=True)
        return r

    with ThreadPoolExecutor(len(work)) as pool:
        results = list(pool.map(ask, work))
    wall = time.perf_counter() - started
    control = next(c for c in load_suite(args.backend) if c.name == "control_correct")
    after = _ask(address, _request(_task(args, control.task_id), control.source() + f"\n# after {uuid.uuid4().hex}\n"))
    health = actor.health()
    actor.stop()
    rows = [(name, expect, r) for (name, expect, _), r in zip(work, results, strict=True)]
    figures = benchmark(rows, wall, pch_s)  # the mix the actor verified at once: what the clock covers
    rows.append(("control after everything (fresh)", "pass", after))
    rows += configured(args)
    ok = _print_table(rows)
    figures["device"] = device
    figures["actor"] = health
    _print_figures(figures)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "figures": figures,
                    "cases": [
                        {
                            "name": n,
                            "expected": e,
                            "got": verdict(r),
                            "stage": r.stage,
                            "score": r.score,
                            "feedback": r.feedback,
                            "timings": r.timings,
                            "diagnostics": r.diagnostics,
                        }
                        for n, e, r in rows
                    ],
                },
                indent=1,
                default=str,
            )
        )
    return 0 if ok else 1


def _wait_pch(actor) -> float:
    t0 = time.perf_counter()
    wait = getattr(actor.impl.builds, "wait_pch", None)
    if wait is not None:
        wait(900)
    return time.perf_counter() - t0


def _ask(address: str, request: VerifyRequest) -> VerifyResult:
    with RequestClient(address, timeout_s=1800.0, retries=0) as client:
        return client.request(request)


def _print_table(rows) -> bool:
    print(f"\n{'case':<48} {'expected':<12} {'got':<12} {'stage':<12} {'total s':>8}  feedback")
    ok = True
    for name, expect, r in rows:
        got = verdict(r)
        mark = "" if as_expected(got, expect) else "   <-- MISMATCH"
        ok &= as_expected(got, expect)
        head = r.feedback.strip().splitlines()[0][:70] if r.feedback.strip() else ""
        print(f"{name:<48} {expect:<12} {got:<12} {r.stage:<12} {r.timings.get('total', 0):8.1f}  {head}{mark}")
    differ = [(name, r) for name, expect, r in rows if not as_expected(verdict(r), expect)]
    for name, r in differ:  # all of it: a differing verdict is read in the log, often the only thing kept
        print(f"\n--- {name}: {verdict(r)} at {r.stage}\n{textwrap.indent(r.feedback.strip(), '    ')}")
    print(f"\n{'ALL AS EXPECTED' if ok else 'SOME VERDICTS DIFFER'}")
    return ok


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def benchmark(rows, wall: float, pch_s: float) -> dict:
    """Figures over the cold solution compiles and over the whole mix."""
    solutions = [r for name, _, r in rows if name.startswith("solution")]
    compiles = [r.diagnostics.get("build", {}) for r in solutions if isinstance(r.diagnostics.get("build"), dict)]
    compile_s = [float(b.get("seconds", 0.0)) for b in compiles if not b.get("cached")]
    phases: dict[str, list[float]] = {}
    for b in compiles:
        for k, v in (b.get("phases") or {}).items():
            phases.setdefault(k, []).append(float(v))

    def stage(key: str, pool) -> dict:
        vals = [r.timings[key] for r in pool if key in r.timings]
        return {"n": len(vals), "p50": _pct(vals, 0.5), "p90": _pct(vals, 0.9)}

    everything = [r for _, _, r in rows]
    return {
        "candidates": len(rows),
        "wall_s": wall,
        "verifications_per_minute": 60.0 * len(rows) / wall,
        "pch_wait_s": pch_s,
        "compile_s": {"n": len(compile_s), "p50": _pct(compile_s, 0.5), "p90": _pct(compile_s, 0.9)},
        "compile_phases_mean_s": {k: statistics.mean(v) for k, v in sorted(phases.items())},
        "correctness_s": stage("correctness", solutions),
        "timing_s": stage("performance", solutions),
        "baseline_s": stage("baseline", solutions),
        "sandbox_wait_s": stage("sandbox_wait", everything),
        "import_s": stage("import", everything),
        "total_s": stage("total", everything),
    }


def _print_figures(f: dict) -> None:
    def fmt(d):
        return " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())

    print("\nbenchmark (cold cache, distinct sources)")
    print(f"  device: {f['device']}")
    print(
        f"  mix: {f['candidates']} candidates in {f['wall_s']:.1f} s -> {f['verifications_per_minute']:.1f} "
        f"verifications/minute (PCH wait before the clock: {f['pch_wait_s']:.1f} s)"
    )
    print(f"  compile (cold solutions): {fmt(f['compile_s'])}")
    print(f"  compile phases, mean s: {fmt(f['compile_phases_mean_s'])}")
    for key in ("correctness_s", "timing_s", "baseline_s", "sandbox_wait_s", "import_s", "total_s"):
        print(f"  {key}: {fmt(f[key])}")


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
