"""The learner-backend interface (DESIGN.md §7): what `LearnerActor` needs from a training backend.

A backend owns the policy model and its optimizer. It recomputes log π_prox for a `TrainBatch`,
takes one off-policy-corrected step (losses in `actors.learner.losses`, backend-free), and exports
HF-named full tensors for the weight push and for checkpoints that transformers loads. Backends:
`torch` (HF transformers model; CPU and GPU) and `megatron` (megatron-core GPTModel; GPU). Only the
backend modules import their training library.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from actors.learner.batch import MicroBatch, PackedBatch
from actors.learner.data_parallel import DataParallel
from actors.learner.losses import sft_loss
from protocols import TrainBatch


@dataclass
class StepResult:
    """What one learner step did, for the metrics stream (every value a plain float)."""

    loss: float
    grad_norm: float
    tokens: int  # tokens in the batch (prompt + response)
    trained_tokens: int  # gradient-carrying tokens that MirrorPop kept
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)  # kept_fraction, clip_fraction, is-weight stats, ...


class LearnerBackend(abc.ABC):
    """One rank group's model + optimizer. Constructed from (ModelConfig, LearnerConfig, AlgoConfig)."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch) -> StepResult:
        """Recompute log π_prox with the current weights, apply MirrorPop, take one optimizer step."""

    @abc.abstractmethod
    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> StepResult:
        """One cross-entropy step on the batch's loss-masked tokens (warm starts), at learning rate
        `lr` for this step when given (the optimizer's own otherwise)."""

    @abc.abstractmethod
    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """log softmax(logits / T) of every token given its prefix within its sequence: float32 [N];
        position 0 of each sequence (no prefix) is 0."""

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


def sft_step_over(packed: PackedBatch, mine: list[MicroBatch], logprobs_of: Callable[[MicroBatch], torch.Tensor],
                  step: Callable[[], float], dp: DataParallel, started: float) -> StepResult:
    """The warm-start step of every backend, once its gradients are zeroed: cross-entropy on this rank's
    micro-batches (`logprobs_of` at T = 1), normalised by the whole batch's loss-masked token count
    (every rank sees the whole batch), then `step()` (reduce, clip, step; returns the grad norm).
    A batch without loss-masked tokens takes no step."""
    normalizer = float(packed.grad_mask.sum())
    loss_total = 0.0
    for mb in mine if normalizer else []:
        loss = sft_loss(logprobs_of(mb), packed.grad_mask[mb.positions], normalizer)
        loss.backward()
        loss_total += float(loss.detach())
    grad_norm = step() if normalizer > 0 else 0.0
    return StepResult(loss=dp.sum(loss_total), grad_norm=grad_norm, tokens=packed.num_tokens,
                      trained_tokens=int(normalizer), seconds=time.perf_counter() - started,
                      metrics={"skipped": float(normalizer == 0)})
