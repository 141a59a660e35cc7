"""The torch implementations Kiln gives megatron-core where it would call Apex, on megatron's real code,
on CPU over gloo (one rank, in a worker process):
- `fused_grad_accumulation`: with the switch on, megatron's backward takes its fused branch (the
  weight-gradient GEMM adds into each weight's fp32 main grad, `grad_accumulation.py`) and DDP's hook
  skips its add. The main grads over two micro-batches equal those of the hook's add, and the switch
  takes effect at the next forward in both directions. The GPU path (bf16 inputs, fp32 output) is
  tests/learner/test_megatron_gpu.py's.
- `fused_grad_clip`: megatron's own `get_grad_norm_fp32` gives the global norm of those gradients
  through `grad_clip.l2norm`; its clip and its main-to-model copy through `grad_clip.scale` equal
  its per-tensor fallback's results bit for bit; the switch puts megatron's own functions back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _worker(port: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from actors.learner.megatron.model import Kernels
    from tests.learner.megatron_cpu import cpu_backend, cpu_stand_ins, two_micro_batches

    _, packed, micros = two_micro_batches()
    backend = cpu_backend(overlap=False, dp_rank=0, dp=1)
    ddp, gpt = backend.model, backend.gpt

    def grads(fused: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
        backend.kernels = Kernels(fused_logprobs=False, compile=False, fused_grad_accumulation=fused)
        ddp.zero_grad_buffer()
        with cpu_stand_ins():
            backend.forward_backward(
                packed, micros, lambda mb, out: ((out.logprobs * 1.7).sum(), None), temperature=0.7
            )
        params = dict(gpt.named_parameters())
        marked = sorted(n for n, p in params.items() if getattr(p, "grad_added_to_main_grad", False))
        return {n: p.main_grad.clone() for n, p in params.items()}, marked

    runs = [grads(False), grads(True), grads(False)]
    clip = _grad_clip(list(runs[0][0].values()))
    linear = sum(type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear") for m in gpt.modules())
    base = runs[0][0]
    print(
        json.dumps(
            {
                "linear_layers": linear,
                "marked": [marked for _, marked in runs],
                "diff": [max(float((g[n] - base[n]).abs().max()) for n in base) for g, _ in runs],
                "scale": max(float(t.abs().max()) for t in base.values()),
                "zero": [n for n, t in base.items() if not bool(t.abs().sum() > 0)],
                "clip": clip,
            }
        )
    )
    dist.destroy_process_group()
    os._exit(0)


def _grad_clip(grads: list) -> dict:
    """megatron's norm, clip and copy with grad_clip's kernels switched in, against plain torch and
    megatron's own per-tensor fallback."""
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.optimizer import _multi_tensor_copy_this_to_that
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from actors.learner.megatron import grad_clip
    from tests.learner.megatron_cpu import cpu_stand_ins

    expected = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    grad_clip.switch(True)
    with cpu_stand_ins():
        norm = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=dist.group.WORLD)
    clipped, reference = [g.clone() for g in grads], [g.clone() for g in grads]
    clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, None, [clipped, clipped], 0.37)
    local_multi_tensor_scale(0, None, [reference, reference], 0.37)
    copies = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    _multi_tensor_copy_this_to_that(grads, copies, overflow_buf=torch.zeros(1, dtype=torch.int))
    grad_clip.switch(False)
    return {
        "tensors": len(grads),
        "norm": norm,
        "expected": expected,
        "clip_equal": all(torch.equal(a, b) for a, b in zip(clipped, reference, strict=True)),
        "clip_moved": all(not torch.equal(a, g) for a, g in zip(clipped, grads, strict=True)),
        "copy_equal": all(torch.equal(c, g.bfloat16()) for c, g in zip(copies, grads, strict=True)),
        "restored": clip_grads.l2_norm_impl is local_multi_tensor_l2_norm
        and clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale,
    }


@pytest.fixture(scope="module")
def result() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, __file__, str(port)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_fused_branch_runs_only_when_switched_on(result):
    off, on, off_again = result["marked"]
    # Each decoder layer's qkv, proj, fc1 and fc2, and the output layer: megatron marks every weight
    # whose gradient its fused branch added into main_grad.
    assert result["linear_layers"] == 2 * 4 + 1
    assert len(on) == result["linear_layers"] and all(n.endswith("weight") for n in on), on
    assert off == [] and off_again == []


def test_the_main_grads_equal_those_of_the_hooks_add(result):
    assert result["zero"] == []  # every parameter has a gradient: the comparison covers all of them
    assert result["diff"][0] == 0.0
    # The same fp32 products summed in another order: equal to fp32 rounding, over both micro-batches.
    assert result["diff"][1] <= 1e-5 * result["scale"], result
    assert result["diff"][2] == 0.0  # switched back off: the hook's add again, bit for bit


if __name__ == "__main__":
    _worker(int(sys.argv[1]))


def test_megatrons_grad_norm_clip_and_copy_through_the_multi_tensor_kernels(result):
    clip = result["clip"]
    assert clip["tensors"] > 10  # every parameter's gradient, as the optimizer passes them
    assert clip["norm"] > 0 and abs(clip["norm"] - clip["expected"]) <= 1e-5 * clip["expected"], clip
    assert clip["clip_equal"] and clip["clip_moved"], clip
    assert clip["copy_equal"], clip
    assert clip["restored"], clip
