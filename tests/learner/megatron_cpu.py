"""What megatron-core sends to "cuda", sent to the CPU, so its GPTModel, schedules and DDP run over gloo
in worker processes on a CPU-only torch (tests/learner/test_megatron_mapping.py says which places)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch


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
