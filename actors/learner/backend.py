"""The learner-backend interface (docs/training.md): the model code a training library supplies.

A backend owns the policy model, its optimizer and, when a KL term is on, a frozen reference model.
It knows nothing of RL: the algorithm (`actors.learner.algorithm`: the RL step with π_prox,
MirrorPop, mini-batch updates and metrics, and the SFT step) is written once, over this interface.

The heart of it is shaped like megatron-core's `forward_backward_func`: the caller hands over a list
of micro-batches and a loss function; the backend runs each micro-batch forward, gives the loss
function that micro-batch's per-token outputs, backpropagates the loss it returns (unless
`forward_only`) and hands back what the loss function reported, in order. The caller never loops
over micro-batches itself, so a backend can schedule them as it likes (megatron's pipeline
schedules, for one). Gradients accumulate over calls until `zero_grad`; `step` reduces them over the
data-parallel ranks, clips and steps the optimizer.

Backends: `torch` (HF transformers model; CPU and GPU) and `megatron` (megatron-core GPTModel; GPU).
Only the backend modules import their training library.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.learner.batch import MicroBatch, PackedBatch
from actors.learner.data_parallel import DataParallel
from protocols import TrainBatch


@dataclass
class PolicyOutput:
    """One micro-batch's forward pass as the loss function sees it, position-aligned with its slice
    of the PackedBatch (entry t predicts `targets[t]`)."""

    logprobs: torch.Tensor  # float32 [t]: log softmax(logits / T)[target]; carries the gradient when training
    entropy_of: Callable[[], torch.Tensor]  # float32 [t], no gradient: entropy of softmax(logits / T), on demand

    def entropy(self) -> torch.Tensor:
        return self.entropy_of()


# (micro-batch, its outputs) -> (the loss to backpropagate, already normalised, or None in a
# forward-only pass; anything the caller wants back for this micro-batch)
LossFn = Callable[[MicroBatch, PolicyOutput], tuple[torch.Tensor | None, Any]]


class LearnerBackend(abc.ABC):
    """One rank's model code. `dp` sums values over the data-parallel ranks (every DP rank receives the
    whole batch and trains the micro-batches the caller assigns it); `micro_batch_tokens` is the
    largest micro-batch it is given memory for (`learner.micro_batch_tokens`)."""

    dp: DataParallel
    micro_batch_tokens: int

    @abc.abstractmethod
    def pack(self, batch: TrainBatch) -> PackedBatch:
        """The batch on the training device, position-aligned; raises BatchError on bad input."""

    @abc.abstractmethod
    def forward_backward(
        self,
        packed: PackedBatch,
        micro_batches: Sequence[MicroBatch],
        loss_fn: LossFn,
        *,
        temperature: float,
        forward_only: bool = False,
        reference: bool = False,
    ) -> list[Any]:
        """Run every micro-batch through the model (the frozen reference model when `reference`, always
        forward only), call `loss_fn` on its outputs at `temperature`, backpropagate the loss into the
        accumulated gradients unless `forward_only` (no graph is kept then), and return what `loss_fn`
        reported, one entry per micro-batch in order."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def step(self, lr: float | None = None) -> float:
        """Sum the gradients over the DP ranks, clip their global norm (`learner.grad_clip`) and take one
        optimizer step, at `lr` for this step only when given; returns the norm before clipping."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (TP shards gathered), in a fixed order, on the training device."""

    @abc.abstractmethod
    def save_checkpoint(self, path: Path) -> None:
        """Model, optimizer and RNG state under `path` (a directory this call creates)."""

    @abc.abstractmethod
    def load_checkpoint(self, path: Path) -> None: ...

    @abc.abstractmethod
    def export_hf(self, path: Path) -> None:
        """An HF checkpoint (config.json + *.safetensors) that transformers' from_pretrained loads."""
