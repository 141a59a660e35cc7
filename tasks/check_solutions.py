#!/usr/bin/env python
"""Maintainer tool: validate the shipped Kiln task set (references and reference solutions).

Modes
  --refs-only                      check every reference module (CPU sizes + alt shapes; add
                                   --full-size to also run the default CUDA sizes on the CPU)
  --backend cpu                    build every cpu solution, compare with the reference on the CPU
                                   sizes and every alt shape, several seeds, with an ATen-dispatch
                                   recorder that fails on any non-plumbing op inside ModelNew.forward
  --backend cuda --compile-only    no GPU needed: extract the load_inline sources of every cuda
                                   solution and compile them (nvcc for cuda_sources, g++ syntax check
                                   for cpp_sources); missing toolkit headers are shimmed and reported
  --backend cuda                   on a GPU machine: build, run on the GPU (default sizes + alt shapes),
                                   compare with the reference (TF32 off), same legality recorder
Common options: --only SUBSTR (filter on "levelK/NN_name"), --seeds N, --jobs N (parallel builds).

Builds go to $TORCH_EXTENSIONS_DIR (default /tmp/kiln-task-builds) so re-runs reuse them.
Exit status is 0 only if every selected check passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from check_common import (
    OpRecorder,
    Row,
    Shapes,
    Task,
    compare_with_reference,
    compute_ops,
    discover,
    load_module,
    print_table,
    static_forward_issues,
    static_native_issues,
    tensors_to,
)
from check_cuda_compile import compile_only_cuda, extract_sources


def check_reference(task: Task, full_size: bool) -> Row:
    row = Row(task.key, "reference")
    t0 = time.time()
    try:
        mod = load_module(task.ref_path, "ref")
        doc = (mod.__doc__ or "").strip()
        if not doc:
            row.fail("no module docstring")
        for attr in ("Model", "get_inputs", "get_init_inputs", "KILN_CPU_SHAPES", "KILN_ALT_SHAPES"):
            if not hasattr(mod, attr):
                row.fail(f"missing {attr}")
        sh = Shapes(mod)
        if not sh.alts:
            row.notes.append("no alt shapes")
        configs = [(f"cpu-{lbl}", layers) for lbl, layers in sh.configs("cpu")]
        if full_size:
            configs.insert(0, ("cuda-base", []))
        for label, layers in configs:
            row.cases += 1
            sh.apply(*layers)
            torch.manual_seed(0)
            model = mod.Model(*mod.get_init_inputs())
            inputs = mod.get_inputs()
            if any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in inputs):
                row.fail(f"{label}: get_inputs must return CPU tensors")
            with torch.no_grad():
                out = model(*inputs)  # warm-up (lazy initialisation inside torch)
                dt = float("inf")
                for _ in range(3):
                    t1 = time.perf_counter()
                    out = model(*inputs)
                    dt = min(dt, time.perf_counter() - t1)
            outs = out if isinstance(out, (tuple, list)) else [out]
            finite = all(torch.isfinite(o).all().item() for o in outs)
            nbytes = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
            if not finite:
                row.fail(f"{label}: non-finite output")
            else:
                row.passed += 1
            row.notes.append(f"{label}:{tuple(outs[0].shape)} {dt * 1e3:.0f}ms in={nbytes / 2**20:.1f}MiB")
        sh.apply()
    except Exception as e:  # noqa: BLE001 - a check tool: any failure is this row's verdict
        row.fail(f"error: {type(e).__name__}: {e}")
        traceback.print_exc()
    row.secs = time.time() - t0
    return row


# --------------------------------------------------------------------------- solution runs
def _prebuild(path_str: str) -> tuple[str, float, str | None]:
    t0 = time.time()
    try:
        load_module(Path(path_str), "prebuild")
        return path_str, time.time() - t0, None
    except Exception as e:  # noqa: BLE001
        return path_str, time.time() - t0, f"{type(e).__name__}: {str(e)[-2000:]}"


def prebuild(paths: list[Path], jobs: int) -> dict[str, tuple[float, str | None]]:
    res = {}
    if jobs <= 1:
        for p in paths:
            _, dt, err = _prebuild(str(p))
            res[str(p)] = (dt, err)
        return res
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        for p, dt, err in ex.map(_prebuild, [str(p) for p in paths]):
            res[p] = (dt, err)
    return res


def _storages(ts):
    out = set()
    for t in ts:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            out.add(t.untyped_storage().data_ptr())
    return out


@dataclass
class _Seen:
    """What one solution's runs add up to beyond pass/fail: the ops it dispatched, whether its
    initialisation differed from the reference's, its slowest base-shape forward."""

    ops: dict[str, int] = field(default_factory=dict)
    init_mismatch: bool = False
    fwd_ms: float = 0.0


def run_solution(task: Task, backend: str, seeds: int, build_info) -> Row:
    row = Row(task.key, f"{backend} solution")
    path = task.sol_path(backend)
    if not path.exists():
        row.fail("no solution file")
        return row
    device = "cuda" if backend == "cuda" else "cpu"
    t0 = time.time()
    try:
        ref = load_module(task.ref_path, "ref")
        t1 = time.time()
        sol = load_module(path, backend)
        load_s = time.time() - t1
        pre = build_info.get(str(path))
        row.notes.append(f"build {pre[0]:.1f}s" if pre else f"import+build {load_s:.1f}s")
        _static_checks(row, sol, path, backend)
        sh = Shapes(ref)
        seen = _Seen()
        for label, layers in sh.configs(backend):
            for s in range(seeds):
                sh.apply(*layers)
                _run_seed(row, seen, ref, sol, label, s, device)
        sh.apply()
        if seen.init_mismatch:
            row.notes.append("WARN ModelNew init differs from Model under the same seed")
        row.notes.append(f"base fwd {seen.fwd_ms:.1f}ms")
        row.notes.append("ops=" + ",".join(f"{k}x{v}" for k, v in sorted(seen.ops.items())))
    except Exception as e:  # noqa: BLE001 - a check tool: any failure is this row's verdict
        row.fail(f"error: {type(e).__name__}: {str(e)[-600:]}")
        traceback.print_exc()
    row.secs = time.time() - t0
    return row


def _static_checks(row: Row, sol, path: Path, backend: str) -> None:
    """The verifier's static scans of the solution's Python and of its load_inline sources."""
    for issue in static_forward_issues(sol):
        row.fail(f"static: {issue}")
    calls, _ = extract_sources(path)  # re-import with load_inline recorded, for the static scan
    for c in calls:
        native = "\n".join(c["cpp"] + c["cuda"])
        for issue in static_native_issues(native):
            row.fail(f"static: {issue}")
        if backend == "cpu" and c["cuda"]:
            row.fail(f"{c['name']}: cpu solution has cuda_sources")
        if backend == "cuda" and "__global__" not in native:
            row.fail(f"{c['name']}: no __global__ kernel")


def _run_seed(row: Row, seen: _Seen, ref, sol, label: str, s: int, device: str) -> None:
    """Model and ModelNew under one seed (ModelNew given Model's weights), then two input sets
    through the one instance: a result cached across calls shows up on the second."""
    seed = 1000 * s + 17
    init = ref.get_init_inputs()
    torch.manual_seed(seed)
    model = ref.Model(*init).to(device)
    torch.manual_seed(seed)
    new = sol.ModelNew(*init).to(device)
    sd = model.state_dict()
    if sd:
        nsd = new.state_dict()
        if set(nsd) != set(sd) or any(nsd[k].shape != sd[k].shape for k in sd):
            row.fail(f"{label}: ModelNew state_dict names/shapes differ from Model")
            return
        if any(not torch.equal(nsd[k], sd[k]) for k in sd):
            seen.init_mismatch = True
        new.load_state_dict(sd, strict=True)
    params = list(new.parameters()) + list(new.buffers())
    for rep in range(2):
        torch.manual_seed(seed + 7919 * (rep + 1))
        inputs = tensors_to(ref.get_inputs(), device)
        case = f"{label}/seed{s}/in{rep}"
        _run_case(row, seen, ref, (model, new, params), inputs, case, label == "base" and rep == 1, device)


def _run_case(row: Row, seen: _Seen, ref, models: tuple, inputs: list, case: str, timed: bool, device: str) -> None:
    """One call of ModelNew, judged by the verifier's rules: only allowed ATen ops in forward, inputs
    untouched, a fresh output tensor, and the verifier's comparison with the reference's output."""
    model, new, params = models
    saved = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    with torch.no_grad():
        expected = model(*inputs)
    rec = OpRecorder()
    t1 = time.perf_counter()
    with torch.no_grad(), rec:
        got = new(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    if timed:
        seen.fwd_ms = max(seen.fwd_ms, (time.perf_counter() - t1) * 1e3)
    for k, v in rec.ops.items():
        seen.ops[k] = seen.ops.get(k, 0) + v
    row.cases += 1
    bad = compute_ops(rec.ops)
    if bad:
        row.fail(f"{case}: compute ops in forward: {bad}")
    elif any(isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(inputs, saved, strict=True)):
        row.fail(f"{case}: an input was mutated")
    elif not isinstance(got, torch.Tensor):
        row.fail(f"{case}: output is {type(got).__name__}, not a tensor")
    elif _storages([got]) & _storages(list(inputs) + params):
        row.fail(f"{case}: output aliases an input or parameter")
    else:
        check = compare_with_reference(got, expected, ref)
        if check.max_abs_error == check.max_abs_error:  # NaN where an output holds NaN: the message says so
            row.max_err = max(row.max_err, check.max_abs_error)
        if check.ok:
            row.passed += 1
        else:
            row.fail(f"{case}: {check.message}")


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--only", default=None, help="substring filter on 'levelK/NN_name'")
    ap.add_argument("--refs-only", action="store_true", help="only check the reference modules")
    ap.add_argument("--no-refs", action="store_true", help="skip the reference checks")
    ap.add_argument("--full-size", action="store_true", help="also run references at the default (CUDA) sizes on CPU")
    ap.add_argument("--compile-only", action="store_true", help="cuda: compile the extracted sources, do not run")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="parallel builds")
    ap.add_argument("--std", default="c++20", help="C++ standard for --compile-only (torch 2.13 builds with c++20)")
    ap.add_argument("--arch", default="sm_90", help="nvcc -arch for --compile-only")
    args = ap.parse_args(argv)

    tasks = discover(args.only)
    if not tasks:
        print("no tasks selected")
        return 1
    rows: list[Row] = []
    if not args.no_refs:
        for t in tasks:
            rows.append(check_reference(t, args.full_size))
            print(f"[ref] {t.key}: {'ok' if rows[-1].ok else 'FAIL'} {'; '.join(rows[-1].notes)}", flush=True)
    if not args.refs_only:
        if args.backend == "cuda" and args.compile_only:
            rows += compile_only_cuda(tasks, args.jobs, args.std, args.arch)
        else:
            if args.backend == "cuda":
                if not torch.cuda.is_available():
                    print("--backend cuda needs a GPU (use --compile-only here)")
                    return 2
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            paths = [t.sol_path(args.backend) for t in tasks if t.sol_path(args.backend).exists()]
            t0 = time.time()
            info = prebuild(paths, args.jobs)
            print(f"[build] {len(paths)} extensions ready in {time.time() - t0:.0f}s wall", flush=True)
            for p, (_dt, err) in info.items():
                if err:
                    print(f"[build] FAILED {p}:\n{err}\n")
            for t in tasks:
                rows.append(run_solution(t, args.backend, args.seeds, info))
                print(f"[{args.backend}] {t.key}: {'ok' if rows[-1].ok else 'FAIL'}", flush=True)
    print_table(rows)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
