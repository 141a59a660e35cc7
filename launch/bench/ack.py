"""Measure the price of durability: episode ack latency (send -> fsync'ed -> ack) over real ZMQ.

    python -m launch.bench.ack [--dir DIR] [--episodes N] [--clients 1 8] [--response-tokens 1024]

Starts a ReplayActor whose run directory is on DIR's disk (default: the system temp directory), and
has C client threads, each with its own socket, ask for tasks and send the G episodes of each group
one at a time, timing each round trip. Prints a Markdown table: p50/p99 client round trip, the
server's receive-to-reply time, and acks per second. Concurrent senders share fsyncs (group commit).
Run it from the repository root: the episodes are the tests' synthetic ones (tests/helpers).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from actors.base import RunContext
from actors.buffer.actor import ReplayActor
from configs import AlgoConfig, ReplayConfig
from protocols import TaskRequest
from protocols.channels import RequestClient
from tests.helpers.synthetic import TurnSpec, make_episode

GROUP = 8


def client_loop(address: str, episodes: int, spec: TurnSpec, out: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    with RequestClient(address, timeout_s=30.0, retries=0) as client:
        sent = 0
        while sent < episodes:
            reply = client.request(TaskRequest(actor_id=f"bench-{seed}"))
            assert reply.status == "task", reply
            for i in range(reply.group_size):
                ep = make_episode(reply.task, reply.group_id, i, [spec], rng=rng)
                t0 = time.perf_counter()
                ack = client.request(ep)
                out.append(time.perf_counter() - t0)
                assert ack.status == "stored", ack
                sent += 1


def run(directory: Path, clients: int, episodes: int, spec: TurnSpec) -> dict:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        replay = ReplayConfig(task_source="actors.buffer.examples.TextMatchTasks", snapshot_every=100_000)
        algo = AlgoConfig(group_size=GROUP, total_steps=1_000_000, max_staleness=1_000_000)
        actor = ReplayActor(replay, algo, RunContext(run_dir=tmp))
        address = actor.start()["replay"]
        lat: list[list[float]] = [[] for _ in range(clients)]
        threads = [
            threading.Thread(target=client_loop, args=(address, episodes // clients, spec, lat[c], c))
            for c in range(clients)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        h = actor.health()
        actor.stop()
    ms = np.concatenate([np.asarray(x) for x in lat]) * 1e3
    return {
        "clients": clients,
        "episodes": ms.size,
        "p50": np.percentile(ms, 50),
        "p99": np.percentile(ms, 99),
        "server_p50": h.ack_latency_ms.p50,
        "server_p99": h.ack_latency_ms.p99,
        "acks_per_s": ms.size / wall,
        "commits": h.storage.commits,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the run directory lives")
    p.add_argument("--episodes", type=int, default=800)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=1024)
    args = p.parse_args()
    spec = TurnSpec(passed=True, score=1.0, prompt_len=args.prompt_tokens, response_len=args.response_tokens)
    print(
        f"episodes of 1 turn, {args.prompt_tokens} prompt + {args.response_tokens} response tokens; "
        f"run directory under {args.dir}"
    )
    print("| concurrent senders | episodes | ack p50 (ms) | ack p99 (ms) | server p50 / p99 (ms) | acks/s | fsyncs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in args.clients:
        r = run(args.dir, c, args.episodes, spec)
        print(
            f"| {c} | {r['episodes']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['server_p50']:.2f} / "
            f"{r['server_p99']:.2f} | {r['acks_per_s']:.0f} | {r['commits']} |"
        )


if __name__ == "__main__":
    main()
