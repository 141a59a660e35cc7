"""Before/after throughput of the cpu verifier, side by side in one run:
`python -m launch.bench.verifier_ab --before DIR [--after DIR] [--rounds 2] [--json FILE]`.

DIR is a checkout of the code to compare (for example `git worktree add --detach /tmp/before main`);
`--after` defaults to this repository. Each tree is measured in a fresh worker process that imports
that tree's Kiln (cwd and PYTHONPATH = the tree, this interpreter), in ABBA order over the rounds
(before, after, after, before, ...) so that drift in the machine's load falls on both sides alike.
Every worker starts a `KernelVerifier` on a fresh cache directory (cold builds, no verdict hits; the
machine-wide precompiled headers are built before its clock starts) and measures, on the shipped
CPU solutions, each made distinct per worker by a unique comment inside its C++ source:
  compile    one candidate at a time (`--sequential` of them): the compile stage's time as the
             verifier sees it (`VerifyResult.timings["compile"]`: submit to built library, symbol
             check included where the tree has one), and the whole verification's wall time;
  throughput all shipped solutions submitted at once to `--inflight` threads: verifications per
             minute over the mix's wall time.
Every candidate must pass; a worker whose candidate does not pass fails the run.

A side too slow to finish the mix in reasonable time is measured over a window: with `--window-s W`,
a mix still running W seconds after it started is stopped there (its worker's process group
killed), and its rate is the verifications finished within the window over W, marked partial.
Where one command cannot hold both trees (a device command's time limit), `--sides before|after`
measures one tree and prints its row as JSON: run both on the same held machine, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs inside a worker process (cwd = the tree). Uses only the verifier API both trees share.
WORKER = r'''
import json, re, shutil, sys, tempfile, threading, time, uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

opts = json.loads(sys.argv[1])
from configs import load_config
from protocols import VerifyRequest
from tasks.loader import discover, solution_for, to_task
from actors.verifier.verifier import KernelVerifier

cache = tempfile.mkdtemp(prefix="kiln-ab-")
backend = opts["backend"]
overrides = {"verifier.cache_dir": cache, "verifier.backend": backend, "verifier.compile_baseline": "never",
             "verifier.compile_workers": opts["compile_workers"], "verifier.run_workers": opts["run_workers"]}
overrides.update(opts["settings"])
cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()]).verifier
work = []
for tf in discover("tasks"):
    sol = solution_for(tf, f"tasks/solutions/{backend}")
    if sol is not None:
        work.append((to_task(tf, backend), sol.read_text()))
CPP = re.compile(r'(=\s*r?""")')


def distinct(source):
    out, n = CPP.subn(lambda m: m.group(1) + f"\n// kiln-ab {uuid.uuid4().hex}\n", source, count=1)
    assert n == 1, "no C++ source string found"
    return out


PRINTING = threading.Lock()


def say(tag, record):
    with PRINTING:
        print(tag + " " + json.dumps(record), flush=True)


def ask(job, in_mix=False):
    task, source = job
    t0 = time.perf_counter()
    r = verifier.verify(VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=distinct(source)))
    if not r.passed:
        raise SystemExit(f"{task.task_id}: {r.stage} {r.error_class}: {r.feedback[:400]}")
    row = {"task": task.task_id, "compile_s": r.timings.get("compile"), "wall_s": time.perf_counter() - t0,
           "cached": bool((r.diagnostics.get("build") or {}).get("cached")),
           "stages": {k: v for k, v in r.timings.items() if isinstance(v, (int, float))}}
    if in_mix:
        say("KILN_AB_DONE", row)  # the parent counts these when it stops the mix at its window
    return row


t0 = time.perf_counter()
verifier = KernelVerifier(cfg)
try:
    verifier.warm()
    wait = getattr(verifier.builds, "wait_pch", None)
    if wait is not None:
        wait(1800)
    ready_s = time.perf_counter() - t0
    step = max(1, len(work) // max(opts["sequential"], 1))
    sequential = [ask(job) for job in work[::step][:opts["sequential"]]]
    t1 = time.perf_counter()
    leases = [lane.lease for lane in verifier.lanes.all] if hasattr(verifier, "lanes") else [verifier.lease]
    held0 = sum(getattr(lease, "exclusive_s", float("nan")) for lease in leases)
    say("KILN_AB_READY", {"ready_s": ready_s, "sequential": sequential, "mix_n": len(work) * opts["copies"]})
    with ThreadPoolExecutor(opts["inflight"]) as pool:
        mix = list(pool.map(lambda job: ask(job, True), work * opts["copies"]))
    mix_s = time.perf_counter() - t1
    exclusive_s = sum(getattr(lease, "exclusive_s", float("nan")) for lease in leases) - held0
finally:
    verifier.close()
    shutil.rmtree(cache, ignore_errors=True)
print("KILN_AB " + json.dumps({"ready_s": ready_s, "sequential": sequential, "mix": mix, "mix_s": mix_s,
                              "exclusive_s": exclusive_s}))
'''


def run_worker(tree: Path, opts: dict, timeout_s: float, window_s: float | None = None) -> dict:
    """One worker on `tree`: its KILN_AB record, or, when its mix outlasts `window_s`, the mix cut
    there (marked partial: the verifications finished within the window)."""
    with tempfile.TemporaryDirectory(prefix="kiln-ab-worker-") as tmp:
        script = Path(tmp) / "worker.py"  # alone in its directory: nothing of either tree shadows a module
        script.write_text(WORKER)
        # The tree first (its Kiln wins); the rest of the path keeps what this machine installed beside it.
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p),
        }
        with (Path(tmp) / "stderr").open("w+") as err:
            p = subprocess.Popen(
                [sys.executable, str(script), json.dumps(opts)],
                cwd=tree,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,  # a cut mix is stopped with every process the worker started
            )
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_pump, args=(p.stdout, lines), daemon=True).start()
            deadline, cut_at, ready, done = time.monotonic() + timeout_s, None, None, []
            while True:
                limit = min(deadline, cut_at) if cut_at else deadline
                text = _next_line(lines, limit)
                if text == "":  # the limit passed
                    _stop(p)
                    if ready is not None and cut_at is not None and time.monotonic() >= cut_at:
                        return {**ready, "mix": done, "mix_s": window_s, "exclusive_s": float("nan"), "partial": True}
                    raise SystemExit(f"verifier_ab: the worker in {tree} did not finish within {timeout_s:.0f} s")
                if text is None:
                    break
                tag, _, body = text.strip().partition(" ")
                if tag == "KILN_AB_READY":
                    ready = json.loads(body)
                    cut_at = time.monotonic() + window_s if window_s else None
                elif tag == "KILN_AB_DONE":
                    done.append(json.loads(body))
                elif tag == "KILN_AB":
                    p.wait()
                    return {**json.loads(body), "partial": False}
            p.wait()
            err.seek(0)
            tail = err.read().strip().splitlines()[-5:]
    raise SystemExit(f"verifier_ab: the worker in {tree} failed (exit {p.returncode}): " + " | ".join(tail))


def _pump(stream, lines: queue.Queue) -> None:
    for text in stream:
        lines.put(text)
    lines.put(None)  # the worker closed its output


def _next_line(lines: queue.Queue, limit: float) -> str | None:
    """The worker's next line; None at its end; "" once the monotonic clock passes `limit`."""
    try:
        return lines.get(timeout=max(limit - time.monotonic(), 0.0))
    except queue.Empty:
        return ""


def _stop(p: subprocess.Popen) -> None:
    """The worker and every process of its session: asked to stop, then killed."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(runs: list[dict]) -> dict:
    compiles = [c["compile_s"] for r in runs for c in r["sequential"] if not c["cached"]]
    walls = [c["wall_s"] for r in runs for c in r["sequential"]] or [c["wall_s"] for r in runs for c in r["mix"]]
    n_mix = sum(len(r["mix"]) for r in runs)
    mix_s = sum(r["mix_s"] for r in runs)
    return {
        "compile_n": len(compiles),
        "compile_p50_s": statistics.median(compiles) if compiles else float("nan"),
        "compile_p90_s": pct(compiles, 0.9) if compiles else float("nan"),
        "verify_p50_s": statistics.median(walls),
        "exclusive_s_per_verification": sum(r.get("exclusive_s", float("nan")) for r in runs) / max(n_mix, 1),
        "mix_n": n_mix,
        "mix_s": mix_s,
        "per_min": 60.0 * n_mix / mix_s,
        "per_min_rounds": [60.0 * len(r["mix"]) / r["mix_s"] for r in runs],
        "stage_p50_s": stage_medians([c for r in runs for c in r["mix"]]),
    }


def stage_medians(rows: list[dict]) -> dict[str, float]:
    """The median of each stage's time (the verdicts' `timings`) over the mix's verifications: where a
    change's cost lands (correctness trials, the timed calls, the baselines, waits for a sandbox)."""
    keys = sorted({k for row in rows for k in row.get("stages", {})})
    return {k: statistics.median([row["stages"].get(k, 0.0) for row in rows if "stages" in row]) for k in keys}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.bench.verifier_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="a checkout of the code before the change")
    ap.add_argument("--after", default=str(REPO), help="a checkout of the code after it (default: this one)")
    ap.add_argument("--rounds", type=int, default=2, help="workers per tree, in ABBA order")
    ap.add_argument("--sequential", type=int, default=12, help="candidates compiled one at a time per worker")
    ap.add_argument("--inflight", type=int, default=8, help="verifications at once in the throughput mix")
    ap.add_argument("--compile-workers", type=int, default=2)
    ap.add_argument("--run-workers", type=int, default=1)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--copies", type=int, default=1, help="each shipped solution this many times (distinct) in the mix")
    ap.add_argument(
        "--before-set", action="append", default=[], metavar="KEY=VALUE", help="a config override for the before tree"
    )
    ap.add_argument(
        "--after-set", action="append", default=[], metavar="KEY=VALUE", help="a config override for the after tree"
    )
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per worker")
    ap.add_argument("--window-s", type=float, help="stop a mix this long after it started; count what finished")
    ap.add_argument("--first", choices=["before", "after"], default="before", help="which tree opens the ABBA order")
    ap.add_argument(
        "--sides",
        choices=["both", "before", "after"],
        default="both",
        help="measure one tree only (its row alone): for a pair too long for one command, on one host",
    )
    ap.add_argument("--json", help="also write every row to this file")
    args = ap.parse_args(argv)
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for name, tree in trees.items():
        if not (tree / "actors" / "verifier" / "verifier.py").is_file():
            print(f"verifier_ab: --{name} {tree} is not a Kiln checkout", file=sys.stderr)
            return 2
    opts = {
        "sequential": args.sequential,
        "inflight": args.inflight,
        "compile_workers": args.compile_workers,
        "run_workers": args.run_workers,
        "backend": args.backend,
        "copies": max(1, args.copies),
    }
    settings = {}
    for name, given in (("before", args.before_set), ("after", args.after_set)):
        settings[name] = {}
        for item in given:
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                print(f"verifier_ab: --{name}-set {item!r} is not KEY=VALUE", file=sys.stderr)
                return 2
            settings[name][key.strip()] = value.strip()
    opening = ("before", "after") if args.first == "before" else ("after", "before")
    order = [opening if i % 2 == 0 else opening[::-1] for i in range(args.rounds)]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i, pair in enumerate(order):
        for name in (n for n in pair if args.sides in ("both", n)):
            t0 = time.perf_counter()
            r = run_worker(trees[name], {**opts, "settings": settings[name]}, args.timeout_s, args.window_s)
            runs[name].append(r)
            cut = f" (cut at the window: {len(r['mix'])} of {r['mix_n']} finished)" if r["partial"] else ""
            print(
                f"round {i + 1} {name:6s}: ready {r['ready_s']:.1f} s, mix {len(r['mix'])} in {r['mix_s']:.1f} s "
                f"({60 * len(r['mix']) / r['mix_s']:.1f}/min){cut}, worker {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    summary = {name: summarize(rs) for name, rs in runs.items() if rs}
    if args.sides != "both":
        if args.json:
            Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
        print(json.dumps(summary[args.sides]))
        return 0
    b, a = summary["before"], summary["after"]
    print(f"{'':28s}{'before':>10s}{'after':>10s}{'after/before':>14s}")
    for key, label in (
        ("compile_p50_s", "compile p50 (s)"),
        ("compile_p90_s", "compile p90 (s)"),
        ("verify_p50_s", "verification p50 (s)"),
        ("per_min", "verifications / min"),
        ("exclusive_s_per_verification", "exclusive GPU s / verif."),
    ):
        print(f"{label:28s}{b[key]:10.2f}{a[key]:10.2f}{a[key] / b[key]:14.2f}")
    for stage in sorted(set(b["stage_p50_s"]) & set(a["stage_p50_s"])):  # the mix's median per stage
        before, after = b["stage_p50_s"][stage], a["stage_p50_s"][stage]
        ratio = f"{after / before:14.2f}" if before > 0 else f"{'':>14s}"
        print(f"{'  stage ' + stage + ' p50 (s)':28s}{before:10.3f}{after:10.3f}{ratio}")
    print(
        f"(compile n = {b['compile_n']} / {a['compile_n']} one at a time; throughput {b['mix_n']} / {a['mix_n']} "
        f"verifications; per round before {[round(x, 1) for x in b['per_min_rounds']]}, "
        f"after {[round(x, 1) for x in a['per_min_rounds']]})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
