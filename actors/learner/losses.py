"""The learner's losses (DESIGN.md §7) as pure torch functions, shared by every learner backend.

No model, no config objects: tensors in, tensors (and plain-number statistics) out. Every per-token
tensor here is flat [N] and aligned: entry t holds the quantities of one predicted token — the policy
logprob log π_θ(y_t), the proximal logprob log π_prox(y_t) recomputed with the weights at the start of
the step, the behaviour logprob log μ(y_t) reported by the engine, the advantage, and the mask of
tokens that carry gradient. Losses are sums over masked tokens divided by a caller-given
`normalizer` (the gradient-carrying token count of the WHOLE batch), so summing the losses of
micro-batches gives the same gradient as one pass over the whole batch.

Decoupled PPO with MirrorPop:
  keep a sequence iff D = mean_t |log π_prox(y_t) - log μ(y_t)| <= δ;
  on kept tokens: -w_t · min(r_t·A, clip(r_t, 1-ε_low, 1+ε_high)·A),
  r_t = π_θ/π_prox, w_t = min(π_prox/μ, C) (a constant: no gradient flows through it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from actors.policy.sampling import token_logprobs


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 log softmax(logits / T) of `targets`: logits [N, V] predict targets [N]. The engines'
    logprob convention (actors.policy.sampling), so learner and engine numbers are comparable."""
    return token_logprobs(logits, targets, temperature)


def mirrorpop_mask(prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                   seq_index: torch.Tensor, num_seqs: int, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MirrorPop's per-sequence filter. Returns (keep bool [S], deviation float32 [S]).

    deviation D_s = mean over the sequence's gradient-carrying tokens of |log π_prox - log μ|; the
    absolute value is the point: a sequence whose drift is +x on one token and -x on the next has
    drifted, even though its signed mean is 0. keep_s iff D_s <= δ. A sequence without a single
    gradient-carrying token reports deviation 0 and is not kept (there is nothing to train on).
    `seq_index` (int64 [N]) names each token's sequence in [0, num_seqs).
    """
    mask = loss_mask.to(torch.float32)
    drift = (prox_logprobs.detach().float() - behaviour_logprobs.float()).abs() * mask
    sums = torch.zeros(num_seqs, dtype=torch.float32, device=drift.device).index_add_(0, seq_index, drift)
    counts = torch.zeros(num_seqs, dtype=torch.float32, device=drift.device).index_add_(0, seq_index, mask)
    deviation = torch.where(counts > 0, sums / counts.clamp_min(1.0), torch.zeros_like(sums))
    keep = (counts > 0) & (deviation <= delta)
    return keep, deviation


@dataclass
class PolicyStats:
    """Sums and counts behind the loss metrics; they add across micro-batches (`a + b`).

    The filter fields come from `filter_stats` (once per batch), the rest from `policy_loss` (per
    micro-batch, kept tokens only). ρ = π_prox/μ, the drift MirrorPop measures."""

    sequences: int = 0  # sequences with at least one gradient-carrying token
    kept_sequences: int = 0
    tokens: int = 0  # gradient-carrying tokens before MirrorPop
    abs_log_rho_sum: float = 0.0  # Σ |log ρ| over those tokens
    kept_tokens: int = 0  # gradient-carrying tokens MirrorPop kept
    kept_abs_log_rho_sum: float = 0.0
    clipped: int = 0  # kept tokens on which the clipped surrogate is the smaller one (no ratio gradient)
    is_weight_sum: float = 0.0
    is_weight_max: float = -math.inf
    is_weight_min: float = math.inf
    truncated: int = 0  # kept tokens whose importance weight hit the cap C

    def __add__(self, other: PolicyStats) -> PolicyStats:
        merged = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        merged["is_weight_max"] = max(self.is_weight_max, other.is_weight_max)
        merged["is_weight_min"] = min(self.is_weight_min, other.is_weight_min)
        return PolicyStats(**merged)

    def metrics(self) -> dict[str, float]:
        """The metrics stream's view: fractions and means (0 where nothing was counted)."""
        kept = max(self.kept_tokens, 1)
        return {
            "kept_fraction": self.kept_sequences / self.sequences if self.sequences else 0.0,
            "kept_token_fraction": self.kept_tokens / self.tokens if self.tokens else 0.0,
            "abs_log_rho_mean": self.abs_log_rho_sum / self.tokens if self.tokens else 0.0,
            "kept_abs_log_rho_mean": self.kept_abs_log_rho_sum / kept,
            "clip_fraction": self.clipped / kept,
            "is_weight_mean": self.is_weight_sum / kept,
            "is_weight_max": self.is_weight_max if self.kept_tokens else 0.0,
            "is_weight_min": self.is_weight_min if self.kept_tokens else 0.0,
            "is_truncated_fraction": self.truncated / kept,
        }


def filter_stats(prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                 keep: torch.Tensor, deviation: torch.Tensor, seq_index: torch.Tensor) -> PolicyStats:
    """The MirrorPop half of the statistics for a whole batch: sequences and tokens before and after
    filtering and Σ|log ρ| before filtering (the after-filter half comes from `policy_loss`)."""
    mask = loss_mask.bool()
    abs_log_rho = (prox_logprobs.detach().float() - behaviour_logprobs.float()).abs()
    has_tokens = torch.zeros_like(keep).index_fill_(0, seq_index[mask], True)
    return PolicyStats(sequences=int(has_tokens.sum()), kept_sequences=int(keep.sum()),
                       tokens=int(mask.sum()), abs_log_rho_sum=float(abs_log_rho[mask].sum()))


def policy_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                token_advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float, eps_high: float,
                is_cap: float, normalizer: float) -> tuple[torch.Tensor, PolicyStats]:
    """Decoupled, off-policy-corrected PPO loss over the masked tokens, divided by `normalizer`.

    r = exp(log π_θ - log π_prox) carries the gradient; w = min(exp(log π_prox - log μ), C) corrects
    for the engine having sampled from μ, is truncated at C = `is_cap` and is detached. `mask` must
    already exclude MirrorPop-dropped sequences. Returns (scalar loss, this slice's PolicyStats).
    """
    mask = mask.bool()
    prox = prox_logprobs.detach().float()
    log_rho = prox - behaviour_logprobs.float()
    ratio = torch.exp(logprobs.float() - prox)
    is_weight = torch.exp(log_rho).clamp(max=is_cap)
    adv = token_advantages.float()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -is_weight * torch.minimum(unclipped, clipped)
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / normalizer

    with torch.no_grad():
        w = is_weight[mask]
        stats = PolicyStats(
            kept_tokens=int(mask.sum()),
            kept_abs_log_rho_sum=float(log_rho[mask].abs().sum()),
            clipped=int((clipped < unclipped)[mask].sum()),
            is_weight_sum=float(w.sum()),
            is_weight_max=float(w.max()) if w.numel() else -math.inf,
            is_weight_min=float(w.min()) if w.numel() else math.inf,
            truncated=int((torch.exp(log_rho[mask]) >= is_cap).sum()),
        )
    return loss, stats


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Cross-entropy on the masked tokens: -Σ log π_θ(y_t) / normalizer (logprobs at T = 1)."""
    logprobs = logprobs.float()
    return -torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs)).sum() / normalizer


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
               normalizer: float) -> torch.Tensor:
    """The k3 estimator of KL(π_θ ‖ π_ref) on the masked tokens: Σ (e^x - x - 1) / normalizer with
    x = log π_ref - log π_θ; unbiased, always >= 0, and low-variance for small drifts."""
    x = ref_logprobs.detach().float() - logprobs.float()
    k3 = torch.exp(x) - x - 1.0
    return torch.where(mask.bool(), k3, torch.zeros_like(k3)).sum() / normalizer
