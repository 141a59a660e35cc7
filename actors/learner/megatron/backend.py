"""The `megatron` learner backend: megatron-core GPTModel, TP x PP x DP, distributed optimizer (GPU only).

One instance per rank; under torchrun/Ray every rank constructs it and calls every method in step
(they are collectives). Every rank receives the same TrainBatch; the RL step hands each DP rank its
micro-batches, and the TP and PP ranks of one DP replica work on the same ones. Model code only: the
RL and SFT steps are `actors.learner.algorithm`'s.
  `forward_backward` runs megatron-core's own schedule (`get_forward_backward_func`: no pipelining
      with PP = 1, 1F1B across the stages otherwise): each micro-batch runs as one packed row, the
      last stage's vocab-parallel logits become logprobs (and, on demand, entropies) over the full
      vocabulary, and the caller's loss is backpropagated into megatron's fp32 grad buffers. The loss
      function runs on the last stage only; what it reports is broadcast to the other stages of the
      pipeline, so every rank returns the same reports. The loss arrives normalised already
      (calculate_per_token_loss), so DDP sums over DP rather than averaging;
  `step` reduce-scatters the grads over DP, sums the q/k-norm grads over TP and the two copies of a
      tied embedding over the first and last stage (finalize_model_grads), then the distributed
      optimizer clips the global grad norm, steps AdamW on its fp32 shard and all-gathers the
      updated weights.
Weights always come from an HF state dict (`model.path`, or the engines' seeded random init), so
learner and engines start identical; each stage loads the layers it holds. With a KL term a second,
frozen GPTModel holds those initial weights as the reference. `named_weights` gathers every tensor
from its TP group and broadcasts it from its stage, so every rank yields the whole model. Refused
with a ConfigError: float16. `learner.megatron` switches the fused kernels (model.Kernels).
Checkpoints are per rank: `rank-XXXXX.pt` holds the model shard, the optimizer's fp32 shard and
AdamW state, and the RNG state; they load into the same TP x PP x DP layout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.profiler import record_function

from actors.learner.backend import LearnerBackend, LossFn, PolicyOutput
from actors.learner.batch import MicroBatch, PackedBatch, pack
from actors.learner.batch import micro_batches as micro_batches_of
from actors.learner.checkpoint import atomic_directory, rng_state, set_rng_state
from actors.learner.data_parallel import DataParallel
from actors.learner.megatron import grad_clip
from actors.learner.megatron import hf_mapping as hm
from actors.learner.megatron.model import (
    Kernels,
    build_gpt,
    hf_tensors,
    load_hf_weights,
    packed_forward,
    rotary_tables,
    use_kernels,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from actors.learner.megatron.parallel import Layout, init_distributed, init_model_parallel
from actors.policy.model import DTYPES, build_model
from configs import ConfigError, LearnerConfig, ModelConfig
from protocols import TrainBatch

SAFETENSORS_FILE = "model.safetensors"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def data_parallel(gpt, *, overlap_grad_reduce: bool, bucket_size: int | None = None) -> DistributedDataParallel:
    """megatron's DDP over `gpt`: fp32 gradient buffers, reduce-scattered over DP for the distributed
    optimizer. With `overlap_grad_reduce` it splits them into buckets (`bucket_size` parameters; None:
    megatron's ~40M) and reduce-scatters each from a backward hook as soon as backward has filled it;
    the schedules hold the hooks back until a batch's last micro-batch through `no_sync_func`."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(gpt.config, ddp_config, gpt)
    if overlap_grad_reduce:
        gpt.config.no_sync_func = ddp.no_sync
    return ddp


def _zero_loss(mb: MicroBatch, out: PolicyOutput):
    """A loss of zero that reaches every weight: its backward fires every gradient hook."""
    return out.logprobs.sum() * 0.0, None


def _move(obj: Any, device: str | torch.device) -> Any:
    """`obj` with every tensor inside tuples, lists and dicts moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


class MegatronBackend(LearnerBackend):
    def __init__(
        self,
        model_cfg: ModelConfig,
        learner_cfg: LearnerConfig,
        *,
        device: str | torch.device = "cuda",
        reference: bool = False,
    ):
        if model_cfg.dtype == "float16":
            raise ConfigError("model.dtype: the megatron backend trains in bfloat16 or float32, not float16")
        self.model_cfg, self.learner_cfg = model_cfg, learner_cfg
        self.micro_batch_tokens = learner_cfg.micro_batch_tokens
        self.device = init_distributed(device)
        self.layout: Layout = init_model_parallel(
            learner_cfg.tensor_parallel, model_cfg.seed, learner_cfg.pipeline_parallel
        )
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp = DataParallel(self.layout.dp, self.layout.dp_rank, self.dp_group, self.device)

        hf_model = build_model(model_cfg, self.device)  # the engines' weights: checkpoint or seeded init
        self.hf_config = hf_model.config
        try:
            self.shape = hm.ModelShape.from_hf_config(self.hf_config, learner_cfg.tensor_parallel)
            hm.check_tp(self.shape, learner_cfg.tensor_parallel)
            self.stage = hm.stage(self.shape, self.layout.pp, self.layout.pp_rank)
            self.rope = rotary_tables(self.hf_config, self.shape)
        except ValueError as err:
            raise ConfigError(f"learner (megatron): {err}") from None
        k = learner_cfg.megatron
        self.kernels = Kernels(
            fused_logprobs=k.fused_logprobs,
            logprob_chunk_rows=k.logprob_chunk_rows,
            fused_swiglu=k.fused_swiglu,
            fused_rope=k.fused_rope,
            # megatron's fused branch allocates on the current CUDA device
            fused_grad_accumulation=k.fused_grad_accumulation and self.device.type == "cuda",
            fused_grad_clip=k.fused_grad_clip,
            compile=self.device.type == "cuda",
        )
        self.gpt = self._build_gpt(hf_model.state_dict())
        self.reference = None
        if reference:  # the initial policy, frozen: the KL term's π_ref
            self.reference = self._build_gpt(hf_model.state_dict()).requires_grad_(False).eval()
        del hf_model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the full HF copy is gone; give its blocks back before the optimizer

        self.overlap_grad_reduce = k.overlap_grad_reduce and self.layout.dp > 1
        self.model = data_parallel(self.gpt, overlap_grad_reduce=self.overlap_grad_reduce)
        self._backward_ran = False  # since zero_grad: whether backward issued the buckets' reductions
        bf16 = model_cfg.dtype == "bfloat16"
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=learner_cfg.lr,
                min_lr=learner_cfg.lr,
                weight_decay=learner_cfg.weight_decay,
                bf16=bf16,
                params_dtype=DTYPES[model_cfg.dtype],
                use_distributed_optimizer=True,
                clip_grad=learner_cfg.grad_clip,
            ),
            [self.model],
        )  # a ChainedOptimizer: it reports the global grad norm even when clip_grad = 0
        for inner in self._torch_optimizers():
            # Without apex/TE megatron builds torch AdamW with default (foreach) kernels: ~3x the time of
            # the fused one on the fp32 shard (30 ms vs ~10 ms per step for 1.1B parameters on an H100).
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, self.device.type == "cuda"

    def _build_gpt(self, hf_state: dict[str, torch.Tensor]):
        gpt = build_gpt(
            self.hf_config,
            self.shape,
            tensor_parallel=self.learner_cfg.tensor_parallel,
            dtype=self.model_cfg.dtype,
            max_seq_len=self.model_cfg.max_seq_len,
            stage=self.stage,
        )
        load_hf_weights(gpt, hf_state, self.shape)
        return gpt

    # ---------------------------------------------------------------------------- the interface

    # The step's phases carry `kiln.*` profiler ranges, which `launch.bench.gpu_megatron --profile` reads
    # to say where the GPU sat idle (launch/bench/trace_gaps.py); outside a profile a range costs ~µs.

    def pack(self, batch: TrainBatch) -> PackedBatch:
        with record_function("kiln.pack"):
            return pack(batch, self.device, vocab_size=self.shape.vocab_size, max_seq_len=self.model_cfg.max_seq_len)

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
        model = self.model
        if reference:
            if self.reference is None:
                raise RuntimeError("no reference model: the backend builds one only for a KL term (algo.kl_coef > 0)")
            model, forward_only = self.reference, True
        idle = not micro_batches and not forward_only and self.overlap_grad_reduce
        if idle:
            # The buckets' reduce-scatters are issued from backward hooks, in the order backward fills
            # the buckets, and NCCL pairs collectives by their order: a replica with no share of this
            # batch issues the same ones by running a backward too, on the batch's first micro-batch
            # with its loss times zero (zero gradients; nothing of it is reported).
            micro_batches, loss_fn = micro_batches_of(packed.cu_seqlens, self.micro_batch_tokens)[:1], _zero_loss
        if not micro_batches:  # this DP replica has no share; megatron's schedule needs at least one
            return []
        model.train(not forward_only)
        kernels, vocab = self.kernels, self.shape.vocab_size
        use_kernels(self.gpt, kernels)
        if self.reference is not None:
            use_kernels(self.reference, kernels)

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            logits = output[0]  # [t, V/tp]: one packed row
            out = PolicyOutput(
                logprobs=vocab_parallel_logprobs(logits, packed.targets[mb.positions], temperature, vocab, kernels),
                entropy_of=lambda: vocab_parallel_entropy(logits, temperature, vocab, kernels),
            )
            loss, report = loss_fn(mb, out)
            if loss is None:
                loss = torch.zeros((), dtype=torch.float32, device=logits.device)
            # (loss, token count, report): megatron reads the count only to divide the gradients by it when a
            # finalize_model_grads_func is configured, which this backend does not do (the loss is normalised).
            return loss, torch.tensor(mb.stop - mb.start, dtype=torch.int, device=logits.device), report

        def forward_step(data: Iterator[MicroBatch], module):
            mb = next(data)
            p = mb.positions
            bounds = [int(b) - mb.start for b in packed.cu_seqlens[mb.first_seq : mb.end_seq + 1]]
            output = packed_forward(
                module,
                packed.tokens[p],
                packed.position_ids[p],
                bounds,
                self.rope,
                fused_rope=kernels.fused_rope and kernels.compile,
            )
            return output, lambda out: loss_func(mb, out)

        schedule = get_forward_backward_func()
        phase = "kiln.forward" if forward_only else "kiln.forward_backward"
        with torch.no_grad() if forward_only else contextlib.nullcontext(), record_function(phase):
            reports = schedule(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=model,
                num_microbatches=len(micro_batches),
                seq_length=max(mb.stop - mb.start for mb in micro_batches),
                micro_batch_size=1,
                forward_only=forward_only,
            )
        self._backward_ran = self._backward_ran or not forward_only
        reports = self._from_last_stage(reports)
        return [] if idle else reports

    def _from_last_stage(self, reports: list[Any]) -> list[Any]:
        """The loss function ran on the last pipeline stage only: its reports, on every stage (tensors
        travel through the host, so no rank ever touches another rank's GPU)."""
        if self.layout.pp == 1:
            return reports
        group = parallel_state.get_pipeline_model_parallel_group()
        payload = [_move(reports, "cpu") if self.stage.post_process else None]
        dist.broadcast_object_list(
            payload, src=dist.get_process_group_ranks(group)[-1], group=group, device=self.device
        )
        return reports if self.stage.post_process else _move(payload[0], self.device)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._backward_ran = False

    def reduce_gradients(self) -> None:
        """The step's first half: the reduce-scatter of the fp32 grad buffers over DP (waited for, when
        backward issued it bucket by bucket), then the sum over TP of the q/k-norm grads (each TP rank
        normalises only its own heads, so those grads are partial)."""
        with record_function("kiln.grad_reduce"):
            if self.overlap_grad_reduce and not self._backward_ran:
                # No backward ran since zero_grad (an empty batch: on every replica alike), so none issued
                # the buckets' reductions; issue them here.
                self.model.start_grad_sync()
            finalize_model_grads([self.model])

    def step(self, lr: float | None = None) -> float:
        self.reduce_gradients()
        groups = [g for o in self._torch_optimizers() for g in o.param_groups]
        saved = [g["lr"] for g in groups]
        if lr is not None:
            for g in groups:
                g["lr"] = lr
        grad_clip.switch(self.kernels.fused_grad_clip)  # megatron reads it from its module globals
        try:
            with record_function("kiln.optimizer"):
                ok, grad_norm, _ = self.optimizer.step()
        finally:
            for g, old in zip(groups, saved, strict=True):
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
        """HF-named full tensors of the whole model in the engines' dtype. Every rank must iterate in
        step (each tensor is an all-gather within its stage's TP group and, with PP > 1, a broadcast
        from that stage); every rank gets every tensor. With tied embeddings only
        model.embed_tokens.weight is sent (lm_head shares its storage in the engines)."""
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
            "layout": (self.layout.tp, self.layout.pp, self.layout.dp),
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
        layout = (self.layout.tp, self.layout.pp, self.layout.dp)
        if tuple(state["layout"]) != layout:
            raise ValueError(
                f"checkpoint was written with (tp, pp, dp) = {tuple(state['layout'])}, this job is {layout}"
            )
        self.gpt.load_state_dict(state["model"])
        inner = self._torch_optimizers()
        mains = [[p for g in o.param_groups for p in g["params"]] for o in inner]
        if [len(m) for m in mains] != [len(m) for m in state["main_params"]]:
            raise ValueError("checkpoint optimizer shards do not match this model")
        with torch.no_grad():
            for params, saved in zip(mains, state["main_params"], strict=True):
                for p, value in zip(params, saved, strict=True):
                    p.copy_(value)
        for o, saved in zip(inner, state["optimizers"], strict=True):
            o.load_state_dict(saved)
        set_rng_state(state["rng"])
        dist.barrier()
