"""`kiln verify`: check one candidate against one reference, or a whole set of solutions.

    kiln verify --reference REF.py --candidate CAND [--backend cpu|cuda] [--json] [section.key=value ...]
    kiln verify --tasks DIR --solutions DIR [--backend cpu|cuda] [--json] [section.key=value ...]

CAND may be a plain .py file or raw model output with a fenced code block. Exit status is 0 whenever
verification ran, whatever the verdict; usage errors (a missing file, an unknown backend) print one
line and exit 2. With --json, stdout holds exactly one JSON object, the verdict the verifier recorded:
while verifying, descriptor 1 points at stderr (compilers and libraries may print), the real stdout
is held only by a close-on-exec copy in this process, which no child (and so no candidate) ever
holds, and the object is written through it after every sandbox is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launch.config_args import load_for_backend
from launch.driver.checks import verify_problem
from protocols import Task, VerifyRequest, VerifyResult, verdict_json

BACKENDS = ("cpu", "cuda")


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit status 2."""


def add_verify_parser(sub) -> None:
    from launch.config_args import add_config_arguments

    p = sub.add_parser("verify", help="verify a candidate kernel (or a set of solutions) against its reference")
    p.add_argument("--reference", metavar="REF", help="KernelBench-format reference file (Model, get_inputs, ...)")
    p.add_argument("--candidate", metavar="CAND", help="candidate: a .py file or raw model output with a code block")
    p.add_argument("--tasks", metavar="DIR", help="verify a set: task directory (tasks/, KernelBench/level1, ...)")
    p.add_argument("--solutions", metavar="DIR", help="with --tasks: solutions with the tasks' file names")
    p.add_argument("--backend", help="cpu or cuda (default: verifier.backend from the config)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_config_arguments(p)
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    try:
        cfg, jobs = _plan(args)
        problem = verify_problem(cfg.backend, args.tasks, jobs)  # the start-up checks' entry guard
        if problem:
            raise UsageError(problem)
    except UsageError as err:
        print(f"kiln verify: {err}", file=sys.stderr)
        return 2
    from actors.verifier.verifier import KernelVerifier

    with _real_stdout(args.json) as out:
        verifier = KernelVerifier(cfg)
        try:
            results = _run(verifier, jobs, cfg.max_concurrent_requests)
        finally:
            verifier.close()
        if args.reference:
            ((_, result, _),) = results
            out(json.dumps(result_json(result)) if args.json else _text(result))
        else:
            out(
                json.dumps(
                    {
                        "results": [
                            result_json(r) if r else {"task_id": t.task_id, "missing": True} for t, r, _ in results
                        ]
                    }
                )
                if args.json
                else _table(results)
            )
    return 0


def _plan(args: argparse.Namespace):
    """Validate the command line; (verifier config, [(task, candidate text or None)])."""
    from tasks.loader import TaskLoadError, discover, solution_for, to_task

    single, batch = bool(args.reference or args.candidate), bool(args.tasks or args.solutions)
    if single == batch:
        raise UsageError("give either --reference and --candidate, or --tasks and --solutions")
    if single and not (args.reference and args.candidate):
        raise UsageError("--reference and --candidate go together")
    if batch and not (args.tasks and args.solutions):
        raise UsageError("--tasks and --solutions go together")
    if args.backend is not None and args.backend not in BACKENDS:
        raise UsageError(f"unknown backend {args.backend!r} (choose cpu or cuda)")
    cfg = load_for_backend(args.config, args.overrides, args.backend).verifier
    try:
        if single:
            for path in (args.reference, args.candidate):
                if not Path(path).is_file():
                    raise UsageError(f"file not found: {path}")
            found = discover(args.reference)
            return cfg, [(to_task(found[0], cfg.backend), _read(args.candidate))]
        if not Path(args.solutions).is_dir():
            raise UsageError(f"solutions directory not found: {args.solutions}")
        jobs = []
        for tf in discover(args.tasks):
            sol = solution_for(tf, args.solutions)
            jobs.append((to_task(tf, cfg.backend), _read(str(sol)) if sol else None))
        return cfg, jobs
    except TaskLoadError as err:
        raise UsageError(str(err)) from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror}") from None


def _run(verifier, jobs: list[tuple[Task, str | None]], parallel: int):
    def one(job):
        task, candidate = job
        if candidate is None:
            return task, None, 0.0
        t0 = time.perf_counter()
        req = VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=candidate)
        return task, verifier.verify(req), time.perf_counter() - t0

    with ThreadPoolExecutor(max(1, min(parallel, len(jobs)))) as pool:
        return list(pool.map(one, jobs))


def result_json(r: VerifyResult) -> dict:
    return verdict_json.to_json(r)


def _text(r: VerifyResult) -> str:
    verdict = "PASS" if r.passed else f"FAIL ({r.error_class})"
    speed = f", speedup {r.speedup_eager:.2f}x vs eager" if r.speedup_eager else ""
    return f"{r.task_id}: {verdict} at stage {r.stage}, q={r.q:.2f}, score={r.score:.3f}{speed}\n{r.feedback}"


def _table(rows) -> str:
    head = ("task", "verdict", "stage", "q", "score", "speedup", "seconds", "feedback")
    lines = []
    for task, r, secs in rows:
        if r is None:
            lines.append((task.task_id, "MISSING", "-", "-", "-", "-", "-", "no solution file"))
            continue
        first = r.feedback.strip().splitlines()[0] if r.feedback.strip() else ""
        lines.append(
            (
                task.task_id,
                "PASS" if r.passed else f"FAIL:{r.error_class}",
                r.stage,
                f"{r.q:.2f}",
                f"{r.score:.3f}",
                f"{r.speedup_eager:.2f}x" if r.speedup_eager else "-",
                f"{secs:.1f}",
                first[:90],
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    body = [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*line) for line in lines]
    passed = sum(1 for _, r, _ in rows if r is not None and r.passed)
    verified = sum(1 for _, r, _ in rows if r is not None)
    body.append(f"\n{passed}/{verified} passed ({len(rows) - verified} without a solution)")
    return "\n".join(body)


@contextlib.contextmanager
def _real_stdout(json_mode: bool):
    """Yield a function that prints to the real stdout. With --json, descriptor 1 points at stderr for
    the whole run, and the real stdout survives only as a close-on-exec copy private to this process."""
    if not json_mode:
        yield print
        return
    sys.stdout.flush()
    saved = os.dup(1)  # os.dup makes it non-inheritable: no subprocess ever gets it
    os.set_inheritable(saved, False)
    os.dup2(2, 1)

    def out(text: str) -> None:
        data = (text + "\n").encode()
        while data:
            data = data[os.write(saved, data) :]

    try:
        yield out
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
