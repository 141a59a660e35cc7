"""KernelBench's timing method, independent of Kiln's verifier: the reference the fidelity bench
(timing_fidelity.py) holds Kiln's speedups against.

`python -m launch.bench.kb_method TASK CANDIDATE --backend cuda|cpu [--shapes JSON] [--repeats 3]
[--compile-only] [--json FILE]` times the task's Model (eager) and the candidate's ModelNew in this
one process, as KernelBench's `time_execution_with_cuda_event` does: 3 warm-up calls, then 100
trials, each: synchronise the device, fill a 256 MB buffer (the L2 flush), a CUDA event, the
forward, a CUDA event, synchronise, the elapsed time; the first trial discarded; the mean. The whole
measurement is repeated `--repeats` times, so the spread of the method itself is known. On cuda it
also reports `triton.testing.do_bench` (mean). TF32 is off, as in Kiln's verifier (torch's default
lets cuDNN use it): the comparison is of the clocks, at one precision. On cpu: one intra-op thread (as Kiln's cpu timing),
`time.perf_counter` around the forward, the same counts. Inputs are drawn once with seed 42, as
KernelBench does.

It imports nothing from `actors.verifier`: the point is a second opinion. The candidate is compiled
in this process (torch's load_inline); `--compile-only` builds it and exits, so a caller can build
many candidates in parallel before timing them one at a time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

WARMUP = 3
TRIALS = 100
DISCARD_FIRST = 1
FLUSH_ELEMENTS = 32 * 1024 * 1024  # int64: 256 MB, KernelBench's L2 flush


def load_module(path: Path, name: str, shapes: dict):
    """Import a KernelBench-format file; `shapes` overrides its module-level size constants."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key, value in shapes.items():
        setattr(module, key, value)
    return module


def cuda_event_times(fn, args: list, device: torch.device) -> list[float]:
    """Seconds per trial by KernelBench's cuda_event method."""
    for _ in range(WARMUP):
        fn(*args)
        torch.cuda.synchronize(device)
    times = []
    for trial in range(TRIALS + DISCARD_FIRST):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dummy = torch.empty(FLUSH_ELEMENTS, dtype=torch.int64, device=device)
        dummy.fill_(42)
        del dummy
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize(device)
        if trial >= DISCARD_FIRST:
            times.append(start.elapsed_time(end) * 1e-3)
    return times


def host_times(fn, args: list) -> list[float]:
    """Seconds per trial on the cpu: the monotonic clock around the forward."""
    for _ in range(WARMUP):
        fn(*args)
    times = []
    for trial in range(TRIALS + DISCARD_FIRST):
        t0 = time.perf_counter()
        fn(*args)
        took = time.perf_counter() - t0
        if trial >= DISCARD_FIRST:
            times.append(took)
    return times


def measure(task: Path, candidate: Path, backend: str, shapes: dict, repeats: int) -> dict:
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    if backend == "cpu":
        torch.set_num_threads(1)
    else:
        # Kiln runs references at full fp32 (its correctness check holds candidates to fp32); torch's
        # default lets cuDNN use TF32. The fidelity bench compares clocks, so both sides run fp32.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    ref = load_module(task, "kb_reference", shapes)
    new = load_module(candidate, "kb_candidate", {})
    torch.manual_seed(42)
    init = list(ref.get_init_inputs())
    torch.manual_seed(42)
    model = ref.Model(*init).to(device)
    torch.manual_seed(42)
    model_new = new.ModelNew(*init).to(device)
    try:
        model_new.load_state_dict(model.state_dict())
    except (RuntimeError, KeyError):
        pass
    torch.manual_seed(42)
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in ref.get_inputs()]
    out = {"eager_s": [], "candidate_s": [], "eager_median_s": [], "candidate_median_s": []}
    with torch.no_grad():
        for _ in range(repeats):
            for key, fn in (("eager", model), ("candidate", model_new)):
                times = cuda_event_times(fn, inputs, device) if backend == "cuda" else host_times(fn, inputs)
                out[f"{key}_s"].append(statistics.fmean(times))
                out[f"{key}_median_s"].append(statistics.median(times))
        if backend == "cuda":
            from triton.testing import do_bench

            out["do_bench_eager_s"] = do_bench(lambda: model(*inputs), return_mode="mean") * 1e-3
            out["do_bench_candidate_s"] = do_bench(lambda: model_new(*inputs), return_mode="mean") * 1e-3
    out["speedups"] = [e / c for e, c in zip(out["eager_s"], out["candidate_s"], strict=True)]
    if backend == "cuda":
        out["do_bench_speedup"] = out["do_bench_eager_s"] / out["do_bench_candidate_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", type=Path)
    p.add_argument("candidate", type=Path)
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shapes", default="{}", help="JSON object of the task's size constants to override")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for path in (args.task, args.candidate):
        if not path.is_file():
            print(f"kb_method: no such file: {path}", file=sys.stderr)
            return 2
    try:
        shapes = json.loads(args.shapes)
        if args.compile_only:
            load_module(args.candidate, "kb_candidate", {})
            return 0
        result = measure(args.task, args.candidate, args.backend, shapes, max(1, args.repeats))
    except Exception as err:  # noqa: BLE001 - a candidate or task that does not run: one line
        print(f"kb_method: {type(err).__name__}: {str(err)[:300]}", file=sys.stderr)
        return 1
    text = json.dumps(result)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
