"""The learner's algorithm, written once for every backend (docs/training.md): the RL step and the SFT
step over the `LearnerBackend` interface, and `Trainer`, which binds them to one backend.

One RL step takes one batch, and makes one weight version of it:
  (a) π_prox: a forward-only pass with the weights before the batch's first update gives log π_prox
      of every gradient-carrying token, and the policy's entropy there; each DP rank computes its
      share and the shares are summed, so every rank holds the whole batch's. With a KL term, a pass
      of the frozen reference model gives log π_ref the same way;
  (b) MirrorPop drops the sequences whose mean |log π_prox - log μ| exceeds δ, and takes out of the
      gradient the tokens of the others whose own |log π_prox - log μ| exceeds δ_tok;
  (c) the kept sequences split into `algo.ppo_minibatches` mini-batches (consecutive sequences with
      about equal kept-token counts), and each of `algo.ppo_epochs` passes takes one optimizer update
      per mini-batch: the decoupled policy loss (+ kl_coef · the k3 KL to the reference) over the
      mini-batch's micro-batches, which the DP ranks share, then one step. The loss of an update is
      normalised by the kept-token count of its mini-batch (over every micro-batch and rank), so each
      update is a token mean over what it trains on. π_prox stays fixed for the whole batch: from the
      second update on π_θ ≠ π_prox, r_t moves and the clip acts;
  (d) a forward-only pass after the last update measures how far the batch moved the policy: the k3
      estimate of KL(π_prox ‖ π_θ) on the kept tokens.
A batch in which MirrorPop keeps nothing takes no update (AdamW would still move the weights through
its momentum and weight decay). The RL step never loops over micro-batches: the backend's
`forward_backward` does, so a backend may pipeline them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from actors.learner.backend import LearnerBackend, PolicyOutput
from actors.learner.batch import MicroBatch, PackedBatch, micro_batches, mini_batches
from actors.learner.data_parallel import assign_micro_batches
from actors.learner.losses import (
    ClipStats,
    FilterStats,
    filter_stats,
    kl_penalty,
    mirrorpop_mask,
    policy_loss_on_device,
    sft_loss,
)
from configs import AlgoConfig
from protocols import TrainBatch


@dataclass
class StepResult:
    """What one learner step did, for the metrics stream (every value a plain float)."""

    loss: float  # RL: the mean over the step's updates of each update's loss; SFT: the loss
    grad_norm: float  # global gradient norm before clipping; RL: the mean over the updates
    tokens: int  # tokens in the batch (prompt + response)
    trained_tokens: int  # gradient-carrying tokens that MirrorPop kept
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)  # kept_fraction, clip_fraction, entropy, ...
    dropped: tuple[int, ...] = ()  # RL: the batch's sequences that MirrorPop dropped (indices)


# ------------------------------------------------------------------------------------ RL step


def rl_step(backend: LearnerBackend, batch: TrainBatch, algo: AlgoConfig, *, temperature: float) -> StepResult:
    """One batch: π_prox and MirrorPop once, then ppo_epochs × ppo_minibatches optimizer updates
    (fewer mini-batches when fewer sequences were kept)."""
    started = time.perf_counter()
    fixed, filtered, entropy = _proximal(backend, backend.pack(batch), algo, temperature)
    minis = mini_batches(fixed.kept_per_seq, algo.ppo_minibatches)
    updates = [_update(backend, fixed, seqs, algo, temperature) for _ in range(algo.ppo_epochs) for seqs in minis]
    drift = _drift(backend, fixed, temperature) if updates else 0.0

    clip = sum((u.clip for u in updates), ClipStats())
    loss_sum, kl_sum, drift, *counts = backend.dp.sum_all(
        [
            sum(u.loss for u in updates),
            sum(u.kl for u in updates),
            drift,
            clip.tokens,
            clip.clipped_low,
            clip.clipped_high,
        ]
    )
    clip = ClipStats(*(round(c) for c in counts))
    n = max(len(updates), 1)
    grad_norms = [u.grad_norm for u in updates] or [0.0]
    packed = fixed.packed
    metrics = {
        **filtered.metrics(),
        **clip.metrics(),
        "approx_kl": drift / filtered.kept_tokens if updates else 0.0,
        "entropy": _masked_mean(entropy, packed.grad_mask),
        "response_length": float(np.sum(batch.loss_mask)) / max(packed.num_seqs, 1),
        "updates": float(len(updates)),
        "skipped": float(not updates),
        "grad_norm_max": max(grad_norms),
    }
    if algo.kl_coef > 0:
        metrics["kl"] = kl_sum / n
    return StepResult(
        loss=loss_sum / n,
        grad_norm=sum(grad_norms) / len(grad_norms),
        tokens=packed.num_tokens,
        trained_tokens=filtered.kept_tokens,
        seconds=time.perf_counter() - started,
        metrics=metrics,
        dropped=filtered.dropped,
    )


@dataclass
class _Proximal:
    """What stays fixed while a batch is trained on: log π_prox, log π_ref, MirrorPop's verdict."""

    packed: PackedBatch
    prox: torch.Tensor  # float32 [N], position-aligned
    ref: torch.Tensor | None  # float32 [N] when a KL term is on
    kept: torch.Tensor  # bool [N]: gradient-carrying positions MirrorPop kept (sequence filter and token bound)
    kept_per_seq: np.ndarray  # int64 [S]: kept positions per sequence


@dataclass
class _Update:
    """One optimizer update, as this rank saw it."""

    loss: float  # this rank's micro-batches' share of the update's loss
    kl: float
    grad_norm: float
    clip: ClipStats


def _proximal(
    backend: LearnerBackend, packed: PackedBatch, algo: AlgoConfig, temperature: float
) -> tuple[_Proximal, FilterStats, torch.Tensor]:
    """(a) and (b) of the module docstring: the π_prox pass (with entropies), MirrorPop, the reference
    pass. Returns what the updates need, MirrorPop's statistics and the entropies."""
    grad_mask, behaviour = packed.grad_mask, packed.behaviour_logprobs
    prox, entropy = _forward_pass(backend, packed, _with_tokens(packed, grad_mask), temperature, entropy=True)
    keep, kept, deviation = mirrorpop_mask(
        prox,
        behaviour,
        grad_mask,
        packed.seq_index,
        packed.num_seqs,
        delta=algo.mirrorpop_delta,
        token_delta=algo.mirrorpop_token_delta,
    )
    filtered = filter_stats(prox, behaviour, grad_mask, keep, kept, deviation, packed.seq_index, is_cap=algo.is_cap)
    kept_per_seq = _per_sequence(packed, kept)
    ref = None
    if algo.kl_coef > 0 and filtered.kept_tokens:
        ref, _ = _forward_pass(backend, packed, np.flatnonzero(kept_per_seq), temperature, reference=True)
    return _Proximal(packed, prox, ref, kept, kept_per_seq), filtered, entropy


def _update(
    backend: LearnerBackend, fixed: _Proximal, seqs: np.ndarray, algo: AlgoConfig, temperature: float
) -> _Update:
    """One optimizer update on the mini-batch `seqs`, its loss a token mean over the mini-batch's kept
    tokens (the normalizer counts them on every micro-batch and DP rank alike)."""
    packed, prox, ref, kept = fixed.packed, fixed.prox, fixed.ref, fixed.kept
    normalizer = float(fixed.kept_per_seq[seqs].sum())

    def loss_fn(mb: MicroBatch, out: PolicyOutput):
        p = mb.positions
        loss, counts = policy_loss_on_device(
            out.logprobs,
            prox[p],
            packed.behaviour_logprobs[p],
            packed.advantages[p],
            kept[p],
            eps_low=algo.eps_low,
            eps_high=algo.eps_high,
            is_cap=algo.is_cap,
            normalizer=normalizer,
        )
        kl = torch.zeros((), device=loss.device)
        if ref is not None:
            kl_term = kl_penalty(out.logprobs, ref[p], kept[p], normalizer)
            loss, kl = loss + algo.kl_coef * kl_term, kl_term.detach()
        # The report stays on the device, [loss, kl, tokens, clipped_low, clipped_high]: read here, between
        # the micro-batch's forward and its backward, it would make the GPU wait for the host.
        return loss, torch.cat([torch.stack([loss.detach(), kl]).double(), counts.double()])

    backend.zero_grad()
    reports = backend.forward_backward(packed, _mine(backend, packed, seqs), loss_fn, temperature=temperature)
    grad_norm = backend.step()
    loss, kl, *counts = torch.stack(reports).sum(0).tolist() if reports else [0.0] * 5  # one host read
    return _Update(loss=loss, kl=kl, grad_norm=grad_norm, clip=ClipStats(*(round(c) for c in counts)))


def _drift(backend: LearnerBackend, fixed: _Proximal, temperature: float) -> float:
    """(d): this rank's Σ over kept tokens of the k3 estimate of KL(π_prox ‖ π_θ) with the current
    weights, r - 1 - log r with r = π_θ/π_prox (the tokens are μ's samples; MirrorPop kept only
    sequences where μ is close to π_prox)."""

    def measure(mb: MicroBatch, out: PolicyOutput):
        p = mb.positions
        return None, float(kl_penalty(fixed.prox[p], out.logprobs, fixed.kept[p], 1.0))

    mine = _mine(backend, fixed.packed, np.flatnonzero(fixed.kept_per_seq))
    return sum(backend.forward_backward(fixed.packed, mine, measure, temperature=temperature, forward_only=True))


# ----------------------------------------------------------------------------------- SFT step


def sft_step(backend: LearnerBackend, batch: TrainBatch, lr: float | None = None) -> StepResult:
    """The warm-start step: cross-entropy on the batch's loss-masked tokens (logprobs at T = 1),
    normalised by the whole batch's loss-masked token count, one optimizer step at `lr` for this step
    when given (the optimizer's own otherwise). A batch without loss-masked tokens takes no step."""
    started = time.perf_counter()
    packed = backend.pack(batch)
    mask = packed.grad_mask
    normalizer = float(mask.sum())
    loss, grad_norm = 0.0, 0.0
    if normalizer > 0:

        def loss_fn(mb: MicroBatch, out: PolicyOutput):
            value = sft_loss(out.logprobs, mask[mb.positions], normalizer)
            return value, value.detach()

        backend.zero_grad()
        mine = _mine(backend, packed, _with_tokens(packed, mask))
        reports = backend.forward_backward(packed, mine, loss_fn, temperature=1.0)
        grad_norm = backend.step(lr)
        # The loss comes to the host after the step: read between a micro-batch's forward and its
        # backward, it would make the GPU wait for the host to launch the backward.
        loss = backend.dp.sum(float(sum(reports)))
    return StepResult(
        loss=loss,
        grad_norm=grad_norm,
        tokens=packed.num_tokens,
        trained_tokens=int(normalizer),
        seconds=time.perf_counter() - started,
        metrics={"skipped": float(normalizer == 0)},
    )


# ---------------------------------------------------------------------------------- logprobs


def policy_logprobs(backend: LearnerBackend, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of every token given its prefix within its sequence: float32 [N] on the
    CPU, token-aligned; position 0 of each sequence (no prefix) is 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    packed = backend.pack(batch)
    predicted, _ = _forward_pass(backend, packed, np.arange(packed.num_seqs), temperature)
    return packed.to_token_aligned(predicted).cpu()


# ----------------------------------------------------------------------------------- helpers


def _mine(backend: LearnerBackend, packed: PackedBatch, seqs: np.ndarray) -> list[MicroBatch]:
    """This DP rank's micro-batches of the sequences `seqs` (every rank derives the same split)."""
    micros = micro_batches(packed.cu_seqlens, backend.micro_batch_tokens, seqs)
    return assign_micro_batches(micros, backend.dp.size, backend.dp.rank)


def _forward_pass(
    backend: LearnerBackend,
    packed: PackedBatch,
    seqs: np.ndarray,
    temperature: float,
    *,
    entropy: bool = False,
    reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A forward-only pass over the sequences `seqs`: position-aligned logprobs [N] (and entropies),
    whole on every DP rank (each rank computes its micro-batches, the sum fills in the rest); 0 on the
    positions of other sequences."""
    device = packed.tokens.device
    logprobs = torch.zeros(packed.num_tokens, dtype=torch.float32, device=device)
    entropies = torch.zeros_like(logprobs) if entropy else None

    def collect(mb: MicroBatch, out: PolicyOutput):
        return None, (out.logprobs.detach(), out.entropy() if entropy else None)

    mine = _mine(backend, packed, seqs)
    reports = backend.forward_backward(
        packed, mine, collect, temperature=temperature, forward_only=True, reference=reference
    )
    for mb, (lp, h) in zip(mine, reports, strict=True):
        logprobs[mb.positions] = lp.float()
        if entropies is not None:
            entropies[mb.positions] = h.float()
    backend.dp.sum_tensor(logprobs)
    if entropies is not None:
        backend.dp.sum_tensor(entropies)
    return logprobs, entropies


def _per_sequence(packed: PackedBatch, mask: torch.Tensor) -> np.ndarray:
    """How many positions of each sequence `mask` selects: int64 [S] on the host."""
    counts = torch.zeros(packed.num_seqs, dtype=torch.float32, device=mask.device)
    counts.index_add_(0, packed.seq_index, mask.float())
    return counts.round().long().cpu().numpy()


def _with_tokens(packed: PackedBatch, mask: torch.Tensor) -> np.ndarray:
    return np.flatnonzero(_per_sequence(packed, mask))


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(values[mask].sum()) / n if n else 0.0


# ------------------------------------------------------------------------------------ Trainer


class Trainer:
    """The learner's calls, over one backend: the RL and SFT steps, logprobs, and the backend's weights
    and checkpoints. `LearnerActor` makes these calls; the followers of a learner of several ranks
    replay them (actors.learner.ranks). `temperature` is the rollout temperature, the temperature of
    the behaviour logprobs (the engines' logprob convention)."""

    def __init__(self, backend: LearnerBackend, algo: AlgoConfig, *, temperature: float) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.backend, self.algo, self.temperature = backend, algo, temperature

    def train_step(self, batch: TrainBatch) -> StepResult:
        return rl_step(self.backend, batch, self.algo, temperature=self.temperature)

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> StepResult:
        return sft_step(self.backend, batch, lr)

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return policy_logprobs(self.backend, batch, temperature)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.backend.named_weights()

    def save_checkpoint(self, path: Path) -> None:
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: Path) -> None:
        self.backend.load_checkpoint(path)

    def export_hf(self, path: Path) -> None:
        self.backend.export_hf(path)
