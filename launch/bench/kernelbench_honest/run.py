"""Verify the honest candidates against their KernelBench references through Kiln's verifier.

    python -m launch.bench.kernelbench_honest.run KB_ROOT [--backend cuda|cpu] [--json F]
        [--only SUBSTR ...] [--cache-dir DIR] [--concurrency N] [verifier.key=value ...]

KB_ROOT is a KernelBench checkout (the directory holding KernelBench/level1, or level1 itself). Each
candidate file here names its problem in its docstring ("KernelBench level1/4_..."); the reference is
that file under KB_ROOT. The candidates are verified two at a time by default (one builds while the
other runs; their trials are gigabytes of host memory each, so not many more) by an
in-process KernelVerifier with the schema's protocol (as `kiln verify --backend cuda`; overrides as
`verifier.key=value`), and a table is printed: problem, input+output MB at KernelBench's sizes,
verdict class, stage, speedup vs eager, seconds. Usage errors and a machine that cannot run the
backend (no CUDA device) print one line and exit 2; otherwise the exit status is 0 when every
candidate passed, 1 when not.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from protocols.pyparse import parse_python

HERE = Path(__file__).resolve().parent
PROBLEM = re.compile(r"KernelBench (level\d)/(\S+?)[\s,;:()]")


class UsageError(ValueError):
    """Printed as one line; exit status 2."""


def candidate_files() -> list[Path]:
    return sorted(HERE.glob("level*.py"), key=lambda p: [int(n) for n in re.findall(r"\d+", p.stem)])


def problem_of(path: Path) -> tuple[str, str]:
    """(level, problem file stem) named by the candidate's module docstring."""
    doc = ast.get_docstring(parse_python(path.read_text(encoding="utf-8"))) or ""
    m = PROBLEM.search(doc + " ")
    if not m:
        raise UsageError(f"{path.name}: its docstring names no KernelBench problem")
    return m.group(1), m.group(2)


def kb_levels_root(kb_root: Path) -> Path:
    """The directory holding level1/, level2/, ... inside a KernelBench checkout."""
    for root in (kb_root / "KernelBench", kb_root):
        if (root / "level1").is_dir():
            return root
    raise UsageError(f"not a KernelBench checkout (no level1/ or KernelBench/level1/): {kb_root}")


def reference_for(path: Path, kb_root: Path) -> Path:
    level, stem = problem_of(path)
    ref = kb_levels_root(kb_root) / level / f"{stem}.py"
    if not ref.is_file():
        raise UsageError(f"{path.name}: reference {level}/{stem}.py not found under {kb_root}")
    return ref


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of the usage text
        raise UsageError(message)


def parse_args(argv):
    p = _Parser(prog="python -m launch.bench.kernelbench_honest.run", description=__doc__.split("\n\n")[0])
    p.add_argument("kb_root", metavar="KB_ROOT", nargs="?", help="KernelBench checkout")
    p.add_argument("--backend", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--json", metavar="F", help="also write the results as JSON to F")
    p.add_argument("--only", nargs="+", metavar="SUBSTR", help="only candidates whose file name contains one of these")
    p.add_argument("--cache-dir", help="verifier cache (default: a fresh temporary directory)")
    p.add_argument("--concurrency", type=int, default=2, help="candidates verified at once (builds overlap runs)")
    p.add_argument("overrides", nargs="*", metavar="verifier.key=value", help="verifier settings")
    return p.parse_args(argv)


def plan(args) -> list[tuple[Path, Path]]:
    """Validate the command line; [(candidate, reference)]."""
    if args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    if args.backend not in ("cuda", "cpu"):
        raise UsageError(f"unknown backend {args.backend!r} (choose cuda or cpu)")
    for o in args.overrides:
        if not re.fullmatch(r"verifier\.[\w.]+=.*", o):
            raise UsageError(f"overrides look like verifier.key=value, not {o!r}")
    if not args.kb_root:
        raise UsageError("KB_ROOT is required (a KernelBench checkout)")
    kb_root = Path(args.kb_root)
    if not kb_root.is_dir():
        raise UsageError(f"KB_ROOT not found: {kb_root}")
    files = [f for f in candidate_files() if not args.only or any(s in f.name for s in args.only)]
    if not files:
        raise UsageError("no candidate matches --only")
    return [(f, reference_for(f, kb_root)) for f in files]


def problem_mb(ref: Path) -> float | None:
    """Input + reference output bytes at KernelBench's sizes, computed on meta tensors (MB = 2**20)."""
    from launch.bench.kernelbench_honest.sizes import problem_bytes

    try:
        i, o, _ = problem_bytes(ref)
    except Exception:  # noqa: BLE001 - a size that cannot be computed is shown as "?"
        return None
    return (i + (o or 0)) / 2**20


def verifier_config(args):
    from launch.config_args import load_for_backend

    cfg = load_for_backend(None, list(args.overrides), args.backend).verifier
    cfg.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kiln-kb-honest-")
    cfg.compile_baseline = "never"
    return cfg


def machine_problem(backend: str) -> str:
    if backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "backend cuda needs a CUDA device and none is visible on this machine (torch.cuda.is_available() is False)"
    return ""


def run(args) -> int:
    jobs = plan(args)
    why = machine_problem(args.backend)
    if why:
        raise UsageError(why)
    from actors.verifier.verifier import KernelVerifier
    from launch.stages.verify import result_json
    from protocols import VerifyRequest
    from tasks.loader import discover, to_task

    cfg = verifier_config(args)
    print(f"verifying {len(jobs)} candidates on {args.backend}, cache {cfg.cache_dir}", flush=True)
    verifier = KernelVerifier(cfg)

    def one(job: tuple[Path, Path]):
        cand, ref = job
        task = to_task(discover(ref)[0], cfg.backend)
        req = VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=cand.read_text(encoding="utf-8"))
        t0 = time.perf_counter()
        result = verifier.verify(req)
        row = (task.task_id, problem_mb(ref), result, time.perf_counter() - t0)
        print(f"  {_row(row)}", flush=True)
        return row

    try:
        with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
            rows = list(pool.map(one, jobs))
    finally:
        verifier.close()
    print()
    print(table(rows))
    if args.json:
        payload = [{"problem": pid, "mb": mb, "seconds": secs, "result": result_json(r)} for pid, mb, r, secs in rows]
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
    return 0 if all(r.passed for _, _, r, _ in rows) else 1


def _row(row) -> str:
    pid, mb, r, secs = row
    verdict = "pass" if r.passed else (r.error_class or "fail")
    speed = f"{r.speedup_eager:.2f}x" if r.speedup_eager else "-"
    size = f"{mb:.0f}" if mb is not None else "?"
    head = r.feedback.strip().splitlines()[0][:80] if r.feedback.strip() else ""
    return f"{pid:<50} {size:>9} {verdict:<12} {r.stage:<12} {speed:>8} {secs:8.1f}  {head}"


def table(rows) -> str:
    head = f"{'problem':<50} {'in+out MB':>9} {'verdict':<12} {'stage':<12} {'vs eager':>8} {'seconds':>8}  feedback"
    passed = sum(1 for _, _, r, _ in rows if r.passed)
    return "\n".join([head, *(_row(r) for r in rows), f"\n{passed}/{len(rows)} passed"])


def main(argv=None) -> int:
    try:
        return run(parse_args(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        print(f"kernelbench_honest: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the verifier could not start here: one line, not a traceback
        print(f"kernelbench_honest: {type(err).__name__}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
