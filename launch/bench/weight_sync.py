"""GPU benchmark of the learner -> engine weight push (DESIGN.md §7), one command on a 2-GPU machine:

    python -m launch.bench.weight_sync          # ~1.1B Qwen3-style model, random init, bf16

The learner process holds the model on cuda:0; it spawns an engine process (TorchEngine + WeightClient,
the rollout side) and measures, for the same model:
1. raw NCCL: one broadcast of a flat buffer of the model's size between the two GPUs (the link's
   bandwidth, the bound for everything below);
2. `WeightServer.publish` over NCCL to an engine on cuda:1, for two bucket sizes: the push (publish
   returns once the engine received every bucket) and push -> WeightsLoaded (received, applied);
3. CUDA IPC with the engine on the learner's GPU (cuda:0): export (copy into bucket buffers) and
   push -> WeightsLoaded (the engine copies out of the shared buffers).
Prints one table. No hub access: the model is built from a config with random init. With one GPU only
the CUDA IPC rows run.

`engine_process` is also the engine side of the GPU tests (tests/test_weight_sync_gpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import queue
import statistics
import tempfile
import threading
import time

import torch

from configs import ModelConfig

# ~1.1B parameters: 16 layers of width 2048 (~805M) + a tied 151,936-token embedding (311M).
QWEN3_1B = ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=2048, num_layers=16, num_heads=16,
                       num_kv_heads=8, intermediate_size=6144, max_seq_len=2048, dtype="bfloat16")


# ------------------------------------------------------------------------------ engine process


def engine_process(commands, results, endpoints: dict, model: ModelConfig, device: str, engine_id: str) -> None:
    """An engine in its own process: a TorchEngine on `device` brought to the learner's version by a
    WeightClient, then following announcements. Commands: ("score", prompt, response, T) answers
    ("score", version, logprobs); ("version",) answers ("version", v); ("stop",) ends it."""
    from actors.rollout.engine import GenerateRequest, SamplingParams
    from actors.rollout.torch_engine import TorchEngine
    from actors.rollout.weight_client import WeightClient

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
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
    except Exception as err:  # the parent must hear why, not wait for a timeout
        results.put(("error", repr(err)))
    finally:
        stop.set()
        if thread is not None:
            thread.join(10)
        client.close()
        engine.close()


class EngineProcess:
    """The parent's handle on an `engine_process` (spawned: CUDA cannot fork)."""

    def __init__(self, endpoints: dict, model: ModelConfig, device: str, engine_id: str,
                 start_timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=engine_process, daemon=True,
                                args=(self.commands, self.results, endpoints, model, device, engine_id))
        self.proc.start()
        self.ready_version = self._expect("ready", start_timeout_s)[1]

    def _expect(self, kind: str, timeout_s: float):
        try:
            msg = self.results.get(timeout=timeout_s)
        except queue.Empty:
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


# ------------------------------------------------------------------------------ measurements


def _raw_receiver(port: int, nbytes: int, repeats: int, device: str) -> None:
    from actors.policy.weights.group import WeightReceiver

    torch.cuda.set_device(device)
    receiver = WeightReceiver("127.0.0.1", port, 1, 2, group_name="raw", backend="nccl", device=device)
    for _ in range(repeats):
        receiver.receive(["flat"], ["uint8"], [[nbytes]])
    torch.cuda.synchronize()


def raw_nccl_seconds(nbytes: int, repeats: int = 5) -> list[float]:
    """Seconds of one broadcast of `nbytes` from cuda:0 to a process on cuda:1 (after one warm-up)."""
    from actors.policy.weights.group import WeightBroadcaster

    ctx = mp.get_context("spawn")
    sender = WeightBroadcaster("127.0.0.1", 0, 2, group_name="raw", backend="nccl", timeout_s=120, form=False)
    proc = ctx.Process(target=_raw_receiver, args=(sender.port, nbytes, repeats + 1, "cuda:1"), daemon=True)
    proc.start()
    sender.form()
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        sender.broadcast([("flat", flat)])
        torch.cuda.synchronize()
        if i:  # the first broadcast sets up the communicator's buffers
            times.append(time.perf_counter() - start)
    proc.join(120)
    sender.close()
    return times


def push_seconds(model: torch.nn.Module, cfg: ModelConfig, transport: str, bucket_mbs: list[float],
                 engine_device: str, versions: int = 3) -> dict[float, tuple[list[float], list[float], int]]:
    """For each bucket size: (publish seconds, publish -> confirmed seconds, bytes) of `versions` pushes
    to one engine process (one engine serves every bucket size: each announcement carries its own)."""
    from actors.learner.weight_sync import WeightServer

    out = {}
    with tempfile.TemporaryDirectory() as run_dir:
        server = WeightServer(run_dir, transport=transport, timeout_s=300, join_timeout_s=300)
        endpoints = server.start()
        engine = EngineProcess(endpoints, cfg, engine_device, f"bench-{transport}")
        v = 0
        try:
            for bucket_mb in bucket_mbs:
                server.bucket_bytes = int(bucket_mb * 2**20)
                pushes, confirms, nbytes = [], [], 0
                for i in range(versions + 1):
                    v += 1
                    start = time.perf_counter()
                    report = server.publish(v, model.named_parameters)
                    pushed = time.perf_counter() - start
                    if not server.wait_confirmed(v, [f"bench-{transport}"], timeout_s=300):
                        raise TimeoutError(f"{transport}: version {v} not confirmed: {server.health()}")
                    if i:  # the first push of a size includes set-up (NCCL buffers, IPC handle opening)
                        pushes.append(pushed)
                        confirms.append(time.perf_counter() - start)
                    nbytes = report.bytes
                out[bucket_mb] = (pushes, confirms, nbytes)
        finally:
            engine.stop()
            server.stop()
    return out


def _row(name: str, seconds: list[float], nbytes: int, note: str = "") -> str:
    med = statistics.median(seconds)
    return f"| {name} | {nbytes / 1e9:.2f} | {med * 1e3:,.0f} | {nbytes / med / 1e9:.1f} | {note} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=QWEN3_1B.num_layers)
    parser.add_argument("--versions", type=int, default=3, help="timed pushes per configuration")
    args = parser.parse_args()
    cfg = dataclasses.replace(QWEN3_1B, num_layers=args.layers)
    from actors.policy.model import build_model

    torch.cuda.set_device(0)
    model = build_model(cfg, "cuda:0")
    params = sum(p.numel() for p in dict(model.named_parameters()).values())
    gpus = torch.cuda.device_count()
    print(f"model: {params / 1e9:.2f}B parameters, {cfg.dtype}; {gpus} x {torch.cuda.get_device_name(0)}")
    rows = ["| path | GB | median ms | GB/s | note |", "| --- | --- | --- | --- | --- |"]

    def add(row: str) -> None:  # printed as measured too, so a cut-short run still shows its rows
        rows.append(row)
        print(row, flush=True)

    if gpus >= 2:
        nbytes = sum(p.numel() * p.element_size() for p in dict(model.named_parameters()).values())
        add(_row("raw NCCL broadcast, one flat buffer, cuda:0 -> cuda:1", raw_nccl_seconds(nbytes), nbytes,
                         "link bound"))
        for bucket_mb, (pushes, confirms, nbytes) in push_seconds(model, cfg, "nccl", [256, 64], "cuda:1",
                                                                   args.versions).items():
            add(_row(f"publish, nccl, {bucket_mb} MB buckets (received)", pushes, nbytes,
                             "per-tensor broadcasts, SGLang's contract"))
            add(_row(f"publish -> WeightsLoaded, nccl, {bucket_mb} MB", confirms, nbytes,
                             "+ staging copy and apply"))
    for bucket_mb, (pushes, confirms, nbytes) in push_seconds(model, cfg, "cuda_ipc", [256], "cuda:0",
                                                               args.versions).items():
        add(_row(f"publish, cuda_ipc, {bucket_mb} MB buckets (exported)", pushes, nbytes,
                         "copy into shared buffers"))
        add(_row("publish -> WeightsLoaded, cuda_ipc", confirms, nbytes, "engine on the same GPU"))
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
