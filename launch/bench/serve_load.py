"""The verifier service under load and faults (`kiln serve`, launch/serve), on this machine:

    python -m launch.bench.serve_load [--clients 4] [--requests 6] [--malformed 1000] [--json F]

1. The mix: the shipped cpu solutions (one candidate a task, by task id), verified once by
   the kernel verifier in this process (`KernelVerifier.verify` from `--clients` threads, the obvious
   alternative) and once through the service by `--clients` concurrent HTTP clients, each sending its
   share; each side with a cold verdict cache of its own and the same warm build cache. Throughput and
   p50/p99 latency, side by side.
2. A fault under load: the same mix again through a service of two verifiers, one stopped while it
   holds a job. Every request must be answered, none `infra`.
3. `--malformed` bad requests (bad JSON, wrong types, huge bodies, unknown task ids, a missing or
   wrong token, unknown paths), each of which must get a one-line JSON error with a 4xx status, the
   service still healthy after.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN = "bench-token-0123456789"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=6, help="requests per client (the mix is dealt round-robin)")
    p.add_argument("--malformed", type=int, default=1000)
    p.add_argument("--json", type=Path)
    p.add_argument("--only-fault", action="store_true", help="run part 2 alone")
    return p.parse_args(argv)


def mix(requests: int) -> list[tuple[str, str]]:
    """(task id, candidate source) pairs: the shipped cpu solutions (every level), repeated to `requests`."""
    solutions = sorted((REPO / "tasks/solutions/cpu").glob("level*/*.py"))
    pairs = [(f"{p.parent.name}/{p.stem}", p.read_text()) for p in solutions]
    return [pairs[i % len(pairs)] for i in range(requests)]


def config(cache: Path, *extra: str):
    from configs import load_config

    return load_config(
        REPO / "configs" / "default.yaml",
        [
            f"verifier.cache_dir={cache}",
            "verifier.compile_baseline=never",
            "serve.port=0",
            f"serve.tasks={REPO / 'tasks'}",
            *extra,
        ],
    )


def percentiles(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"p50_s": at(0.50), "p99_s": at(0.99), "mean_s": statistics.fmean(ordered)}


def in_process(jobs, clients: int, cache: Path) -> dict:
    from actors.verifier.verifier import KernelVerifier
    from protocols import VerifyRequest
    from tasks.loader import discover, to_task

    cfg = config(cache)
    tasks = {tf.task_id: to_task(tf, "cpu") for tf in discover(REPO / "tasks")}
    verifier = KernelVerifier(cfg.verifier)
    verifier.warm()
    try:

        def one(job):
            t0 = time.perf_counter()
            r = verifier.verify(VerifyRequest(request_id=uuid.uuid4().hex, task=tasks[job[0]], candidate=job[1]))
            return time.perf_counter() - t0, r.passed

        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            got = list(pool.map(one, jobs))
        wall = time.perf_counter() - started
    finally:
        verifier.close()
    return {
        "wall_s": wall,
        "per_min": 60 * len(jobs) / wall,
        "passed": sum(p for _, p in got),
        **percentiles([t for t, _ in got]),
    }


def through_service(jobs, clients: int, cache: Path, *extra: str, fault: bool = False) -> dict:
    from launch.serve.cli import start
    from protocols.verifier_client import VerifierClient

    tokens = cache / "tokens"
    tokens.parent.mkdir(parents=True, exist_ok=True)
    tokens.write_text("".join(f"c{i} {TOKEN}{i:04d}\n" for i in range(clients)))
    running = start(config(cache, f"serve.token_file={tokens}", f"serve.queue_capacity={4 * len(jobs)}", *extra))
    try:
        shares = [jobs[i::clients] for i in range(clients)]
        out: list[tuple[float, object]] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            c = VerifierClient(running.url, f"{TOKEN}{i:04d}")
            for task_id, source in shares[i]:
                t0 = time.perf_counter()
                r = c.verify(source, task_id=task_id)
                with lock:
                    out.append((time.perf_counter() - t0, r))

        killed = {}
        if fault:

            def killer() -> None:
                while not any(running.verifiers.turns.holding()):
                    time.sleep(0.01)
                time.sleep(0.5)
                holder = running.verifiers.turns.holding().index(max(running.verifiers.turns.holding()))
                killed["at_s"] = time.perf_counter() - started
                running.verifiers.stop(holder)

            threading.Thread(target=killer, daemon=True).start()
        started = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        snap = running.service.dispatcher.snapshot()
    finally:
        running.stop()
    results = [r for _, r in out]
    return {
        "wall_s": wall,
        "per_min": 60 * len(jobs) / wall,
        "answered": len(results),
        "passed": sum(r.passed for r in results),
        "infra": sum(r.error_class == "infra" for r in results),
        "classes": dict(collections.Counter(r.error_class or "pass" for r in results)),
        "failures": [[r.task_id, r.error_class, r.feedback[:300]] for r in results if not r.passed],
        "retried": snap["retried"],
        "killed_at_s": killed.get("at_s"),
        **percentiles([t for t, _ in out]),
    }


def malformed(count: int, cache: Path) -> dict:
    """`count` bad requests against a service (a stand-in reward actor: no verification is reached)."""
    from launch.serve.cli import start

    tokens = cache / "tokens-bad"
    tokens.parent.mkdir(parents=True, exist_ok=True)
    tokens.write_text(f"bench {TOKEN}0000\n")
    running = start(config(cache, f"serve.token_file={tokens}", "serve.max_body_bytes=65536"))
    rng = random.Random(0)
    huge = b'{"candidate": "' + b"x" * 70000 + b'"}'
    kinds = {
        "bad JSON": lambda: (b"{oops", TOKEN + "0000", "/v1/verify"),
        "not an object": lambda: (b"[1,2,3]", TOKEN + "0000", "/v1/verify"),
        "wrong types": lambda: (json.dumps({"candidate": 5, "task_id": []}).encode(), TOKEN + "0000", "/v1/verify"),
        "huge body": lambda: (huge, TOKEN + "0000", "/v1/verify"),
        "unknown task id": lambda: (
            json.dumps({"candidate": "x", "task_id": f"level9/{rng.randrange(10**6)}"}).encode(),
            TOKEN + "0000",
            "/v1/verify",
        ),
        "missing token": lambda: (
            json.dumps({"candidate": "x", "task_id": "level1/01_relu"}).encode(),
            None,
            "/v1/verify",
        ),
        "wrong token": lambda: (b"{}", "nope-nope-nope-nope", "/v1/jobs"),
        "unknown path": lambda: (b"{}", TOKEN + "0000", "/v2/nothing"),
        "kernelgym without code": lambda: (json.dumps({"task_id": "k"}).encode(), TOKEN + "0000", "/evaluate"),
        "batch too large": lambda: (
            json.dumps({"requests": [{"candidate": "x", "task_id": "level1/01_relu"}] * 500}).encode(),
            TOKEN + "0000",
            "/v1/verify/batch",
        ),
    }
    names = list(kinds)
    tally: dict[str, dict] = {n: {"sent": 0, "one_line_4xx": 0} for n in names}
    try:
        started = time.perf_counter()
        for i in range(count):
            name = names[i % len(names)]
            body, token, path = kinds[name]()
            headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
            req = urllib.request.Request(running.url + path, data=body, method="POST", headers=headers)
            tally[name]["sent"] += 1
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    status, text = resp.status, resp.read()
            except urllib.error.HTTPError as err:
                status, text = err.code, err.read()
            try:
                answer = json.loads(text)
            except json.JSONDecodeError:
                answer = {}
            line = answer.get("error", "") if isinstance(answer, dict) else ""
            if 400 <= status < 500 and line and "\n" not in line and "Traceback" not in line:
                tally[name]["one_line_4xx"] += 1
        wall = time.perf_counter() - started
        with urllib.request.urlopen(running.url + "/health", timeout=10) as resp:
            healthy = json.loads(resp.read())["status"] == "healthy"
    finally:
        running.stop()
    return {"sent": count, "wall_s": wall, "healthy_after": healthy, "by_kind": tally}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.only_fault:  # the fault part alone (a warm build cache of its own first)
        jobs = mix(args.clients * args.requests)
        root = Path(tempfile.mkdtemp(prefix="kiln-serve-bench-"))
        in_process(jobs, args.clients, root)
        import shutil

        shutil.rmtree(root / "verdicts", ignore_errors=True)
        print(json.dumps(through_service(jobs, args.clients, root, "serve.verifiers=2", fault=True), indent=1))
        return 0
    jobs = mix(args.clients * args.requests)
    root = Path(tempfile.mkdtemp(prefix="kiln-serve-bench-"))
    # A warm build cache for both sides (what a long-running service has), cold verdict caches.
    builds = root / "warm"
    in_process(jobs[: len(set(jobs))], args.clients, builds)
    import shutil

    def fresh(name: str) -> Path:
        path = root / name
        shutil.copytree(builds, path, ignore=shutil.ignore_patterns("verdicts"))
        return path

    report = {
        "mix": f"{len(jobs)} verifications of the {len(set(jobs))} shipped cpu solutions, {args.clients} clients",
        "in_process": in_process(jobs, args.clients, fresh("a")),
        "service": through_service(jobs, args.clients, fresh("b")),
        "service_fault": through_service(jobs, args.clients, fresh("c"), "serve.verifiers=2", fault=True),
        "malformed": malformed(args.malformed, fresh("d")) if args.malformed else None,
    }
    a, b, f = report["in_process"], report["service"], report["service_fault"]
    print(f"mix: {report['mix']}")
    print(f"{'':28} {'per min':>8} {'p50 s':>7} {'p99 s':>7} {'passed':>7}")
    print(f"{'in-process KernelVerifier':28} {a['per_min']:8.1f} {a['p50_s']:7.2f} {a['p99_s']:7.2f} {a['passed']:7d}")
    print(f"{'through the service':28} {b['per_min']:8.1f} {b['p50_s']:7.2f} {b['p99_s']:7.2f} {b['passed']:7d}")
    print(f"service / in-process: {b['per_min'] / a['per_min']:.2f}")
    print(
        f"fault: a verifier of 2 stopped at {f['killed_at_s'] or float('nan'):.1f} s: {f['answered']}/{len(jobs)} answered, "
        f"verdicts {f['classes']}, {f['retried']} retried; {f['per_min']:.1f}/min (without the fault: {b['classes']})"
    )
    if report["malformed"]:
        m = report["malformed"]
        ok = sum(k["one_line_4xx"] for k in m["by_kind"].values())
        print(
            f"malformed: {ok}/{m['sent']} answered with a one-line 4xx in {m['wall_s']:.1f} s; healthy after: {m['healthy_after']}"
        )
        for name, k in m["by_kind"].items():
            print(f"  {name:24} {k['one_line_4xx']}/{k['sent']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
