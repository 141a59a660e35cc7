"""The `megatron` learner backend: megatron-core GPTModel, TP x DP, distributed optimizer (GPU only).

One instance per rank; under torchrun/Ray every rank constructs it and calls every method in step
(they are collectives). Every rank receives the same TrainBatch; its micro-batches are split over DP
ranks by `assign_micro_batches`, TP ranks of one DP group work on the same ones. One `train_step`
(DESIGN.md §7), as the torch backend's but distributed:
  (a) a no-grad pass over this rank's micro-batches recomputes log π_prox;
  (b) MirrorPop on this rank's sequences (whole sequences never straddle micro-batches); kept-token
      counts and statistics are summed over DP, so the normalizer is the whole batch's;
  (c) policy_loss per micro-batch, backward into megatron's fp32 grad buffers; DDP sums (not
      averages) over DP because the loss is already globally normalised (calculate_per_token_loss),
      and megatron's finalize_model_grads sums the q/k-norm grads over TP;
  (d) the distributed optimizer clips the global grad norm, steps AdamW on its fp32 shard and
      all-gathers the updated bf16 weights.
Weights always come from an HF state dict (`model.path`, or the engines' seeded random init), so
learner and engines start identical. Refused with a ConfigError: pipeline parallelism, float16, and
a KL term (algo.kl_coef > 0: no reference-model pass here yet).
Checkpoints are per rank: `rank-XXXXX.pt` holds the model shard, the optimizer's fp32 shard and
AdamW state, and the RNG state; they load into the same TP x DP layout.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from actors.learner.backend import LearnerBackend, StepResult, sft_step_over
from actors.learner.batch import MicroBatch, PackedBatch, micro_batches, pack
from actors.learner.checkpoint import atomic_directory, rng_state, set_rng_state
from actors.learner.data_parallel import DataParallel, assign_micro_batches, owned_positions
from actors.learner.losses import filter_stats, mirrorpop_mask, policy_loss
from actors.learner.megatron import hf_mapping as hm
from actors.learner.megatron.model import (
    build_gpt,
    hf_tensors,
    load_hf_weights,
    packed_forward,
    rotary_tables,
    vocab_parallel_logprobs,
)
from actors.learner.megatron.parallel import Layout, init_distributed, init_model_parallel
from actors.policy.model import DTYPES, build_model
from configs import AlgoConfig, ConfigError, LearnerConfig, ModelConfig
from protocols import TrainBatch

SAFETENSORS_FILE = "model.safetensors"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


class MegatronBackend(LearnerBackend):
    def __init__(self, model_cfg: ModelConfig, learner_cfg: LearnerConfig, algo_cfg: AlgoConfig, *,
                 temperature: float = 1.0, device: str | torch.device = "cuda"):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if learner_cfg.pipeline_parallel != 1:
            raise ConfigError("learner.pipeline_parallel: the megatron backend supports only 1 (TP x DP); "
                              f"got {learner_cfg.pipeline_parallel}")
        if model_cfg.dtype == "float16":
            raise ConfigError("model.dtype: the megatron backend trains in bfloat16 or float32, not float16")
        if algo_cfg.kl_coef > 0:
            raise ConfigError("algo.kl_coef: the megatron backend has no reference-model pass; use 0 "
                              "or learner.backend=torch")
        self.model_cfg, self.learner_cfg, self.algo_cfg = model_cfg, learner_cfg, algo_cfg
        self.temperature = temperature
        self.device = init_distributed(device)
        self.layout: Layout = init_model_parallel(learner_cfg.tensor_parallel, model_cfg.seed)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp = DataParallel(self.layout.dp, self.layout.dp_rank, self.dp_group, self.device)

        hf_model = build_model(model_cfg, self.device)  # the engines' weights: checkpoint or seeded init
        self.hf_config = hf_model.config
        try:
            self.shape = hm.ModelShape.from_hf_config(self.hf_config, learner_cfg.tensor_parallel)
            hm.check_tp(self.shape, learner_cfg.tensor_parallel)
            self.rope = rotary_tables(self.hf_config, self.shape)
        except ValueError as err:
            raise ConfigError(f"learner (megatron): {err}") from None
        self.gpt = build_gpt(self.hf_config, self.shape, tensor_parallel=learner_cfg.tensor_parallel,
                             dtype=model_cfg.dtype, max_seq_len=model_cfg.max_seq_len)
        load_hf_weights(self.gpt, hf_model.state_dict(), self.shape)
        del hf_model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the full HF copy is gone; give its blocks back before the optimizer

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.model = DistributedDataParallel(self.gpt.config, ddp_config, self.gpt)
        bf16 = model_cfg.dtype == "bfloat16"
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=learner_cfg.lr, min_lr=learner_cfg.lr,
                            weight_decay=learner_cfg.weight_decay, bf16=bf16, params_dtype=DTYPES[model_cfg.dtype],
                            use_distributed_optimizer=True, clip_grad=learner_cfg.grad_clip),
            [self.model])  # a ChainedOptimizer: it reports the global grad norm even when clip_grad = 0
        for inner in self._torch_optimizers():
            # Without apex/TE megatron builds torch AdamW with default (foreach) kernels: ~3x the time of
            # the fused one on the fp32 shard (30 ms vs ~10 ms per step for 1.1B parameters on an H100).
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, self.device.type == "cuda"

    # ------------------------------------------------------------------------------- steps

    def train_step(self, batch: TrainBatch) -> StepResult:
        start = time.perf_counter()
        algo = self.algo_cfg
        packed = self._pack(batch)
        mine = self._my_micro_batches(packed)
        own = owned_positions(packed.num_tokens, mine, self.device)
        self.model.eval()
        prox = self._predicted_logprobs(packed, mine, self.temperature)
        grad_mask = packed.grad_mask & own
        keep, deviation = mirrorpop_mask(prox, packed.behaviour_logprobs, grad_mask, packed.seq_index,
                                         packed.num_seqs, algo.mirrorpop_delta)
        kept_mask = grad_mask & keep[packed.seq_index]
        stats = filter_stats(prox, packed.behaviour_logprobs, grad_mask, keep, deviation, packed.seq_index)
        normalizer = self.dp.sum(float(kept_mask.sum()))

        self._zero_grad()
        self.model.train()
        loss_total = 0.0
        for mb in mine if normalizer > 0 else []:
            p = mb.positions
            if not bool(kept_mask[p].any()):
                continue
            logprobs = self._micro_logprobs(packed, mb, self.temperature)
            loss, mb_stats = policy_loss(logprobs, prox[p], packed.behaviour_logprobs[p], packed.advantages[p],
                                         kept_mask[p], eps_low=algo.eps_low, eps_high=algo.eps_high,
                                         is_cap=algo.is_cap, normalizer=normalizer)
            loss.backward()
            loss_total += float(loss.detach())
            stats = stats + mb_stats
        grad_norm = self._sync_and_step() if normalizer > 0 else 0.0

        stats = self.dp.stats(stats)
        metrics = stats.metrics()
        metrics["deviation_mean"] = self.dp.sum(float(deviation.sum())) / max(packed.num_seqs, 1)
        metrics["skipped"] = float(normalizer == 0)
        return StepResult(loss=self.dp.sum(loss_total), grad_norm=grad_norm, tokens=packed.num_tokens,
                          trained_tokens=int(normalizer), seconds=time.perf_counter() - start, metrics=metrics)

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> StepResult:
        started = time.perf_counter()
        packed = self._pack(batch)
        self._zero_grad()
        self.model.train()
        return sft_step_over(packed, self._my_micro_batches(packed), lambda mb: self._micro_logprobs(packed, mb, 1.0),
                             lambda: self._sync_and_step(lr), self.dp, started)

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        packed = self._pack(batch)
        self.model.eval()
        predicted = self._predicted_logprobs(packed, self._my_micro_batches(packed), temperature)
        self.dp.sum_tensor(predicted)  # each position was computed by exactly one DP rank, zeros elsewhere
        return packed.to_token_aligned(predicted).cpu()

    # ------------------------------------------------------------------------------ forward

    def _pack(self, batch: TrainBatch) -> PackedBatch:
        return pack(batch, self.device, vocab_size=self.shape.vocab_size, max_seq_len=self.model_cfg.max_seq_len)

    def _my_micro_batches(self, packed: PackedBatch) -> list[MicroBatch]:
        micros = micro_batches(packed.cu_seqlens, self.learner_cfg.micro_batch_tokens)
        return assign_micro_batches(micros, self.layout.dp, self.layout.dp_rank)

    def _micro_logprobs(self, packed: PackedBatch, mb: MicroBatch, temperature: float) -> torch.Tensor:
        """Position-aligned logprobs of one micro-batch's targets (its sequences as one packed row)."""
        p = mb.positions
        bounds = [int(b) - mb.start for b in packed.cu_seqlens[mb.first_seq:mb.end_seq + 1]]
        logits = packed_forward(self.model, packed.tokens[p], packed.position_ids[p], bounds, self.rope)
        return vocab_parallel_logprobs(logits, packed.targets[p], temperature, self.shape.vocab_size)

    @torch.no_grad()
    def _predicted_logprobs(self, packed: PackedBatch, mine: list[MicroBatch], temperature: float) -> torch.Tensor:
        out = torch.zeros(packed.num_tokens, dtype=torch.float32, device=self.device)
        for mb in mine:
            out[mb.positions] = self._micro_logprobs(packed, mb, temperature)
        return out

    def _zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _sync_and_step(self, lr: float | None = None) -> float:
        """Reduce the gradients and step (at `lr` for this step only when given); the grad norm."""
        # Reduce-scatter of the fp32 grad buffers over DP, then the sum over TP of the q/k-norm grads
        # (each TP rank normalises only its own heads, so those grads are partial).
        finalize_model_grads([self.model])
        groups = [g for o in self._torch_optimizers() for g in o.param_groups]
        saved = [g["lr"] for g in groups]
        if lr is not None:
            for g in groups:
                g["lr"] = lr
        try:
            ok, grad_norm, _ = self.optimizer.step()
        finally:
            for g, old in zip(groups, saved):
                g["lr"] = old
        if not ok:
            raise RuntimeError("megatron optimizer step failed (non-finite gradients)")
        return float(grad_norm) if grad_norm is not None else 0.0

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch AdamW instances over this rank's fp32 shards (megatron chains one per group of
        parameter buffers); their params are the fp32 main weights."""
        return [o.optimizer for o in self.optimizer.chained_optimizers]

    # ------------------------------------------------------------------------------ weights

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors in the engines' dtype. Every rank of the TP group must iterate in step
        (each tensor is an all-gather); every one of them gets the full tensors. With tied embeddings
        only model.embed_tokens.weight is sent (lm_head shares its storage in the engines)."""
        dtype = DTYPES[self.model_cfg.dtype]
        for name, tensor in hf_tensors(self.gpt, self.shape):
            yield name, tensor.to(dtype)

    def export_hf(self, path: Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.named_weights()}
        if self.layout.rank == 0:
            with atomic_directory(path) as staging:
                save_file(state, str(staging / SAFETENSORS_FILE), metadata={"format": "pt"})
                self.hf_config.save_pretrained(staging)
        dist.barrier()

    def save_checkpoint(self, path: Path) -> None:
        path = Path(path)
        staging = path.parent / f".staging-{path.name}"
        if self.layout.rank == 0:
            if path.exists():
                raise FileExistsError(f"{path} already exists")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()
        inner = self._torch_optimizers()
        state = {
            "layout": (self.layout.tp, self.layout.dp),
            "model": self.gpt.state_dict(),
            "main_params": [[p.detach().clone() for g in o.param_groups for p in g["params"]] for o in inner],
            "optimizers": [o.state_dict() for o in inner],
            "rng": rng_state(),
        }
        torch.save(state, staging / _rank_file(self.layout.rank))
        with open(staging / _rank_file(self.layout.rank), "rb") as fh:
            os.fsync(fh.fileno())
        dist.barrier()
        if self.layout.rank == 0:
            os.rename(staging, path)
        dist.barrier()

    def load_checkpoint(self, path: Path) -> None:
        # CPU first: the RNG states must stay CPU ByteTensors; weights are copied onto the GPU below.
        state = torch.load(Path(path) / _rank_file(self.layout.rank), map_location="cpu", weights_only=False)
        if tuple(state["layout"]) != (self.layout.tp, self.layout.dp):
            raise ValueError(f"checkpoint was written with (tp, dp) = {tuple(state['layout'])}, "
                             f"this job is {(self.layout.tp, self.layout.dp)}")
        self.gpt.load_state_dict(state["model"])
        inner = self._torch_optimizers()
        mains = [[p for g in o.param_groups for p in g["params"]] for o in inner]
        if [len(m) for m in mains] != [len(m) for m in state["main_params"]]:
            raise ValueError("checkpoint optimizer shards do not match this model")
        with torch.no_grad():
            for params, saved in zip(mains, state["main_params"]):
                for p, value in zip(params, saved):
                    p.copy_(value)
        for o, saved in zip(inner, state["optimizers"]):
            o.load_state_dict(saved)
        set_rng_state(state["rng"])
        dist.barrier()
