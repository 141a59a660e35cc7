"""Compile-time benchmark: `python -m launch.bench.compile [--backend cpu|cuda]`.

Compiles a fixed mix of the shipped solutions (tasks/solutions/<backend>/), each made distinct by
a unique comment appended to its cpp_sources (so nothing hits a cache), one candidate at a time,
and prints p50/p90 per-candidate compile time and where the time goes, for
  lean        BuildService, lean prelude + PCH (cold: kernel and binding TUs both compiled)
  lean-warm   the same with a fresh comment again: kernel cold, binding from cache (the common case
              in RL, where many samples of one task share the bound signatures)
  full        BuildService with prelude_policy="full" (load_inline's headers, precompiled)
  load_inline torch's own load_inline in a fresh process per candidate (fresh build dir), the baseline
Precompiled headers are built first and reported separately: they are built once per toolchain
and machine. `--budget-s` bounds the whole run (modes stop early and say how many they measured).

`python -m launch.bench.compile --compare-nvcc nvcc ARGS... -c x.cu -o x.o` instead times
plain nvcc against Kiln's parallel front-end schedule (nvcc.py) on one command.

`--backend cuda --modes facade,lean,load_inline` on a GPU host: facade is the default policy (the
CUDA facade tried first, facade.py), lean the same service with the facade off.

`python -m launch.bench.compile --cuda-units [--n N] [--phase-n K]` (any machine with nvcc, no GPU
needed): the compile step only (no link, no jail), each shipped CUDA solution made distinct and
compiled cold as the builder does it (the .cu unit and its thunk binding concurrently), with the
lean CUDA prelude and with the facade side by side, alternating which goes first; then nvcc's
phases (cudafe++, cicc, ptxas, the host g++) timed one by one for the first K candidates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Prepended to each candidate: appends a unique comment to cpp_sources of every load_inline call,
# so each run of each candidate is a cold compile for both Kiln and torch's own builder.
UNIQUE_PREFIX = """
import torch.utils.cpp_extension as _kiln_bench_ce
_kiln_bench_orig = _kiln_bench_ce.load_inline
def _kiln_bench_unique(name, cpp_sources, *args, **kwargs):
    cpp = [cpp_sources] if isinstance(cpp_sources, str) else list(cpp_sources)
    return _kiln_bench_orig(name, cpp + ["// kiln-bench {nonce}"], *args, **kwargs)
_kiln_bench_ce.load_inline = _kiln_bench_unique
"""

BASELINE_CHILD = """
import os, sys, time
import torch
src = open(sys.argv[1]).read()
t0 = time.monotonic()
exec(compile(src, "candidate.py", "exec"), {"__name__": "candidate"})
print("KILN_BENCH_SECONDS", time.monotonic() - t0)
"""


def pick_candidates(backend: str, n: int) -> list[Path]:
    files = sorted((REPO / "tasks" / "solutions" / backend).glob("level*/*.py"))
    if not files:
        raise SystemExit(f"no solutions under tasks/solutions/{backend}")
    if n >= len(files):
        return files
    step = len(files) / n
    return [files[int(i * step)] for i in range(n)]


def unique_source(path: Path) -> str:
    return UNIQUE_PREFIX.format(nonce=uuid.uuid4().hex) + path.read_text()


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_service_mode(label, files, backend, policy, pch_dir, deadline, passes=1):
    """Returns {label: rows} for `passes` passes over `files` with one service and one cache."""
    from actors.verifier.build import BuildService

    out = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as cache:
        svc = BuildService(
            Path(cache), backend, workers=1, timeout_s=600, prelude_policy=policy, pch="use", pch_dir=pch_dir
        )
        try:
            for p in range(passes):
                rows = []
                for f in files:
                    if time.monotonic() > deadline:
                        break
                    r = svc.submit(unique_source(f)).result()
                    rows.append(
                        {
                            "file": str(f.relative_to(REPO)),
                            "ok": r.ok,
                            "seconds": r.seconds,
                            "phases": r.phases,
                            "preludes": list(r.preludes.values()),
                            "notes": r.notes,
                            "error": r.error[:300],
                        }
                    )
                    print(
                        f"  {label if p == 0 else label + '-warm':<11} {f.parent.name}/{f.name:<32} "
                        f"{r.seconds:6.1f}s ok={r.ok} {','.join(r.preludes.values())}",
                        flush=True,
                    )
                    for note in r.notes:  # a refused precompiled prelude explains a slow compile
                        if "was not used" in note:
                            print(f"      {note}", flush=True)
                out[label if p == 0 else f"{label}-warm"] = rows
        finally:
            svc.close()
    return out


def run_baseline(files, deadline):
    rows = []
    for f in files:
        if time.monotonic() > deadline:
            break
        with tempfile.TemporaryDirectory(prefix="kiln-bench-li-") as d:
            src = Path(d) / "candidate.py"
            src.write_text(unique_source(f))
            env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(Path(d) / "ext")}
            t0 = time.monotonic()
            p = subprocess.run(
                [sys.executable, "-c", BASELINE_CHILD, str(src)],
                capture_output=True,
                text=True,
                env=env,
                cwd=d,
                timeout=max(deadline - time.monotonic(), 1) + 600,
                check=False,
            )
            wall = time.monotonic() - t0
        seconds = next(
            (float(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("KILN_BENCH_SECONDS")), None
        )
        rows.append(
            {
                "file": str(f.relative_to(REPO)),
                "ok": p.returncode == 0 and seconds is not None,
                "seconds": seconds if seconds is not None else wall,
                "process_wall": wall,
                "phases": {},
                "error": p.stderr[-300:] if p.returncode else "",
            }
        )
        print(
            f"  load_inline {f.parent.name}/{f.name:<32} {rows[-1]['seconds']:6.1f}s "
            f"(process {wall:.1f}s) ok={rows[-1]['ok']}",
            flush=True,
        )
    return rows


def summarize(results: dict) -> str:
    lines = [f"{'mode':<12} {'n':>3} {'ok':>3} {'p50 s':>7} {'p90 s':>7} {'mean s':>7}  mean phases (s)"]
    for mode, rows in results.items():
        secs = [r["seconds"] for r in rows]
        phases: dict[str, list[float]] = {}
        for r in rows:
            for k, v in r["phases"].items():
                phases.setdefault(k, []).append(v)
        shown = ", ".join(
            f"{k} {statistics.mean(v):.2f}"
            for k, v in sorted(phases.items())
            if k not in ("fork", "import", "capture") and statistics.mean(v) >= 0.01
        )
        lines.append(
            f"{mode:<12} {len(rows):>3} {sum(r['ok'] for r in rows):>3} {percentile(secs, 0.5):7.1f} "
            f"{percentile(secs, 0.9):7.1f} {statistics.mean(secs) if secs else float('nan'):7.1f}  {shown}"
        )
    return "\n".join(lines)


def shipped_cuda_specs(files: list[Path], extra_include: str) -> list[tuple[Path, object]]:
    """The ExtensionSpec of each solution's load_inline call, made distinct (a unique comment in
    its C++ and CUDA sources), with `extra_include` on its include path."""
    import inspect

    import torch.utils.cpp_extension as cpp_ext

    from actors.verifier.build.spec import spec_from_call

    orig = cpp_ext.load_inline
    out = []

    def recorder(f: Path):
        """A load_inline stand-in that records `f`'s call instead of building it."""

        def record(*args, **kwargs):
            call = inspect.signature(orig).bind(*args, **kwargs).arguments
            nonce = f"\n// kiln-bench {uuid.uuid4().hex}\n"
            for key in ("cpp_sources", "cuda_sources"):
                src = call.get(key) or []
                call[key] = ([src] if isinstance(src, str) else list(src)) + [nonce]
            call["extra_include_paths"] = list(call.get("extra_include_paths") or []) + [extra_include]
            call.pop("kwargs", None)
            out.append((f, spec_from_call(**call)))

        return record

    for f in files:
        cpp_ext.load_inline = recorder(f)
        try:
            # the shipped solutions are trusted repository files; running them is how their calls are read
            exec(compile(f.read_text(), str(f), "exec"), {"__name__": "kiln_bench_candidate"})  # noqa: S102
        finally:
            cpp_ext.load_inline = orig
    return out


def run_cuda_units(n: int, phase_n: int, deadline: float) -> int:
    """The --cuda-units benchmark (see the module docstring)."""
    from actors.verifier.build import nvcc
    from actors.verifier.build.cache import ArtifactCache
    from actors.verifier.build.compiler import ExtensionBuilder, _compiler_env
    from actors.verifier.build.pch_builds import default_pch_dir
    from actors.verifier.build.preludes import FACADE_LIB, SHELL, PchStore, flag_profile
    from actors.verifier.build.toolchain import Toolchain

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    tc = Toolchain.detect("cuda")
    pch = PchStore(default_pch_dir(), tc)
    t0 = time.monotonic()
    for prelude, profile in (("lean", flag_profile(["-O1"])), (SHELL, ()), (FACADE_LIB, ())):
        pch.build(prelude, profile)
    print(
        f"kiln cuda-units bench: nvcc {tc.nvcc_version} {','.join(tc.arch_flags)} host={platform.node()} "
        f"cores={os.cpu_count()} load={os.getloadavg()[0]:.2f}; toolchain artifacts (lean PCH, module shell, "
        f"facade library) ready in {time.monotonic() - t0:.1f} s (one-time per toolchain)",
        flush=True,
    )
    sys.path.insert(0, str(REPO / "tasks"))
    from check_cuda_compile import make_shim  # headers a CPU torch wheel lacks (CUDAContext.h needs them)

    work = Path(tempfile.mkdtemp(prefix="kiln-bench-cu-"))
    make_shim(work)
    files = pick_candidates("cuda", n)
    rows: dict[str, list[dict]] = {"lean": [], "facade": []}
    for k, (f, spec) in enumerate(shipped_cuda_specs(files, str(work / "shim"))):
        if time.monotonic() > deadline:
            break
        order = ("lean", "facade") if k % 2 == 0 else ("facade", "lean")
        for mode in order:
            bdir = Path(tempfile.mkdtemp(dir=work))
            builder = ExtensionBuilder(
                tc, ArtifactCache(bdir / "cache", tc.digest), pch, "lean" if mode == "lean" else "auto"
            )
            plan = builder._plan(spec, bdir)
            t1 = time.monotonic()
            builder._compile(spec, bdir, plan)
            wall = time.monotonic() - t1
            units = {u.label: u for u in plan.units}
            rows[mode].append(
                {
                    "file": str(f.relative_to(REPO)),
                    "ok": all(u.ok for u in plan.units),
                    "seconds": wall,
                    "phases": {"cuda_unit": units["cuda"].seconds, "binding_unit": units["binding"].seconds},
                    "how": "+".join(sorted(u.how for u in plan.units)),
                    "error": next((u.output[-300:] for u in plan.units if not u.ok), ""),
                }
            )
            print(
                f"  {mode:<7} {f.parent.name}/{f.name:<30} {wall:6.1f}s (.cu {units['cuda'].seconds:5.1f}s, "
                f"binding {units['binding'].seconds:5.1f}s) {rows[mode][-1]['how']} ok={rows[mode][-1]['ok']}",
                flush=True,
            )
        if k < phase_n:
            for mode, prelude in (("lean", "lean_cuda"), ("facade", "facade_cuda")):
                bdir = Path(tempfile.mkdtemp(dir=work))
                builder = ExtensionBuilder(tc, ArtifactCache(bdir / "cache", tc.digest), pch)
                unit = builder._cuda_unit(
                    spec, bdir, builder._write_user_files(bdir, "cuda_source", spec.cuda_sources), prelude
                )
                phases = nvcc.profile(unit.cmd, bdir, _compiler_env()) or {}
                rows[mode][-1]["nvcc_phases"] = phases
                print(
                    f"  {mode:<7} nvcc phases, one after another: "
                    + ", ".join(f"{name} {sec:.2f}s" for name, sec in phases.items()),
                    flush=True,
                )
    print()
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other work on this machine inflates the figures)")
    print(summarize(rows))
    pairs = [(a["seconds"], b["seconds"]) for a, b in zip(rows["lean"], rows["facade"], strict=False)]
    if pairs:
        ratios = [la / fa for la, fa in pairs]
        print(
            f"lean/facade wall ratio per candidate: p50 {percentile(ratios, 0.5):.2f}x "
            f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x, n={len(ratios)})"
        )
    for mode, mode_rows in rows.items():
        prof = [r["nvcc_phases"] for r in mode_rows if r.get("nvcc_phases")]
        if prof:
            names = list(prof[0])
            print(
                f"{mode:<7} mean nvcc phases: "
                + ", ".join(f"{nm} {statistics.mean(p.get(nm, 0.0) for p in prof):.2f}s" for nm in names)
            )
    failed = [r for rs in rows.values() for r in rs if not r["ok"]]
    for r in failed:
        print(f"FAILED {r['file']}: {r['error']}")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--compare-nvcc"]:  # plain nvcc vs Kiln's parallel front ends on one command
        sys.path.insert(0, str(REPO))
        from actors.verifier.build import nvcc

        return nvcc.compare(argv[1:])
    if argv[:1] == ["--cuda-units"]:
        sys.path.insert(0, str(REPO))
        units = argparse.ArgumentParser(description="the compile step of CUDA candidates: lean vs facade")
        units.add_argument("--n", type=int, default=6, help="candidates")
        units.add_argument("--phase-n", type=int, default=2, help="candidates whose nvcc phases are timed")
        units.add_argument("--budget-s", type=float, default=1800.0, help="stop starting candidates after this")
        a = units.parse_args(argv[1:])
        return run_cuda_units(a.n, a.phase_n, time.monotonic() + a.budget_s)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--n", type=int, default=None, help="candidates per mode (default: 8 cpu, 6 cuda)")
    ap.add_argument("--baseline-n", type=int, default=None, help="candidates for load_inline (default: --n, 4 on cuda)")
    ap.add_argument(
        "--modes", default="lean,full,load_inline", help="comma list of facade (cuda), lean, full, load_inline"
    )
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop measuring after this many seconds")
    ap.add_argument("--pch-dir", default=None, help="precompiled headers (default: the machine-wide directory)")
    ap.add_argument("--json", default=None, help="also write all rows to this file")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from actors.verifier.build import BuildService
    from actors.verifier.build.pch_builds import default_pch_dir
    from actors.verifier.build.preludes import flag_profile

    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    n = args.n or (8 if args.backend == "cpu" else 6)
    files = pick_candidates(args.backend, n)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    pch_dir = Path(args.pch_dir) if args.pch_dir else default_pch_dir()
    print(
        f"kiln compile bench: backend={args.backend} candidates={len(files)} modes={modes} "
        f"host={platform.node()} cores={os.cpu_count()} load={os.getloadavg()[0]:.2f}",
        flush=True,
    )

    # One-time, per toolchain: the precompiled preludes the modes use.
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-pch-") as scratch:
        svc = BuildService(Path(scratch), args.backend, workers=1, timeout_s=600, pch="use", pch_dir=pch_dir)
        try:
            wanted = svc.default_pch_variants() + ([("full", flag_profile(["-O3"]))] if "full" in modes else [])
            for prelude, profile in wanted:
                svc.request_pch(prelude, profile, force=True)
            svc.wait_pch()
            toolchain = svc.toolchain_id
        finally:
            svc.close()
    pch_s = time.monotonic() - t0
    print(f"precompiled headers ready in {pch_s:.1f} s (one-time per toolchain; 0 when already built)", flush=True)

    results: dict[str, list] = {}
    remaining = [m for m in modes]
    for mode in modes:
        share = (deadline - time.monotonic()) / max(len(remaining), 1)
        mode_deadline = time.monotonic() + share
        remaining.remove(mode)
        if mode == "lean":  # on cuda: the facade off (policy "lean"); on cpu there is no facade
            results.update(run_service_mode("lean", files, args.backend, "lean", pch_dir, mode_deadline, passes=2))
        elif mode == "facade":
            results.update(run_service_mode("facade", files, args.backend, "auto", pch_dir, mode_deadline, passes=2))
        elif mode == "full":
            results.update(run_service_mode("full", files, args.backend, "full", pch_dir, mode_deadline))
        elif mode == "load_inline":
            base_n = args.baseline_n or (n if args.backend == "cpu" else min(n, 4))
            results["load_inline"] = run_baseline(files[:base_n], mode_deadline)
        else:
            print(f"unknown mode {mode!r}")
            return 2
    print()
    print(f"toolchain: {toolchain}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other work on this machine inflates the figures)")
    print(summarize(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"toolchain": toolchain, "pch_seconds": pch_s, "results": results}, indent=1)
        )
    failed = [r for rows in results.values() for r in rows if not r["ok"]]
    for r in failed:
        print(f"FAILED {r['file']}: {r['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
