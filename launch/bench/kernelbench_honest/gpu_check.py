"""Quick GPU check of the honest candidates outside the verifier: `python -m launch.bench.kernelbench_honest.gpu_check KB_ROOT`.

Builds every candidate (one process each, in parallel), then for each problem at KernelBench's own
size: inputs drawn on the GPU, the reference Model and ModelNew (with the reference's state_dict
loaded strictly) run once each, the output compared with the verifier's fp32 rule (|got - expected| <=
1e-3 * rms(expected) + 1e-3 * |expected|), and both timed with CUDA events (median of 5 after a
warm-up). TF32 off, as the verifier runs references. A smoke test for the GPU machine; the verdict
that counts is run.py's, through Kiln's verifier.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def candidates(only: list[str] | None = None) -> list[Path]:
    files = sorted(HERE.glob("level*.py"))
    return [f for f in files if not only or any(o in f.stem for o in only)]


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_all(files: list[Path], workers: int) -> dict[str, str]:
    """Import each candidate in its own process (load_inline builds it); {stem: "" or the error tail}."""

    def one(f: Path) -> tuple[str, str]:
        code = f"import importlib.util as u; s = u.spec_from_file_location('m', {str(f)!r}); s.loader.exec_module(u.module_from_spec(s))"
        r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
        return f.stem, "" if r.returncode == 0 else (r.stderr or r.stdout)[-3000:]

    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(one, files))


def check(f: Path, kb_root: Path) -> str:
    import torch

    from launch.bench.kernelbench_honest.run import reference_for

    ref_path = reference_for(f, kb_root)
    ref = _load(ref_path, "kb_ref_" + f.stem)
    cand = _load(f, "kb_cand_" + f.stem)
    torch.manual_seed(0)
    init = ref.get_init_inputs()
    model = ref.Model(*init).cuda()
    new = cand.ModelNew(*init).cuda()
    new.load_state_dict(model.state_dict(), strict=True)
    with torch.device("cuda"):
        inputs = ref.get_inputs()
    inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs]

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    with torch.no_grad():
        expected = model(*inputs)
        got = new(*inputs)
        torch.cuda.synchronize()
        if got.shape != expected.shape or got.dtype != expected.dtype:
            return f"{f.stem}: WRONG SHAPE {tuple(got.shape)} {got.dtype} vs {tuple(expected.shape)} {expected.dtype}"
        # the references here are finite: the rms of all values (no boolean indexing of a huge tensor)
        rms = (torch.linalg.vector_norm(expected).item() / expected.numel() ** 0.5) if expected.numel() else 0.0
        err = (got - expected).abs_()
        bound = expected.abs().mul_(1e-3).add_(1e-3 * rms)
        ok = bool((err <= bound).all().item())
        worst = (err / bound.clamp_min(1e-30)).max().item()
        del err, bound
        t_ref = timed(lambda: model(*inputs))
        t_new = timed(lambda: new(*inputs))
    size = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
    size += expected.numel() * expected.element_size()
    verdict = "OK " if ok else "BAD"
    return (
        f"{f.stem:<36} {verdict} worst err/bound {worst:8.3g}  {size / 2**20:8.0f} MiB  "
        f"eager {t_ref:8.3f} ms  candidate {t_new:8.3f} ms  speedup {t_ref / t_new:5.2f}x"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kb_root")
    p.add_argument("--only", nargs="*", help="substrings of candidate file names")
    p.add_argument("--build-workers", type=int, default=10)
    args = p.parse_args(argv)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    files = candidates(args.only)
    t0 = time.perf_counter()
    errors = build_all(files, args.build_workers)
    print(
        f"built {sum(1 for e in errors.values() if not e)}/{len(files)} in {time.perf_counter() - t0:.0f} s", flush=True
    )
    bad = 0
    for f in files:
        if errors[f.stem]:
            print(f"{f.stem}: BUILD FAILED\n{errors[f.stem]}", flush=True)
            bad += 1
            continue
        try:
            line = check(f, Path(args.kb_root))
        except Exception as err:  # noqa: BLE001 - report and go on to the next problem
            line = f"{f.stem}: ERROR {type(err).__name__}: {err}"
        bad += " OK " not in line
        print(line, flush=True)
        torch.cuda.empty_cache()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
