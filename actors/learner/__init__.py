"""The learner (DESIGN.md §7): losses, training backends, checkpoints and the weight push.

`losses` holds the backend-free loss functions (MirrorPop, decoupled PPO, SFT, KL); `backend` the
`LearnerBackend` interface; `backends.make_backend` picks an implementation (`torch_backend`,
`megatron`); `checkpoint` writes and finds a run's checkpoints.
"""

from actors.learner.backend import LearnerBackend, StepResult
from actors.learner.backends import make_backend
from actors.learner.checkpoint import CheckpointMeta, read_latest, write_checkpoint
from actors.learner.losses import PolicyStats, kl_penalty, mirrorpop_mask, policy_loss, sft_loss

__all__ = [
    "CheckpointMeta", "LearnerBackend", "PolicyStats", "StepResult", "kl_penalty", "make_backend",
    "mirrorpop_mask", "policy_loss", "read_latest", "sft_loss", "write_checkpoint",
]
