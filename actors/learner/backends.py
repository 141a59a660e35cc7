"""Choose the learner backend named by `learner.backend`, and bind it to the algorithm.

Each backend module is imported only when chosen: the megatron backend pulls in megatron-core, which
only GPU machines have. Every backend takes the same arguments.
"""

from __future__ import annotations

import torch

from actors.learner.algorithm import Trainer
from actors.learner.backend import LearnerBackend
from configs import AlgoConfig, ConfigError, LearnerConfig, ModelConfig


def make_backend(
    model_cfg: ModelConfig, learner_cfg: LearnerConfig, *, device: str | torch.device, reference: bool = False
) -> LearnerBackend:
    """The backend for `learner_cfg.backend` on `device` ('cpu', 'cuda', 'cuda:1'), with a frozen
    reference model when `reference` (a KL term needs one)."""
    if learner_cfg.torch_threads:  # the whole process's intra-op pool: in a Ray actor, this rank's own
        torch.set_num_threads(learner_cfg.torch_threads)
    if learner_cfg.backend == "torch":
        from actors.learner.torch_backend import TorchBackend

        return TorchBackend(model_cfg, learner_cfg, device=device, reference=reference)
    if learner_cfg.backend == "megatron":
        from actors.learner.megatron.backend import MegatronBackend

        return MegatronBackend(model_cfg, learner_cfg, device=device, reference=reference)
    raise ConfigError(f"learner.backend: unknown backend {learner_cfg.backend!r} (choose 'torch' or 'megatron')")


def make_trainer(
    model_cfg: ModelConfig,
    learner_cfg: LearnerConfig,
    algo_cfg: AlgoConfig,
    *,
    temperature: float,
    device: str | torch.device,
) -> Trainer:
    """The learner's steps over the chosen backend; `temperature` is the rollout temperature (the
    logprob convention)."""
    backend = make_backend(model_cfg, learner_cfg, device=device, reference=algo_cfg.kl_coef > 0)
    return Trainer(backend, algo_cfg, temperature=temperature)
