"""What megatron-core sends to "cuda", sent to the CPU, so its GPTModel, schedules and DDP run over gloo
in worker processes on a CPU-only torch (tests/learner/test_megatron_mapping.py says which places)."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import torch

from actors.learner.batch import MicroBatch, PackedBatch, micro_batches, pack
from protocols import TrainBatch

VOCAB = 300  # the workers' tiny models' vocabulary


@contextlib.contextmanager
def cpu_stand_ins():
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real_zeros(*args, **kwargs)

    with (
        mock.patch("torch.zeros", zeros),
        mock.patch("torch.cuda.current_device", lambda: "cpu"),
        mock.patch("torch.cuda.synchronize", lambda *a, **k: None),
        mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self),
    ):
        yield


def two_micro_batches() -> tuple[torch.Tensor, PackedBatch, list[MicroBatch]]:
    """Sequences of 25, 0 and 15 random tokens, packed on the CPU, and their two micro-batches of at
    most 30 tokens: [seq 0 + the empty seq 1], [seq 2]. Returns (tokens, packed, micro-batches)."""
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (40,))
    batch = TrainBatch(
        version=0,
        episode_ids=["a", "b", "c"],
        tokens=tokens.numpy(),
        cu_seqlens=np.array([0, 25, 25, 40]),
        loss_mask=np.ones(40, bool),
        behaviour_logprobs=np.zeros(40, np.float32),
        advantages=np.zeros(3, np.float32),
        versions=np.zeros(40, np.int64),
    )
    packed = pack(batch, "cpu", vocab_size=VOCAB, max_seq_len=128)
    micros = micro_batches(packed.cu_seqlens, 30)
    assert len(micros) == 2
    return tokens, packed, micros


def cpu_backend(*, overlap: bool, dp_rank: int, dp: int, bucket_size: int | None = None):
    """The workers' tiny Qwen3 (2 layers of 64, float32) in megatron's GPTModel and DDP on the CPU, and a
    `MegatronBackend` around them without its GPU set-up: its forward_backward and reduce_gradients
    run, over micro-batches of at most 30 tokens (the optimizer is not built: megatron's distributed
    optimizer needs CUDA). Model parallel state (TP = PP = 1) must not be set up yet."""
    from megatron.core import parallel_state

    from actors.learner.megatron import hf_mapping as hm
    from actors.learner.megatron.backend import MegatronBackend, data_parallel
    from actors.learner.megatron.model import Kernels, build_gpt, load_hf_weights, rotary_tables
    from actors.learner.megatron.parallel import Layout
    from actors.policy.model import build_model
    from configs import ModelConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    cfg = ModelConfig(
        arch="qwen3", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96
    )
    hf = build_model(cfg, "cpu")
    shape = hm.ModelShape.from_hf_config(hf.config, 1)
    stage = hm.stage(shape, 1, 0)
    with cpu_stand_ins():
        gpt = build_gpt(hf.config, shape, tensor_parallel=1, dtype="float32", max_seq_len=128, stage=stage, on_cpu=True)
        load_hf_weights(gpt, hf.state_dict(), shape)
        ddp = data_parallel(gpt, overlap_grad_reduce=overlap, bucket_size=bucket_size)
    backend = object.__new__(MegatronBackend)
    backend.model, backend.gpt, backend.reference, backend.device = ddp, gpt, None, torch.device("cpu")
    backend.shape, backend.stage, backend.rope = shape, stage, rotary_tables(hf.config, shape)
    backend.layout = Layout(tp=1, dp=dp, tp_rank=0, dp_rank=dp_rank, rank=dp_rank, pp=1, pp_rank=0)
    backend.kernels = Kernels(fused_logprobs=False, compile=False)
    backend.overlap_grad_reduce, backend.micro_batch_tokens, backend._backward_ran = overlap, 30, False
    return backend
