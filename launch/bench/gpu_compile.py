"""Validate the CUDA compile path on a GPU machine: `python -m launch.bench.gpu_compile`.

Builds every tasks/solutions/cuda/** solution through BuildService (backend "cuda", all at once),
then, one fresh process per solution, imports it via install_prebuilt (no compiler runs there),
runs ModelNew once on the GPU against the reference Model (same seed, same weights, TF32 off) and
prints a table: build time, how it was built, vendor libraries, match and max error.
Exit status 0 only when every solution built and matched. Needs only torch, nvcc and this repo.
KILN_NVCC_PLAIN=1 builds with plain nvcc instead of Kiln's parallel front ends (nvcc.py), to compare.
KILN_CUDA_FACADE_OFF=1 (read by Toolchain.detect, so the verifier actor honours it too) or
`--policy lean` builds with the CUDA facade off (the lean CUDA prelude only), to compare with the
default `auto` (the facade tried first, facade.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUNNER = r"""
import importlib.util, json, sys, time, types
sys.path.insert(0, sys.argv[1])
import torch
from actors.verifier.build import install_prebuilt
from actors.verifier.compare import compare_outputs, declared_tolerance
job = json.loads(sys.argv[2])
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

install_prebuilt(job["artifacts"], job["toolchain"])
t0 = time.monotonic()
sol = load(job["solution"], "kiln_solution")
import_s = time.monotonic() - t0
ref = load(job["reference"], "kiln_reference")
init = ref.get_init_inputs()
torch.manual_seed(0)
model = ref.Model(*init).cuda()
torch.manual_seed(0)
new = sol.ModelNew(*init).cuda()
if model.state_dict():
    new.load_state_dict(model.state_dict())
torch.manual_seed(1)
inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in ref.get_inputs()]
with torch.no_grad():
    want = model(*inputs)
    got = new(*inputs)
torch.cuda.synchronize()
check = compare_outputs([got], [want], declared_tolerance(ref))  # the verifier's rule, nothing else
print("KILN_GPU_CHECK " + json.dumps({"ok": check.ok, "max_err": check.max_abs_error, "import_s": import_s,
                                      "shape": list(got.shape), "message": check.message}))
"""


def reference_for(solution: Path) -> Path:
    return REPO / "tasks" / solution.parent.name / solution.name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="substring filter on levelN/NN_name")
    ap.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    ap.add_argument("--cache-dir", default=None, help="build cache (default: a fresh temp dir, so builds are cold)")
    ap.add_argument("--run-timeout-s", type=float, default=180.0)
    ap.add_argument(
        "--policy",
        choices=("auto", "lean", "full"),
        default="auto",
        help="prelude policy: auto (CUDA facade first), lean (facade off), full (load_inline's headers)",
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from actors.verifier.build import BuildService

    if not torch.cuda.is_available():
        print("gpu_compile needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    files = sorted((REPO / "tasks" / "solutions" / "cuda").glob("level*/*.py"))
    files = [f for f in files if args.only is None or args.only in f"{f.parent.name}/{f.stem}"]
    if not files:
        print("no CUDA solutions found under tasks/solutions/cuda")
        return 2
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    print(
        f"gpu_compile: {len(files)} solutions, {args.workers} compile workers, {torch.cuda.get_device_name(0)}, "
        f"torch {torch.__version__}, cache {cache}",
        flush=True,
    )

    t0 = time.monotonic()
    with BuildService(cache, "cuda", workers=args.workers, timeout_s=600, prelude_policy=args.policy) as svc:
        print(f"toolchain: {svc.toolchain_id}", flush=True)
        svc.wait_pch(300)
        print(f"precompiled headers ready after {time.monotonic() - t0:.1f} s", flush=True)
        t_build = time.monotonic()
        futures = {f: svc.submit(f.read_text()) for f in files}
        builds = {}
        for f, fut in futures.items():
            builds[f] = fut.result()
            r = builds[f]
            print(
                f"  built {f.parent.name}/{f.stem:<28} {r.seconds:6.1f}s ok={r.ok} "
                f"{','.join(r.preludes.values())} {r.error.splitlines()[0] if r.error else ''}",
                flush=True,
            )
        build_wall = time.monotonic() - t_build

    rows = []
    for f in files:
        r = builds[f]
        row = {
            "task": f"{f.parent.name}/{f.stem}",
            "build_s": r.seconds,
            "built": r.ok,
            "how": ",".join(sorted(set(r.preludes.values()))),
            "vendor": ",".join(r.vendor_libs),
            "ran": False,
            "max_err": None,
            "note": "",
        }
        if not r.ok:
            row["note"] = f"{r.error_class}: {r.error[:200]}"
            rows.append(row)
            continue
        job = {
            "artifacts": r.artifacts,
            "toolchain": r.toolchain,
            "solution": str(f),
            "reference": str(reference_for(f)),
        }
        try:
            p = subprocess.run(
                [sys.executable, "-c", RUNNER, str(REPO), json.dumps(job)],
                capture_output=True,
                text=True,
                timeout=args.run_timeout_s,
                cwd=REPO,
                check=False,
            )
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("KILN_GPU_CHECK ")), None)
            if line is None:
                row["note"] = f"run failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}"
            else:
                out = json.loads(line.split(" ", 1)[1])
                row.update(ran=out["ok"], max_err=out["max_err"])
                if not out["ok"]:
                    row["note"] = f"mismatch: {out['message'][:200]}"
        except subprocess.TimeoutExpired:
            row["note"] = f"run timed out after {args.run_timeout_s:.0f} s"
        rows.append(row)
        print(f"  ran   {row['task']:<34} {'PASS' if row['ran'] else 'FAIL'} {row['note']}", flush=True)

    print()
    print(f"policy {args.policy}")
    print(f"{'task':<34} {'build_s':>7} {'built':>5} {'how':<12} {'vendor':<8} {'match':>5} {'max_err':>9}  note")
    for row in rows:
        err = f"{row['max_err']:.2e}" if row["max_err"] is not None else "-"
        print(
            f"{row['task']:<34} {row['build_s']:7.1f} {row['built']!s:>5} {row['how']:<12} "
            f"{row['vendor'] or '-':<8} {row['ran']!s:>5} {err:>9}  {row['note']}"
        )
    secs = sorted(r.seconds for r in builds.values() if r.ok)
    if secs:
        print(
            f"\ncold builds: n={len(secs)} p50={statistics.median(secs):.1f}s "
            f"p90={secs[int(0.9 * (len(secs) - 1))]:.1f}s max={secs[-1]:.1f}s, all {len(files)} in "
            f"{build_wall:.1f}s wall with {args.workers} workers"
        )
    passed = sum(r["ran"] for r in rows)
    print(f"{passed}/{len(rows)} solutions built and matched the reference")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
