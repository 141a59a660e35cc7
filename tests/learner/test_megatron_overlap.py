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
    from tests.learner.megatron_cpu import cpu_backend, cpu_stand_ins, two_micro_batches

    _, packed, micros = two_micro_batches()

    def run(overlap: bool) -> tuple[list[torch.Tensor], list[int]]:
        # Small buckets (3,000 parameters; the model has ~82,000): many reductions to pair up.
        backend = cpu_backend(overlap=overlap, dp_rank=rank, dp=2, bucket_size=3000)
        ddp, gpt = backend.model, backend.gpt
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
