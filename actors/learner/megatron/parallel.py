"""Process groups for the megatron backend: torch.distributed and megatron's TP x DP x PP layout.

Under torchrun or Ray the standard env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)
name the job and env:// initialises it; without them the process is a world of one on a free
loopback port. Megatron orders the ranks TP fastest, then DP, then PP (the placement plan's order);
CP is always 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel


@dataclass(frozen=True)
class Layout:
    """This rank's place in the TP x DP x PP grid."""

    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    rank: int  # global
    pp: int = 1
    pp_rank: int = 0


def init_distributed(device: str | torch.device) -> torch.device:
    """Initialise torch.distributed (NCCL) once per process and bind this process to its GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("the megatron backend needs CUDA (megatron-core does not run on CPU)")
    device = torch.device(device)
    if "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    elif device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(minutes=10)
        if "RANK" in os.environ:
            dist.init_process_group("nccl", init_method="env://", timeout=timeout, device_id=device)
        else:
            # A world of one: its store listens on a port the kernel picks, so nothing can take it first.
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timeout, device_id=device)
    return device


def init_model_parallel(tp: int, seed: int, pp: int = 1) -> Layout:
    """megatron's TP x DP x PP groups over the whole world; re-initialised if a different layout is
    asked for (one process may build several backends, as gpu_check does)."""
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"tensor_parallel={tp} x pipeline_parallel={pp} does not divide the world size {world}")
    if parallel_state.model_parallel_is_initialized() and (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    ) != (tp, pp):
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Layout(
        tp=tp,
        dp=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        rank=dist.get_rank(),
        pp=pp,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
    )
