"""Maintainer tool (needs CUDA): run synthesized references at their primary (cuda) shapes on the GPU.

    python -m tasks.synth.gpu_check DIR [--limit-ms 50] [--limit-gb 2]

For every task under DIR: build `Model` and inputs on the GPU (TF32 off, as the verifier runs
references), time the eager forward (CUDA events, 3 warm-ups, median of 10), record the peak memory,
and check that the output is finite. Prints one row per task and a summary; exit status 1 when a task
fails to run, gives a non-finite output, or exceeds the time or memory limit (the budgets the
generator's primary sizes are meant to respect), else 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch

from tasks.loader import TaskLoadError, discover
from tasks.synth.checks import load_source


@dataclass(frozen=True)
class GpuRow:
    task_id: str
    ms: float | None  # median eager forward time
    peak_mb: float | None
    problem: str  # "" when the task ran finite and within limits


def time_task(path, limit_ms: float, limit_gb: float) -> GpuRow:
    task_id = f"{path.parent.name}/{path.stem}"
    try:
        module = load_source(path.read_text(encoding="utf-8"), str(path))
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs()).cuda()
        inputs = [x.cuda() for x in module.get_inputs()]
        times = []
        with torch.no_grad():
            for i in range(13):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = model(*inputs)
                end.record()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(start.elapsed_time(end))
        finite = bool(torch.isfinite(out).all())
    except Exception as err:  # noqa: BLE001 - any failure is this task's row
        return GpuRow(task_id, None, None, f"{type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}")
    finally:
        torch.cuda.empty_cache()
    ms, peak_mb = statistics.median(times), torch.cuda.max_memory_allocated() / 2**20
    problems = [
        p
        for p, bad in (
            ("non-finite output", not finite),
            (f"over {limit_ms:g} ms", ms > limit_ms),
            (f"over {limit_gb:g} GB", peak_mb > limit_gb * 1024),
        )
        if bad
    ]
    return GpuRow(task_id, ms, peak_mb, ", ".join(problems))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.synth.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("dir", help="a `kiln tasks synth` output directory")
    p.add_argument("--limit-ms", type=float, default=50.0, help="largest acceptable eager forward time")
    p.add_argument("--limit-gb", type=float, default=2.0, help="largest acceptable peak GPU memory")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available", file=sys.stderr)
        return 2
    try:
        found = discover(args.dir)
    except TaskLoadError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = [time_task(tf.path, args.limit_ms, args.limit_gb) for tf in found]
    width = max(len(r.task_id) for r in rows)
    print(f"{'task':<{width}}  {'ms':>8}  {'peak MB':>8}  problem")
    for r in rows:
        ms = f"{r.ms:8.3f}" if r.ms is not None else f"{'-':>8}"
        mb = f"{r.peak_mb:8.0f}" if r.peak_mb is not None else f"{'-':>8}"
        print(f"{r.task_id:<{width}}  {ms}  {mb}  {r.problem}")
    timed = [r.ms for r in rows if r.ms is not None]
    bad = [r for r in rows if r.problem]
    print(
        f"\n{len(rows) - len(bad)}/{len(rows)} ok on {torch.cuda.get_device_name()}; eager forward median "
        f"{statistics.median(timed):.3f} ms, max {max(timed):.3f} ms"
        if timed
        else "\nno task ran"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
