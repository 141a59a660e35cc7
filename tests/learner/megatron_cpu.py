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
