"""Benchmark of Kiln's wire layer: codec MB/s, ZMQ loopback throughput and request/reply latency.

    python -m launch.bench.protocols [--transport tcp|ipc] [--big-mib 64] [--rounds 20]

Servers run in a separate process (spawned), so the figures include real inter-process transfer.
The payload is a realistic record: a packed `TrainBatch` whose arrays add up to `--big-mib` MiB.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

import protocols as P
from protocols.channels import PullChannel, PushChannel, ReplyServer, RequestClient, bind_address

MiB = 1 << 20


def train_batch(nbytes: int) -> P.TrainBatch:
    """A TrainBatch whose arrays total about `nbytes` (17 bytes per token)."""
    n = nbytes // 17
    rng = np.random.default_rng(0)
    return P.TrainBatch(
        version=7,
        episode_ids=[f"ep-{i}" for i in range(64)],
        tokens=rng.integers(0, 150_000, n, dtype=np.int32),
        cu_seqlens=np.linspace(0, n, 65).astype(np.int32),
        loss_mask=np.ones(n, np.uint8),
        behaviour_logprobs=rng.standard_normal(n, dtype=np.float32),
        advantages=np.zeros(64, np.float32),
        versions=np.full(n, 7, np.int32),
    )


def payload_bytes(rec: P.Record) -> int:
    return sum(memoryview(p).nbytes for p in P.encode_parts(rec))


def _echo_server(transport: str, addr_q, stop_ev) -> None:
    srv = ReplyServer(transport=transport)
    addr_q.put(srv.address)
    ack = P.EpisodeAck(episode_id="x", status="stored")
    srv.serve(lambda rec: ack if isinstance(rec, P.TrainBatch) else rec, stop_ev, poll_s=0.05)
    srv.close()


def _raw_echo(transport: str, addr_q, stop_ev) -> None:
    """The floor: a bare pyzmq ROUTER echo, no Kiln codec or channel code."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(bind_address(transport=transport))
    addr_q.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while not stop_ev.is_set():
        if sock.poll(50):
            sock.send_multipart(sock.recv_multipart())
    sock.close(0)


def _sink(transport: str, addr_q, n: int) -> None:
    pull = PullChannel(transport=transport, hwm=4)
    addr_q.put(pull.address)
    for _ in range(n):
        pull.recv()
    addr_q.put("done")
    pull.close()


def bench_codec(rec: P.Record, rounds: int) -> dict:
    size = payload_bytes(rec)
    enc = min(_timed(lambda: P.encode(rec)) for _ in range(rounds))
    blob = P.encode(rec)
    dec = min(_timed(lambda: P.decode(blob)) for _ in range(rounds))
    parts = P.encode_parts(rec)
    enc_p = min(_timed(lambda: P.encode_parts(rec)) for _ in range(rounds))
    dec_p = min(_timed(lambda: P.decode_parts(parts)) for _ in range(rounds))
    return {
        "encode() MB/s": size / enc / 1e6,
        "decode() MB/s": size / dec / 1e6,
        "encode_parts MB/s": size / enc_p / 1e6,
        "decode_parts MB/s": size / dec_p / 1e6,
    }


def bench_push(rec: P.Record, transport: str, rounds: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_sink, args=(transport, q, rounds + 2), daemon=True)
    proc.start()
    push = PushChannel(q.get(timeout=60))
    for _ in range(2):  # warm-up: connection set-up and first-touch page faults
        push.send(rec)
    t0 = time.perf_counter()
    for _ in range(rounds):
        push.send(rec)
    assert q.get(timeout=300) == "done"
    dt = time.perf_counter() - t0
    push.close()
    proc.join(10)
    return payload_bytes(rec) * rounds / dt / 1e6


def bench_request(rec: P.Record, transport: str, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_echo_server, args=(transport, q, stop), daemon=True)
    proc.start()
    cli = RequestClient(q.get(timeout=60), timeout_s=30, retries=0)
    for _ in range(min(rounds // 10 + 2, 200)):
        cli.request(rec)
    lat = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        cli.request(rec)
        lat.append(time.perf_counter() - t0)
    stop.set()
    cli.close()
    proc.join(10)
    return lat


def bench_raw(nbytes: int, transport: str, rounds: int) -> list[float]:
    import zmq

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_raw_echo, args=(transport, q, stop), daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(q.get(timeout=60))
    payload = b"x" * nbytes
    lat = []
    for i in range(rounds + 200):
        t0 = time.perf_counter()
        sock.send_multipart([b"id", payload])
        sock.recv_multipart()
        if i >= 200:
            lat.append(time.perf_counter() - t0)
    stop.set()
    sock.close(0)
    proc.join(10)
    return lat


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")
    ap.add_argument("--big-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20, help="64 MiB messages per throughput figure")
    ap.add_argument("--small-rounds", type=int, default=5000, help="1 KiB requests for the latency figure")
    args = ap.parse_args(argv)

    big = train_batch(args.big_mib * MiB)
    small = P.TaskRequest(actor_id="r" * 1000)
    rows = []
    for name, value in bench_codec(big, max(args.rounds // 4, 3)).items():
        rows.append((f"codec {name} ({args.big_mib} MiB TrainBatch)", f"{value:,.0f}"))
    rows.append(
        (
            f"PUSH->PULL {args.transport} loopback MB/s ({args.big_mib} MiB)",
            f"{bench_push(big, args.transport, args.rounds):,.0f}",
        )
    )
    lat = bench_request(big, args.transport, max(args.rounds // 2, 5))
    rows.append((f"REQ/REP {args.transport} {args.big_mib} MiB request p50 ms", f"{_pct(lat, 50) * 1e3:.1f}"))
    rows.append(
        (
            f"REQ/REP {args.transport} {args.big_mib} MiB request MB/s (p50)",
            f"{payload_bytes(big) / _pct(lat, 50) / 1e6:,.0f}",
        )
    )
    lat = bench_request(small, args.transport, args.small_rounds)
    rows.append((f"REQ/REP {args.transport} 1 KiB round trip p50 us", f"{_pct(lat, 50) * 1e6:.0f}"))
    rows.append((f"REQ/REP {args.transport} 1 KiB round trip p99 us", f"{_pct(lat, 99) * 1e6:.0f}"))
    rows.append((f"REQ/REP {args.transport} 1 KiB mean us", f"{statistics.fmean(lat) * 1e6:.0f}"))
    raw = bench_raw(1024, args.transport, args.small_rounds)
    rows.append((f"floor: bare pyzmq DEALER/ROUTER {args.transport} 1 KiB p50 us", f"{_pct(raw, 50) * 1e6:.0f}"))
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  value")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
