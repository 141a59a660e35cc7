"""The `torch` learner backend: the HF transformers model trained with plain torch (CPU or one GPU).

For tests and small runs. The model is the one the embedded engine serves (`build_model`), held in
fp32 master weights; on CUDA with `model.dtype = bfloat16` forward passes run under bf16 autocast.
The optimizer is AdamW. With a KL term the reference is a frozen copy of the initial model in the
engines' dtype. When torch.distributed is initialised (a learner of several ranks), every rank holds
a full replica and the ranks are data-parallel: each trains the micro-batches it is given and the
gradients are summed before the step (`actors.learner.data_parallel`), so the replicas stay equal;
rank 0 alone writes checkpoints and exports. Model code only: the RL and SFT steps are
`actors.learner.algorithm`'s.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from actors.learner.backend import LearnerBackend, LossFn, PolicyOutput
from actors.learner.batch import MicroBatch, PackedBatch, pack
from actors.learner.checkpoint import atomic_directory, load_rng, save_rng
from actors.learner.data_parallel import DataParallel
from actors.learner.losses import token_entropy, token_logprobs_from_logits
from actors.policy import packed_attention
from actors.policy.model import DTYPES, build_model
from configs import LearnerConfig, ModelConfig
from protocols import TrainBatch

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pkl"


class TorchBackend(LearnerBackend):
    def __init__(
        self,
        model_cfg: ModelConfig,
        learner_cfg: LearnerConfig,
        *,
        device: str | torch.device = "cpu",
        reference: bool = False,
        packed: bool = True,
    ):
        self.model_cfg, self.learner_cfg = model_cfg, learner_cfg
        self.micro_batch_tokens = learner_cfg.micro_batch_tokens
        self.device = torch.device(device)
        # packed: a micro-batch's sequences attend within themselves without a T x T mask
        # (actors/policy/packed_attention.py); False: transformers' sdpa and its block mask (the benchmark's
        # other side, launch/bench/learner_attention.py).
        attention = packed_attention.register() if packed else "sdpa"
        self.model = build_model(model_cfg, self.device, attention=attention).float().train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=learner_cfg.lr, weight_decay=learner_cfg.weight_decay
        )
        distributed = dist.is_available() and dist.is_initialized()
        self.dp = (
            DataParallel(dist.get_world_size(), dist.get_rank(), None, self.device)
            if distributed
            else DataParallel(1, 0)
        )
        # The initial policy, frozen, in the engines' dtype (the KL term's π_ref).
        self.reference = (
            build_model(model_cfg, self.device, attention=attention).requires_grad_(False) if reference else None
        )

    def pack(self, batch: TrainBatch) -> PackedBatch:
        return pack(batch, self.device, vocab_size=self.model.config.vocab_size, max_seq_len=self.model_cfg.max_seq_len)

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
        reports = []
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            for mb in micro_batches:
                loss, report = loss_fn(mb, self._forward(model, packed, mb.positions, temperature))
                if not forward_only:
                    loss.backward()
                reports.append(report)
        return reports

    def _forward(
        self, model: torch.nn.Module, packed: PackedBatch, positions: slice, temperature: float
    ) -> PolicyOutput:
        """One micro-batch's sequences as one packed row (position ids restart per sequence, no
        attention mask: see actors.learner.batch and actors.policy.packed_attention)."""
        with self._autocast():
            logits = model(
                input_ids=packed.tokens[positions][None],
                position_ids=packed.position_ids[positions][None],
                use_cache=False,
            ).logits[0]
        return PolicyOutput(
            logprobs=token_logprobs_from_logits(logits, packed.targets[positions], temperature),
            entropy_of=lambda: token_entropy(logits, temperature),
        )

    def _autocast(self):
        if self.device.type == "cuda" and self.model_cfg.dtype == "bfloat16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, lr: float | None = None) -> float:
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
            for g, old in zip(groups, saved, strict=True):
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
