"""KernelBench coverage: `python -m launch.bench.kernelbench_coverage KB_ROOT`.

Verifies every level 1-3 reference of a KernelBench checkout (KB_ROOT/KernelBench/levelN/*.py, or
KB_ROOT/levelN/*.py) at the task's own sizes, with the reference itself as the candidate: its class
`Model` renamed `ModelNew` (the name wherever it appears, so `super(Model, self)` still resolves;
nothing else changed). Such a candidate computes with PyTorch's own operators, so each must get
`cheating` from the run-time gate: the compute fence refuses its first ATen compute op once inputs
exist. A problem that gets anything else (`runtime` of memory, `timeout`, `infra`, a pass) is a
problem the verifier cannot judge at its own size.

Verification is in-process, through the real verifier (KernelVerifier, as `kiln verify` builds it),
with a fresh cache directory: nothing is compiled for these candidates. It prints, per problem, its
level and name, the MB of one trial's inputs and reference outputs, the verdict's class and stage,
where it was decided (`run-time gate`, or another stage), the seconds it took and the sandbox limits
used; then a summary of classes and stages and the wall time. Exit status 0 when every problem got
`cheating` from the run-time gate, 1 otherwise, 2 for bad input (one line).

The whole of KernelBench takes longer than one sitting on some hosts: `--rows FILE` appends each
problem's row to FILE (JSON lines) as it finishes, and a later run with the same FILE verifies only
the problems not in it, then tabulates them all.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

LEVELS = (1, 2, 3)
_MODEL = re.compile(r"\bModel\b")
_NUMBER = re.compile(r"^(\d+)_")


class UsageError(ValueError):
    """Bad command-line input: one line, exit status 2."""


@dataclass
class Row:
    """One problem's verdict, as the table and the JSON show it."""

    level: int
    name: str
    data_mb: float | None  # one trial's inputs + reference outputs (None: the run never planned one)
    error_class: str  # "pass" for a passing verdict
    stage: str
    gate: str  # where the verdict was decided: "run-time gate", "static", "build", or the stage
    seconds: float
    limits: str  # the sandbox limits used ("-" when no sandbox ran)
    message: str  # the first line of the verdict's error or feedback
    timings: dict  # the verdict's seconds per stage (reference work, sandbox wait, import, correctness)

    @property
    def expected(self) -> bool:
        return self.error_class == "cheating" and self.gate == "run-time gate"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kb_root", metavar="KB_ROOT", help="a KernelBench checkout (holding KernelBench/level1..3)")
    p.add_argument("--backend", default="cuda", help="cuda (the problems' own device) or cpu")
    p.add_argument("--levels", default="1,2,3", help="comma-separated levels among 1,2,3 (default: all three)")
    p.add_argument("--limit", type=int, default=0, help="verify the first N problems only (0 = all)")
    p.add_argument("--concurrency", type=int, default=2, help="problems verified at once (and sandbox workers)")
    p.add_argument("--trials", type=int, default=4, help="correctness trials per problem (verifier.trials)")
    p.add_argument("--cache-dir", help="verifier cache directory (default: a fresh temporary one)")
    p.add_argument("--json", metavar="FILE", help="also write the rows and the summary as JSON")
    p.add_argument("--rows", metavar="FILE", help="append each row here as it finishes; skip problems already here")
    return p.parse_args(argv)


def problems(root: Path, levels: list[int], limit: int) -> list[tuple[int, Path]]:
    """(level, reference file) of every problem of `levels`, in KernelBench's order."""
    from tasks.loader import TaskLoadError, discover

    if not root.is_dir():
        raise UsageError(f"KernelBench checkout not found: {root}")
    base = root / "KernelBench" if (root / "KernelBench").is_dir() else root
    found: list[tuple[int, Path]] = []
    for level in levels:
        folder = base / f"level{level}"
        if not folder.is_dir():
            raise UsageError(f"no level{level} directory under {base}")
        try:
            files = discover(folder)
        except TaskLoadError as err:
            raise UsageError(str(err)) from None
        found += sorted(((level, tf.path) for tf in files), key=lambda lp: (lp[0], _order(lp[1].name)))
    return found[:limit] if limit > 0 else found


def _order(name: str) -> tuple[int, str]:
    m = _NUMBER.match(name)
    return (int(m.group(1)) if m else 1 << 30, name)


def renamed(reference: str) -> str:
    """The reference as a candidate: `Model` renamed `ModelNew`, nothing else changed."""
    return _MODEL.sub("ModelNew", reference)


def done_rows(path: Path | None) -> dict[tuple[int, str], Row]:
    """Rows an earlier run appended to `path` (--rows), by (level, problem); a torn last line (a run
    killed mid-write) is dropped from the file, and that problem verified again."""
    if path is None or not path.exists():
        return {}
    rows: dict[tuple[int, str], Row] = {}
    lines = path.read_text().splitlines()
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            row = Row(**json.loads(text))
        except (ValueError, TypeError) as err:
            if n == len(lines):  # cut off: rows appended later start on a line of their own
                path.write_text("".join(line + "\n" for line in lines[:-1]))
                continue
            raise UsageError(f"{path}:{n} is not a row of this bench ({err})") from None
        rows[(row.level, row.name)] = row
    return rows


def build_config(args: argparse.Namespace):
    from configs import VerifierConfig

    cfg = VerifierConfig()  # the schema's protocol (as kiln verify --backend cuda without --config)
    cfg.backend = args.backend
    cfg.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kiln-kb-coverage-")
    cfg.run_workers = args.concurrency
    cfg.max_concurrent_requests = args.concurrency
    cfg.trials = args.trials
    cfg.compile_baseline = "never"  # no candidate here reaches timing
    return cfg


def verify_all(cfg, jobs: list[tuple[int, Path]], concurrency: int, show) -> list[Row]:
    """Verify every job through one in-process verifier; `show(row)` as each finishes."""
    from actors.verifier.verifier import KernelVerifier
    from protocols import VerifyRequest
    from tasks.loader import TaskFile, to_task

    verifier = KernelVerifier(cfg)
    try:

        def one(job: tuple[int, Path]) -> Row:
            level, path = job
            task = to_task(TaskFile(path, f"level{level}/{path.stem}", path.stem, level), cfg.backend)
            started = time.perf_counter()
            request = VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=renamed(task.kernel.reference))
            row = to_row(level, path.stem, verifier.verify(request), time.perf_counter() - started)
            show(row)
            return row

        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            return list(pool.map(one, jobs))
    finally:
        verifier.close()


def to_row(level: int, name: str, result, seconds: float) -> Row:
    diag = result.diagnostics or {}
    limits = (diag.get("sandbox") or {}).get("limits") or {}
    if "trials" in diag:  # the verdict came from an execution (runner.py)
        ran_into = [v for v in diag.get("violations") or [] if "refused in the sandbox" in str(v)]
        gate = "run-time gate" if result.error_class == "cheating" and ran_into else result.stage
    elif "build" in diag:
        gate = "build"
    else:
        gate = "static" if result.stage == "legality" else result.stage
    text = str(diag.get("error") or result.feedback or "").strip()
    return Row(
        level=level,
        name=name,
        data_mb=limits.get("task_mb"),
        error_class="pass" if result.passed else str(result.error_class),
        stage=str(result.stage),
        gate=gate,
        seconds=round(seconds, 2),
        limits=f"{limits['memory_mb']} MB, {limits['run_timeout_s']:g} s" if limits else "-",
        message=text.splitlines()[0][:100] if text else "",
        timings={k: round(float(v), 2) for k, v in (result.timings or {}).items()},
    )


HEAD = ("level", "problem", "in+out MB", "class", "stage", "decided by", "seconds", "sandbox limits")


def line(row: Row) -> str:
    mb = f"{row.data_mb:.1f}" if row.data_mb is not None else "-"
    cells = (str(row.level), row.name[:48], mb, row.error_class, row.stage, row.gate, f"{row.seconds:.1f}", row.limits)
    return "  ".join(f"{c:<{w}}" for c, w in zip(cells, (5, 48, 9, 11, 12, 13, 7, 20), strict=True)).rstrip()


def summary(rows: list[Row], wall_s: float) -> dict:
    return {
        "problems": len(rows),
        "as_expected": sum(r.expected for r in rows),
        "classes": dict(Counter(r.error_class for r in rows)),
        "stages": dict(Counter(r.stage for r in rows)),
        "decided_by": dict(Counter(r.gate for r in rows)),
        "wall_s": round(wall_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.backend not in ("cuda", "cpu"):
            raise UsageError(f"unknown backend {args.backend!r} (choose cuda or cpu)")
        try:
            levels = sorted({int(x) for x in args.levels.split(",") if x.strip()})
        except ValueError:
            raise UsageError(f"--levels takes numbers among 1,2,3, not {args.levels!r}") from None
        if not levels or any(lv not in LEVELS for lv in levels):
            raise UsageError(f"--levels takes numbers among 1,2,3, not {args.levels!r}")
        if args.concurrency < 1 or args.trials < 1 or args.limit < 0:
            raise UsageError("--concurrency and --trials must be at least 1, --limit at least 0")
        jobs = problems(Path(args.kb_root), levels, args.limit)
        rows_file = Path(args.rows) if args.rows else None
        earlier = done_rows(rows_file)
        if args.backend == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UsageError("--backend cuda needs a visible CUDA device (use --backend cpu here)")
    except UsageError as err:
        print(f"kernelbench_coverage: {err}", file=sys.stderr)
        return 2
    print("  ".join(f"{h:<{w}}" for h, w in zip(HEAD, (5, 48, 9, 11, 12, 13, 7, 20), strict=True)).rstrip())
    for row in (earlier[(level, path.stem)] for level, path in jobs if (level, path.stem) in earlier):
        print(line(row), flush=True)
    todo = [(level, path) for level, path in jobs if (level, path.stem) not in earlier]
    started = time.perf_counter()

    def show(row: Row) -> None:
        print(line(row), flush=True)
        if rows_file is not None:
            with rows_file.open("a") as f:
                f.write(json.dumps(asdict(row)) + "\n")

    fresh = {(r.level, r.name): r for r in verify_all(build_config(args), todo, args.concurrency, show)} if todo else {}
    rows = [earlier.get((level, path.stem)) or fresh[(level, path.stem)] for level, path in jobs]
    figures = summary(rows, time.perf_counter() - started)
    figures["verified_now"] = len(todo)
    print(
        f"\n{figures['as_expected']}/{figures['problems']} cheating from the run-time gate; "
        f"classes {figures['classes']}; stages {figures['stages']}; decided by {figures['decided_by']}; "
        f"wall {figures['wall_s']:.1f} s for the {figures['verified_now']} verified in this run"
    )
    for row in rows:
        if not row.expected:
            print(f"  level{row.level}/{row.name}: {row.error_class} at {row.stage}: {row.message}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], "summary": figures}, indent=1))
    return 0 if figures["as_expected"] == figures["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
