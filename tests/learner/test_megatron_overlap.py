"""learner.megatron.overlap_grad_reduce on megatron-core's real DDP, two DP replicas over gloo on CPU:
the gradients that each bucket's reduce-scatter leaves (issued from backward hooks) are bit for bit
the ones of the reduction after backward, step after step, including a batch that leaves one replica
without a share (it runs its zero-loss micro-batch, so its reductions pair with the other's), one
that leaves both without (both run it), and a step with no backward at all (the reductions are
issued at the step). The optimizer is not built here (megatron's distributed optimizer needs CUDA):
the backend's `reduce_gradients`, the first half of its step, is."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each step: the micro-batches of rank 0 and of rank 1 (indices into the batch's two), then whether it runs
# forward_backward at all.
STEPS = [([0], [1], True), ([1], [0], True), ([0, 1], [], True), ([], [], True), ([], [], False)]


def _worker(rank: int, port: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state

    from actors.learner.megatron import hf_mapping as hm
    from actors.learner.megatron.backend import MegatronBackend, data_parallel
    from actors.learner.megatron.model import Kernels, build_gpt, load_hf_weights, rotary_tables
    from actors.learner.megatron.parallel import Layout
    from actors.policy.model import build_model
    from configs import ModelConfig
    from tests.learner.megatron_cpu import cpu_stand_ins, two_micro_batches

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    cfg = ModelConfig(
        arch="qwen3", vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96
    )
    hf = build_model(cfg, "cpu")
    shape = hm.ModelShape.from_hf_config(hf.config, 1)
    stage = hm.stage(shape, 1, 0)
    _, packed, micros = two_micro_batches()

    def run(overlap: bool) -> tuple[list[torch.Tensor], list[int]]:
        with cpu_stand_ins():
            gpt = build_gpt(
                hf.config, shape, tensor_parallel=1, dtype="float32", max_seq_len=128, stage=stage, on_cpu=True
            )
            load_hf_weights(gpt, hf.state_dict(), shape)
            # Small buckets (3,000 parameters; the model has ~82,000): many reductions to pair up.
            ddp = data_parallel(gpt, overlap_grad_reduce=overlap, bucket_size=3000)
        # The backend's forward_backward and reduce_gradients on this DDP, without its GPU set-up.
        backend = object.__new__(MegatronBackend)
        backend.model, backend.gpt, backend.reference, backend.device = ddp, gpt, None, torch.device("cpu")
        backend.shape, backend.stage, backend.rope = shape, stage, rotary_tables(hf.config, shape)
        backend.layout = Layout(tp=1, dp=2, tp_rank=0, dp_rank=rank, rank=rank, pp=1, pp_rank=0)
        backend.kernels = Kernels(fused_logprobs=False, compile=False)
        backend.overlap_grad_reduce, backend.micro_batch_tokens = overlap, 30
        grads, reports = [], []
        for step, (*shares, runs) in enumerate(STEPS):
            ddp.zero_grad_buffer()
            backend._backward_ran = False  # what zero_grad resets (it also zeroes the optimizer, absent here)
            with cpu_stand_ins():
                if runs:
                    mine = [micros[i] for i in shares[rank]]
                    scale = 1.0 + step  # a different loss each step

                    def loss_fn(mb, out, scale=scale):
                        return (out.logprobs * scale).sum(), mb.start

                    reports.append(len(backend.forward_backward(packed, mine, loss_fn, temperature=0.7)))
                backend.reduce_gradients()
            # Each rank holds its reduced shard of every bucket; gather the shards to compare whole buffers.
            for buffer in ddp.buffers:
                for bucket in buffer.buckets:
                    n = bucket.grad_data.numel() // 2
                    dist.all_gather_into_tensor(bucket.grad_data, bucket.grad_data[rank * n : (rank + 1) * n].clone())
            grads.append(torch.cat([p.main_grad.reshape(-1).clone() for p in gpt.parameters()]))
        return grads, reports

    after, reports_after = run(overlap=False)
    during, reports_during = run(overlap=True)
    print(
        json.dumps(
            {
                "rank": rank,
                "diff": [float((a - b).abs().max()) for a, b in zip(after, during, strict=True)],
                "norm": [float(g.norm()) for g in during],
                "reports": [reports_after, reports_during],
            }
        )
    )
    dist.destroy_process_group()
    os._exit(0)


def test_overlapped_reduction_equals_the_reduction_after_backward():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    results = sorted((json.loads(out.strip().splitlines()[-1]) for out, _ in outs), key=lambda r: r["rank"])
    for r in results:
        assert r["diff"] == [0.0] * len(STEPS), r  # bit for bit, every step
        assert r["norm"][:3] == results[0]["norm"][:3] and all(n > 0 for n in r["norm"][:3]), r
        assert r["norm"][3:] == [0.0, 0.0], r  # zero-loss micro-batches only, then no backward: zero gradients
    # The replica with no share reports nothing of its zero-loss micro-batch.
    assert results[0]["reports"] == [[1, 1, 2, 0], [1, 1, 2, 0]]
    assert results[1]["reports"] == [[1, 1, 0, 0], [1, 1, 0, 0]]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]))
