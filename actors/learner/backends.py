"""Choose the learner backend named by `learner.backend`.

Each backend module is imported only when chosen: the megatron backend pulls in megatron-core, which
only GPU machines have. Every backend takes the same arguments.
"""

from __future__ import annotations

import torch

from actors.learner.backend import LearnerBackend
from configs import AlgoConfig, ConfigError, LearnerConfig, ModelConfig


def make_backend(model_cfg: ModelConfig, learner_cfg: LearnerConfig, algo_cfg: AlgoConfig, *,
                 temperature: float, device: str | torch.device) -> LearnerBackend:
    """The backend for `learner_cfg.backend`; `temperature` is the rollout temperature (the logprob
    convention), `device` the training device ('cpu', 'cuda', 'cuda:1')."""
    if learner_cfg.backend == "torch":
        from actors.learner.torch_backend import TorchBackend

        return TorchBackend(model_cfg, learner_cfg, algo_cfg, temperature=temperature, device=device)
    if learner_cfg.backend == "megatron":
        from actors.learner.megatron.backend import MegatronBackend

        return MegatronBackend(model_cfg, learner_cfg, algo_cfg, temperature=temperature, device=device)
    raise ConfigError(f"learner.backend: unknown backend {learner_cfg.backend!r} (choose 'torch' or 'megatron')")
