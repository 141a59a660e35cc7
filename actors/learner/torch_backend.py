"""The `torch` learner backend: the HF transformers model trained with plain torch (CPU or one GPU).

For tests and small runs. The model is the one the embedded engine serves (`build_model`), held in
fp32 master weights; on CUDA with `model.dtype = bfloat16` forward passes run under bf16 autocast.
When torch.distributed is initialised (a learner of several ranks), every rank holds a full replica
and the ranks are data-parallel: each trains its share of the batch's micro-batches and the
gradients are summed before the step (`actors.learner.data_parallel`), so the replicas stay equal;
rank 0 alone writes checkpoints and exports.
One `train_step` (DESIGN.md §7):
  (a) a no-grad pass over every micro-batch recomputes log π_prox with the weights of this step;
  (b) MirrorPop drops the sequences that drifted from μ by more than δ;
  (c) a gradient pass accumulates `policy_loss` (plus a k3 KL term against a frozen copy of the
      initial model when algo.kl_coef > 0) over micro-batches, each normalised by the kept token
      count of the whole batch;
  (d) the global gradient norm is clipped and AdamW steps.
A batch in which MirrorPop keeps nothing takes no optimizer step (AdamW would still move the weights
through its momentum and weight decay). Logprobs follow the engines' convention at the rollout
temperature, which the constructor takes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from actors.learner.backend import LearnerBackend, StepResult, sft_step_over
from actors.learner.batch import MicroBatch, PackedBatch, micro_batches, pack
from actors.learner.checkpoint import atomic_directory, load_rng, save_rng
from actors.learner.data_parallel import DataParallel, assign_micro_batches, owned_positions
from actors.learner.losses import (
    filter_stats,
    kl_penalty,
    mirrorpop_mask,
    policy_loss,
    token_logprobs_from_logits,
)
from actors.policy.model import DTYPES, build_model
from configs import AlgoConfig, LearnerConfig, ModelConfig
from protocols import TrainBatch

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pkl"


class TorchBackend(LearnerBackend):
    def __init__(self, model_cfg: ModelConfig, learner_cfg: LearnerConfig, algo_cfg: AlgoConfig, *,
                 temperature: float = 1.0, device: str | torch.device = "cpu"):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model_cfg, self.learner_cfg, self.algo_cfg = model_cfg, learner_cfg, algo_cfg
        self.temperature = temperature
        self.device = torch.device(device)
        self.model = build_model(model_cfg, self.device).float().train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learner_cfg.lr,
                                           weight_decay=learner_cfg.weight_decay)
        distributed = dist.is_available() and dist.is_initialized()
        self.dp = (DataParallel(dist.get_world_size(), dist.get_rank(), None, self.device) if distributed
                   else DataParallel(1, 0))
        self.reference = None
        if algo_cfg.kl_coef > 0:  # the initial policy, frozen, in the engines' dtype
            self.reference = build_model(model_cfg, self.device).requires_grad_(False)

    # ------------------------------------------------------------------------------- steps

    def train_step(self, batch: TrainBatch) -> StepResult:
        start = time.perf_counter()
        algo = self.algo_cfg
        packed = self._pack(batch)
        micros = self._my_micro_batches(packed)
        prox = self._predicted_logprobs(self.model, packed, micros, self.temperature)
        ref = self._predicted_logprobs(self.reference, packed, micros, self.temperature) if self.reference else None
        grad_mask = packed.grad_mask & owned_positions(packed.num_tokens, micros, self.device)
        keep, deviation = mirrorpop_mask(prox, packed.behaviour_logprobs, grad_mask, packed.seq_index,
                                         packed.num_seqs, algo.mirrorpop_delta)
        kept_mask = grad_mask & keep[packed.seq_index]
        stats = filter_stats(prox, packed.behaviour_logprobs, grad_mask, keep, deviation, packed.seq_index)
        normalizer = self.dp.sum(float(kept_mask.sum()))  # the whole batch's, on every rank

        self.optimizer.zero_grad(set_to_none=True)
        loss_total, kl_total = 0.0, 0.0
        for mb in micros if normalizer > 0 else []:
            p = mb.positions
            if not bool(kept_mask[p].any()):
                continue
            logprobs = self._micro_logprobs(self.model, packed, mb.positions, self.temperature)
            loss, mb_stats = policy_loss(logprobs, prox[p], packed.behaviour_logprobs[p], packed.advantages[p],
                                         kept_mask[p], eps_low=algo.eps_low, eps_high=algo.eps_high,
                                         is_cap=algo.is_cap, normalizer=normalizer)
            if ref is not None:
                kl = kl_penalty(logprobs, ref[p], kept_mask[p], normalizer)
                kl_total += float(kl.detach())
                loss = loss + algo.kl_coef * kl
            loss.backward()
            loss_total += float(loss.detach())
            stats = stats + mb_stats
        grad_norm = self._clip_and_step() if normalizer > 0 else 0.0

        metrics = self.dp.stats(stats).metrics()
        metrics["deviation_mean"] = self.dp.sum(float(deviation.sum())) / max(packed.num_seqs, 1)
        metrics["skipped"] = float(normalizer == 0)
        if ref is not None:
            metrics["kl"] = self.dp.sum(kl_total)
        return StepResult(loss=self.dp.sum(loss_total), grad_norm=grad_norm, tokens=packed.num_tokens,
                          trained_tokens=int(normalizer), seconds=time.perf_counter() - start, metrics=metrics)

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> StepResult:
        started = time.perf_counter()
        packed = self._pack(batch)
        self.optimizer.zero_grad(set_to_none=True)
        return sft_step_over(packed, self._my_micro_batches(packed),
                             lambda mb: self._micro_logprobs(self.model, packed, mb.positions, 1.0),
                             lambda: self._clip_and_step(lr), self.dp, started)

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        packed = self._pack(batch)
        predicted = self._predicted_logprobs(self.model, packed, self._my_micro_batches(packed), temperature)
        self.dp.sum_tensor(predicted)  # each position was computed by exactly one rank, zeros elsewhere
        return packed.to_token_aligned(predicted).cpu()

    # ------------------------------------------------------------------------------ forward

    def _pack(self, batch: TrainBatch) -> PackedBatch:
        return pack(batch, self.device, vocab_size=self.model.config.vocab_size,
                    max_seq_len=self.model_cfg.max_seq_len)

    def _my_micro_batches(self, packed: PackedBatch) -> list[MicroBatch]:
        micros = micro_batches(packed.cu_seqlens, self.learner_cfg.micro_batch_tokens)
        return assign_micro_batches(micros, self.dp.size, self.dp.rank)

    def _autocast(self):
        if self.device.type == "cuda" and self.model_cfg.dtype == "bfloat16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _micro_logprobs(self, model: torch.nn.Module, packed: PackedBatch, positions: slice,
                        temperature: float) -> torch.Tensor:
        """Position-aligned logprobs of the targets of one micro-batch: its sequences run as one packed
        row (position ids restart per sequence, no attention mask: see actors.learner.batch)."""
        with self._autocast():
            out = model(input_ids=packed.tokens[positions][None], position_ids=packed.position_ids[positions][None],
                        use_cache=False)
        return token_logprobs_from_logits(out.logits[0], packed.targets[positions], temperature)

    @torch.no_grad()
    def _predicted_logprobs(self, model: torch.nn.Module, packed: PackedBatch, micros: list[MicroBatch],
                            temperature: float) -> torch.Tensor:
        """Position-aligned logprobs of every target, micro-batch by micro-batch, without gradient."""
        out = torch.zeros(packed.num_tokens, dtype=torch.float32, device=self.device)
        for mb in micros:
            out[mb.positions] = self._micro_logprobs(model, packed, mb.positions, temperature)
        return out

    def _clip_and_step(self, lr: float | None = None) -> float:
        """Clip the global gradient norm (returns it, before clipping) and step, at `lr` for this
        step only when given."""
        self.dp.sum_gradients(list(self.model.parameters()))
        clip = self.learner_cfg.grad_clip if self.learner_cfg.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        if lr is not None:
            for g in groups:
                g["lr"] = lr
        try:
            self.optimizer.step()
        finally:
            for g, old in zip(groups, saved):
                g["lr"] = old
        return grad_norm

    # ------------------------------------------------------------------------------ weights

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine model's state_dict names (tied embeddings included under both names, as the
        engine's state_dict lists them), in the engines' dtype."""
        dtype = DTYPES[self.model_cfg.dtype]
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach().to(dtype)

    def export_hf(self, path: Path) -> None:
        if self.dp.rank:  # the replicas are equal: rank 0 writes
            return
        state = dict(self.named_weights())
        config = copy.deepcopy(self.model.config)
        config.dtype = DTYPES[self.model_cfg.dtype]  # the tensors' dtype, not the fp32 master copy's
        with atomic_directory(Path(path)) as staging:
            self.model.save_pretrained(staging, state_dict=state)
            config.save_pretrained(staging)  # replaces the config.json written above

    def save_checkpoint(self, path: Path) -> None:
        if self.dp.rank:
            return
        with atomic_directory(Path(path)) as staging:
            torch.save(self.model.state_dict(), staging / MODEL_FILE)
            torch.save(self.optimizer.state_dict(), staging / OPTIMIZER_FILE)
            save_rng(staging / RNG_FILE)

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        self.model.load_state_dict(torch.load(path / MODEL_FILE, map_location=self.device, weights_only=True))
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True))
        load_rng(path / RNG_FILE)
