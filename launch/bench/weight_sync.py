"""GPU benchmark of the learner -> engine weight push (docs/training.md), against the link it runs on.

    torchrun --nproc-per-node 2 -m launch.bench.weight_sync     # 2 GPUs: rank 0 learner, rank 1 engine
    python -m launch.bench.weight_sync                          # 1 GPU: what one GPU can measure

The weights are those of a ~1.1B Qwen3-style model in bf16 (names and shapes from its HF config,
random values; `--layers` shrinks it). Every row is timed over `--pushes` (>= 10) pushes after one
untimed push, with perf_counter around a device synchronisation, in µs; GB/s from the median.

Two GPUs (torchrun; a gloo group of the two ranks only coordinates them, every byte goes through the
weight transport's own NCCL group, `actors.policy.weights.group`):
1. raw NCCL: one broadcast of a flat buffer of exactly the version's bytes, cuda:0 -> cuda:1 — the
   link's bound, measured in the same run;
2. the transport: a version in flat single-dtype buckets (`WeightBroadcaster.broadcast_flat`: bucket
   i+1 packed while bucket i is on the wire; the engine's tensors are views of the buckets it
   received), and one broadcast per tensor (SGLang's per-tensor contract), per bucket size; each row
   says its share of the raw broadcast's bandwidth (the target: >= 80% for the flat push);
3. the whole path: `WeightServer.publish` to a `TorchEngine` + `WeightClient` on rank 1 (publish =
   announced and received by the engine; -> WeightsLoaded = also staged, applied between two decode
   steps and confirmed), flat and per tensor.
One GPU: NCCL refuses two ranks on one GPU, so no transfer between a learner and an engine process
can be measured; these rows give what the flat format adds on each side: packing a version into
flat buckets (the learner) against a raw device-to-device copy of the same bytes, and the engine's
apply (copying the received tensors into its model; with flat buckets the received tensors are
views, so there is no unpacking step), plus the CUDA IPC path (engine on the learner's GPU).
Prints one table; writes it as JSON to $OUT/weight_sync.json when $OUT is set.

`engine_process` is also the engine side of the GPU tests (tests/weights/test_sync_gpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from configs import ModelConfig

# ~1.1B parameters: 16 layers of width 2048 (~805M) + a tied 151,936-token embedding (311M).
QWEN3_1B = ModelConfig(
    arch="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=6144,
    max_seq_len=2048,
    dtype="bfloat16",
)
TINY = ModelConfig(
    arch="qwen3",
    vocab_size=1000,
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
    max_seq_len=256,
    dtype="bfloat16",
)
ROWS: list[dict] = []


@dataclass(frozen=True)
class Where:
    """GPUs and NCCL, or (`--cpu`, the tests' smoke run) the CPU and gloo."""

    cpu: bool = False

    @property
    def backend(self) -> str:
        return "gloo" if self.cpu else "nccl"

    def device(self, rank: int) -> str:
        return "cpu" if self.cpu else f"cuda:{rank}"

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()

    def name(self) -> str:
        return "CPU" if self.cpu else torch.cuda.get_device_name(0)


# ------------------------------------------------------------------------------ engine process


def engine_process(commands, results, endpoints: dict, model: ModelConfig, device: str, engine_id: str) -> None:
    """An engine in its own process: a TorchEngine on `device` brought to the learner's version by a
    WeightClient, then following announcements. Commands: ("score", prompt, response, T) answers
    ("score", version, logprobs); ("version",) answers ("version", v); ("stop",) ends it."""
    from actors.rollout.engine import GenerateRequest, SamplingParams
    from actors.rollout.torch_engine import TorchEngine
    from actors.rollout.weight_client import WeightClient

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda" names the current device: 0 here
    engine = TorchEngine(model, device=device, max_batch=2, cuda_graphs=False)
    client = WeightClient(engine_id, endpoints)
    stop = threading.Event()
    thread = None
    try:
        client.bootstrap(engine)
        thread = threading.Thread(target=client.run, args=(stop,), daemon=True)
        thread.start()
        results.put(("ready", engine.weight_version))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            if cmd[0] == "version":
                results.put(("version", engine.weight_version))
            elif cmd[0] == "score":
                _, prompt, response, temperature = cmd
                params = SamplingParams(temperature=temperature, max_new_tokens=len(response))
                (gen,) = engine.generate([GenerateRequest("score", prompt, params, forced_response=response)])
                results.put(("score", int(gen.versions[0]), gen.logprobs.tolist()))
    except Exception as err:  # noqa: BLE001 - the parent must hear why, not wait for a timeout
        results.put(("error", repr(err)))
    finally:
        stop.set()
        if thread is not None:
            thread.join(10)
        client.close()
        engine.close()


class EngineProcess:
    """The parent's handle on an `engine_process` (spawned: CUDA cannot fork)."""

    def __init__(
        self, endpoints: dict, model: ModelConfig, device: str, engine_id: str, start_timeout_s: float = 300.0
    ) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=engine_process, daemon=True, args=(self.commands, self.results, endpoints, model, device, engine_id)
        )
        self.proc.start()
        self.ready_version = self._expect("ready", start_timeout_s)[1]

    def _expect(self, kind: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:  # a child that died says so at once, not at the timeout
            try:
                msg = self.results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"engine process exited ({self.proc.exitcode}) before its {kind!r}") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"engine process: no {kind!r} within {timeout_s:g}s") from None
        if msg[0] != kind:
            raise RuntimeError(f"engine process: {msg}")
        return msg

    def score(self, prompt: list[int], response: list[int], temperature: float) -> tuple[int, list[float]]:
        self.commands.put(("score", prompt, response, temperature))
        _, version, logprobs = self._expect("score", 120)
        return version, logprobs

    def stop(self) -> None:
        if self.proc.is_alive():
            self.commands.put(("stop",))
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# ------------------------------------------------------------------------------ the weights


def manifest_of(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every parameter the engines load (a tied lm_head once), from the HF model
    built on the meta device: no memory, no init."""
    from transformers import AutoModelForCausalLM

    from actors.policy.model import DTYPES, hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=DTYPES[cfg.dtype])
    return [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]


def random_weights(cfg: ModelConfig, device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)  # random values, not a model's init: only bytes move
    return [
        (n, (0.02 * torch.randn(shape, generator=g, device=device, dtype=torch.float32)).to(dtype))
        for n, shape, dtype in manifest_of(cfg)
    ]


def nbytes(named: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def timed(fn: Callable[[], None], pushes: int, sync: Callable[[], None], where: Where) -> list[float]:
    """Seconds of each of `pushes` calls after one untimed call; `sync` runs before each (both ranks
    start together) and the clock stops after a device synchronisation."""
    out = []
    for i in range(pushes + 1):
        sync()
        start = time.perf_counter()
        fn()
        where.sync()
        if i:
            out.append(time.perf_counter() - start)
    return out


def row(name: str, seconds: list[float], nbytes_: int, note: str = "", bound: float | None = None) -> dict:
    med = statistics.median(seconds)
    r = {
        "path": name,
        "GB": nbytes_ / 1e9,
        "pushes": len(seconds),
        "median_us": med * 1e6,
        "min_us": min(seconds) * 1e6,
        "GBps": nbytes_ / med / 1e9,
        "note": note,
    }
    if bound:
        r["of_raw"] = r["GBps"] / bound
    ROWS.append(r)
    share = f" ({r['of_raw']:.0%} of raw)" if bound else ""
    print(
        f"| {name} | {r['GB']:.3f} | {len(seconds)} | {r['median_us']:,.0f} | {r['min_us']:,.0f} | "
        f"{r['GBps']:.1f}{share} | {note} |",
        flush=True,
    )
    return r


HEADER = "| path | GB | pushes | median µs | min µs | GB/s | note |\n| --- | --- | --- | --- | --- | --- | --- |"


# ------------------------------------------------------------------------------ two GPUs (torchrun)


def two_gpus(cfg: ModelConfig, bucket_mbs: list[float], pushes: int, stack: bool, where: Where) -> None:
    from actors.policy.weights.group import WeightBroadcaster, WeightReceiver, send, settle
    from protocols import TensorSpec
    from protocols.weights import plan_buckets

    rank = dist.get_rank()
    device = where.device(rank)
    if not where.cpu:
        torch.cuda.set_device(device)
    shapes = manifest_of(cfg)
    named = random_weights(cfg, device) if rank == 0 else None
    manifest = [TensorSpec(name=n, dtype=str(d).removeprefix("torch."), shape=list(s)) for n, s, d in shapes]
    total = sum(math.prod(s) * d.itemsize for _, s, d in shapes)

    # The transport's own NCCL group: rank 0 picks the port, tells rank 1, and waits for it there.
    sender = (
        WeightBroadcaster("127.0.0.1", 0, 2, group_name="bench", backend=where.backend, timeout_s=300, form=False)
        if rank == 0
        else None
    )
    if rank == 0:
        sender.listen()
    port = [sender.port if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    if rank == 0:
        sender.form()
        print(
            f"model: {sum(math.prod(s) for _, s, _ in shapes) / 1e9:.2f}B parameters, bf16, {total / 1e9:.2f} GB "
            f"per version; 2 x {where.name()}\n{HEADER}",
            flush=True,
        )
    else:
        receiver = WeightReceiver("127.0.0.1", port[0], 1, 2, group_name="bench", backend=where.backend, device=device)
    raw = torch.empty(total, dtype=torch.uint8, device=device)
    raw_s = timed(
        lambda: (sender if rank == 0 else receiver).group.broadcast(raw, 0).wait(), pushes, dist.barrier, where
    )
    bound = None
    if rank == 0:
        bound = row(
            f"raw {where.backend} broadcast, one flat buffer of the version's bytes", raw_s, total, "the link's bound"
        )["GBps"]
    raw = None  # frees the buffer (the timed lambda above reads raw through its closure)

    for bucket_mb in bucket_mbs:
        bucket_bytes = int(bucket_mb * 2**20)
        for flat in (True, False):
            plan = plan_buckets(manifest, bucket_bytes, by_dtype=flat)
            if rank == 0:
                tensors = dict(named)
                buckets = [[(s.name, tensors[s.name]) for s in b] for b in plan]

                def push(buckets=buckets, flat=flat) -> None:  # timed() below calls it within this iteration
                    send(sender, buckets, flat)
                    settle(named)
            else:

                def push(plan=plan, flat=flat) -> None:  # timed() below calls it within this iteration
                    for b in plan:
                        receiver.receive([s.name for s in b], [s.dtype for s in b], [s.shape for s in b], flat=flat)

            seconds = timed(push, pushes, dist.barrier, where)
            if rank == 0:
                what = "flat single-dtype buckets, packed ahead" if flat else "one broadcast per tensor"
                row(
                    f"transport, {what}, {bucket_mb:g} MiB buckets ({len(plan)})",
                    seconds,
                    total,
                    "WeightBroadcaster -> WeightReceiver",
                    bound,
                )
    if rank == 0:
        sender.close()
    if stack:
        whole_path(cfg, named, bucket_mbs[0], pushes, bound, where)


def whole_path(cfg: ModelConfig, named, bucket_mb: float, pushes: int, bound: float | None, where: Where) -> None:
    """WeightServer.publish on rank 0 to a TorchEngine + WeightClient on rank 1, flat and per tensor."""
    from actors.learner.weight_sync import WeightServer

    rank = dist.get_rank()
    for flat in (True, False):
        engine_id = f"bench-{'flat' if flat else 'tensors'}"
        if rank == 0:
            with tempfile.TemporaryDirectory() as run_dir:
                server = WeightServer(
                    run_dir,
                    transport=where.backend,
                    bucket_mb=bucket_mb,
                    timeout_s=300,
                    join_timeout_s=300,
                    flat_buckets=flat,
                )
                dist.broadcast_object_list([server.start()], src=0)
                dist.barrier()  # the engine has joined and loaded nothing yet
                try:
                    publish, confirm = [], []
                    for v in range(1, pushes + 2):
                        start = time.perf_counter()
                        report = server.publish(v, lambda: named)
                        published = time.perf_counter() - start
                        if not server.wait_confirmed(v, [engine_id], timeout_s=300):
                            raise TimeoutError(f"version {v} not confirmed: {server.health()}")
                        if v > 1:  # the first push includes set-up (NCCL buffers, the engine's staging)
                            publish.append(published)
                            confirm.append(time.perf_counter() - start)
                    what = "flat" if flat else "per tensor"
                    row(
                        f"WeightServer.publish, {where.backend}, {what}, {bucket_mb:g} MiB (received)",
                        publish,
                        report.bytes,
                        "announce + push; the engine received every bucket",
                        bound,
                    )
                    row(
                        f"publish -> WeightsLoaded, {where.backend}, {what}",
                        confirm,
                        report.bytes,
                        "+ the engine's apply and confirmation",
                        bound,
                    )
                finally:
                    dist.barrier()  # the engine may stop
                    server.stop()
        else:
            endpoints = [None]
            dist.broadcast_object_list(endpoints, src=0)
            run_engine(cfg, endpoints[0], engine_id, where)


def run_engine(cfg: ModelConfig, endpoints: dict, engine_id: str, where: Where) -> None:
    """Rank 1's engine for `whole_path`: joins, follows announcements until rank 0 is done."""
    from actors.rollout.torch_engine import TorchEngine
    from actors.rollout.weight_client import WeightClient

    engine = TorchEngine(cfg, device=where.device(dist.get_rank()), max_batch=2, cuda_graphs=False)
    client = WeightClient(engine_id, endpoints)
    stop = threading.Event()
    client.bootstrap(engine)
    thread = threading.Thread(target=client.run, args=(stop,), daemon=True)
    thread.start()
    dist.barrier()
    dist.barrier()  # rank 0 has measured
    stop.set()
    thread.join(10)
    client.close()
    engine.close()


# ------------------------------------------------------------------------------ one GPU


def one_gpu(cfg: ModelConfig, bucket_mbs: list[float], pushes: int, ipc: bool, where: Where) -> None:
    from actors.policy.weights.base import specs
    from actors.policy.weights.group import pack_flat
    from protocols.weights import plan_buckets

    device = where.device(0)
    named = random_weights(cfg, device)
    total = nbytes(named)
    print(
        f"model: {sum(t.numel() for _, t in named) / 1e9:.2f}B parameters, bf16, {total / 1e9:.2f} GB per version; "
        f"1 x {where.name()} (NCCL refuses two ranks on one GPU: no transfer rows)\n{HEADER}",
        flush=True,
    )
    src, dst = (
        torch.empty(total, dtype=torch.uint8, device=device),
        torch.empty(total, dtype=torch.uint8, device=device),
    )
    bound = row(
        "raw device-to-device copy of the version's bytes",
        timed(lambda: dst.copy_(src), pushes, lambda: None, where),
        total,
        "the device's copy bound",
    )["GBps"]
    src = dst = None  # frees the buffers (the timed lambda above reads them through its closure)
    tensors = dict(named)
    for bucket_mb in bucket_mbs:
        plan = plan_buckets(specs(named), int(bucket_mb * 2**20), by_dtype=True)
        buckets = [[tensors[s.name] for s in b] for b in plan]
        row(
            f"learner: pack into flat buckets, {bucket_mb:g} MiB ({len(plan)})",
            timed(lambda buckets=buckets: [pack_flat(b) for b in buckets], pushes, lambda: None, where),
            total,
            "on a 2-GPU push this overlaps the previous bucket's broadcast",
            bound,
        )
    received = [(n, t.clone()) for n, t in named]
    targets = [torch.empty_like(t) for _, t in named]
    row(
        "engine: apply a version (copy every tensor into the model)",
        timed(lambda: [d.copy_(t) for d, (_, t) in zip(targets, received, strict=True)], pushes, lambda: None, where),
        total,
        "the same for both formats; flat buckets arrive as views, no unpacking",
        bound,
    )
    if ipc and not where.cpu:
        ipc_rows(cfg, named, bucket_mbs[0], pushes)


def ipc_rows(cfg: ModelConfig, named, bucket_mb: float, pushes: int) -> None:
    """CUDA IPC to an engine process on the learner's own GPU."""
    from actors.learner.weight_sync import WeightServer

    with tempfile.TemporaryDirectory() as run_dir:
        server = WeightServer(run_dir, transport="cuda_ipc", bucket_mb=bucket_mb, timeout_s=300, join_timeout_s=300)
        engine = EngineProcess(server.start(), cfg, "cuda:0", "bench-ipc")
        try:
            publish, confirm, nbytes_ = [], [], 0
            for v in range(1, pushes + 2):
                start = time.perf_counter()
                nbytes_ = server.publish(v, lambda: named).bytes
                published = time.perf_counter() - start
                if not server.wait_confirmed(v, ["bench-ipc"], timeout_s=300):
                    raise TimeoutError(f"cuda_ipc: version {v} not confirmed: {server.health()}")
                if v > 1:
                    publish.append(published)
                    confirm.append(time.perf_counter() - start)
            row(
                f"WeightServer.publish, cuda_ipc, {bucket_mb:g} MiB (exported)",
                publish,
                nbytes_,
                "copy into shared bucket buffers",
            )
            row("publish -> WeightsLoaded, cuda_ipc", confirm, nbytes_, "engine process on the same GPU")
        finally:
            engine.stop()
            server.stop()


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=QWEN3_1B.num_layers, help="decoder layers of the model")
    parser.add_argument("--pushes", type=int, default=10, help="timed pushes per row (>= 10)")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[256.0, 1024.0], help="bucket sizes, MiB")
    parser.add_argument("--no-engine", action="store_true", help="skip the rows that start an engine process")
    parser.add_argument("--cpu", action="store_true", help="smoke run on the CPU over gloo with a toy model (tests)")
    args = parser.parse_args()
    if args.pushes < 10:
        parser.error("--pushes must be at least 10")
    where = Where(cpu=args.cpu)
    cfg = TINY if args.cpu else dataclasses.replace(QWEN3_1B, num_layers=args.layers)
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if torchrun:
        dist.init_process_group("gloo")  # coordination only; the weights go through the transport's own groups
        if dist.get_world_size() != 2:
            raise SystemExit("run with torchrun --nproc-per-node 2 (rank 0 learner, rank 1 engine)")
        two_gpus(cfg, args.bucket_mb, args.pushes, stack=not args.no_engine, where=where)
        dist.barrier()
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    else:
        if not where.cpu and torch.cuda.device_count() >= 2:
            print(
                "2+ GPUs visible: `torchrun --nproc-per-node 2 -m launch.bench.weight_sync` measures the "
                "transfer rows; this run measures the one-GPU rows."
            )
        one_gpu(cfg, args.bucket_mb, args.pushes, ipc=not args.no_engine, where=where)
    print("\n" + HEADER)
    for r in ROWS:
        share = f" ({r['of_raw']:.0%} of raw)" if "of_raw" in r else ""
        print(
            f"| {r['path']} | {r['GB']:.3f} | {r['pushes']} | {r['median_us']:,.0f} | {r['min_us']:,.0f} | "
            f"{r['GBps']:.1f}{share} | {r['note']} |"
        )
    out = os.environ.get("OUT")
    if out:
        Path(out, "weight_sync.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
