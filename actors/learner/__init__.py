"""The learner (docs/training.md): losses, the RL and SFT steps, training backends, checkpoints and the
weight push.

`losses` holds the backend-free loss functions (MirrorPop, decoupled PPO, SFT, KL); `algorithm` the
RL step (π_prox, MirrorPop, mini-batch updates, metrics) and the SFT step, written once over the
`LearnerBackend` interface of `backend`, and `Trainer`, which binds them to one backend;
`backends.make_trainer` picks an implementation (`torch_backend`, `megatron`); `checkpoint` writes
and finds a run's checkpoints.
"""

from actors.learner.algorithm import StepResult, Trainer, rl_step, sft_step
from actors.learner.backend import LearnerBackend
from actors.learner.backends import make_backend, make_trainer
from actors.learner.checkpoint import CheckpointMeta, read_latest, write_checkpoint
from actors.learner.losses import kl_penalty, mirrorpop_mask, policy_loss, sft_loss

__all__ = [
    "CheckpointMeta",
    "LearnerBackend",
    "StepResult",
    "Trainer",
    "kl_penalty",
    "make_backend",
    "make_trainer",
    "mirrorpop_mask",
    "policy_loss",
    "read_latest",
    "rl_step",
    "sft_loss",
    "sft_step",
    "write_checkpoint",
]
