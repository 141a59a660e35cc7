"""The learner's losses (docs/training.md) as pure torch functions, shared by every learner backend.

No model, no config objects: tensors in, tensors (and plain-number statistics) out. Every per-token
tensor here is flat [N] and aligned: entry t holds the quantities of one predicted token — the policy
logprob log π_θ(y_t), the proximal logprob log π_prox(y_t) recomputed with the weights before the
batch's first update, the behaviour logprob log μ(y_t) reported by the engine, the advantage, and the mask of
tokens that carry gradient. Losses are sums over masked tokens divided by a caller-given
`normalizer` (the kept-token count of the whole mini-batch an update trains on, over every
micro-batch and data-parallel rank), so summing the losses of micro-batches gives the same gradient
as one pass over the mini-batch.

Decoupled PPO with MirrorPop:
  keep a sequence iff D = mean_t |log π_prox(y_t) - log μ(y_t)| <= δ (the paper's filter);
  keep a token of a kept sequence iff its own |log π_prox(y_t) - log μ(y_t)| <= δ_tok (Kiln's bound:
  a mean over thousands of tokens hides a few far-off ones);
  on kept tokens: -w_t · min(r_t·A, clip(r_t, 1-ε_low, 1+ε_high)·A),
  r_t = π_θ/π_prox, w_t = min(π_prox/μ, C) (a constant: no gradient flows through it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from actors.policy.sampling import token_logprobs


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 log softmax(logits / T) of `targets`: logits [N, V] predict targets [N]. The engines'
    logprob convention (actors.policy.sampling), so learner and engine numbers are comparable."""
    return token_logprobs(logits, targets, temperature)


ENTROPY_ROWS = 1024  # rows per chunk: float32 copies of a whole long micro-batch's logits would be GBs


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 entropy of softmax(logits / T) at every position: logits [N, V] -> [N]. A metric (how
    sure the policy is where it sampled), so it carries no gradient; computed in row chunks."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], ENTROPY_ROWS):
        logp = torch.log_softmax(logits[start : start + ENTROPY_ROWS].float() / temperature, dim=-1)
        out[start : start + ENTROPY_ROWS] = -(logp.exp() * logp).sum(-1)
    return out


def mirrorpop_mask(
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    *,
    delta: float | None,
    token_delta: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MirrorPop's filter. Returns (keep bool [S], kept bool [N], deviation float32 [S]).

    deviation D_s = mean over the sequence's gradient-carrying tokens of |log π_prox - log μ|; the
    absolute value is the point: a sequence whose drift is +x on one token and -x on the next has
    drifted, even though its signed mean is 0. The sequence filter (the paper's) drops a sequence
    with D_s > δ. The token bound (Kiln's) takes out of the gradient each token whose own
    |log π_prox - log μ| > δ_tok: a mean over 4,000 tokens stays small while 20 of them are 10 nats
    off, and those tokens would train at w = C (or w ≈ 0) while the rest of the sequence is fine to
    train on. None switches either off; D_s counts every gradient-carrying token either way.

    keep_s: the sequence passes the sequence filter and has at least one token left (a sequence
    without one reports deviation 0 and is not kept: there is nothing to train on). kept_t: a
    gradient-carrying token of a kept sequence within the token bound, the mask the loss takes.
    `seq_index` (int64 [N]) names each token's sequence in [0, num_seqs).
    """
    mask = loss_mask.bool()
    drift = (prox_logprobs.detach().float() - behaviour_logprobs.float()).abs() * mask
    sums = torch.zeros(num_seqs, dtype=torch.float32, device=drift.device).index_add_(0, seq_index, drift)
    counts = torch.zeros(num_seqs, dtype=torch.float32, device=drift.device).index_add_(0, seq_index, mask.float())
    deviation = torch.where(counts > 0, sums / counts.clamp_min(1.0), torch.zeros_like(sums))
    in_bound = mask if token_delta is None else mask & (drift <= token_delta)
    left = torch.zeros(num_seqs, dtype=torch.float32, device=drift.device).index_add_(0, seq_index, in_bound.float())
    keep = left > 0
    if delta is not None:
        keep &= deviation <= delta
    return keep, in_bound & keep[seq_index], deviation


@dataclass(frozen=True)
class FilterStats:
    """What MirrorPop saw and kept in one batch, and the importance weights of the kept tokens.

    Computed once per batch, before the first update, from the whole batch (`filter_stats`). ρ = π_prox/μ,
    the drift MirrorPop measures; w = min(ρ, C) the importance weight."""

    sequences: int  # sequences with at least one gradient-carrying token
    kept_sequences: int
    tokens: int  # gradient-carrying tokens before MirrorPop
    kept_tokens: int  # gradient-carrying tokens MirrorPop kept
    token_masked: int  # tokens of kept sequences that the token bound took out of the gradient
    abs_log_rho_sum: float  # Σ |log ρ| over the gradient-carrying tokens
    kept_abs_log_rho_sum: float
    deviation_sum: float  # Σ D_s over the sequences with gradient-carrying tokens
    deviation_max: float  # max D_s over them
    is_weight_sum: float  # Σ w over the kept tokens
    is_weight_max: float
    is_weight_min: float
    truncated: int  # kept tokens whose importance weight hit the cap C
    dropped: tuple[int, ...] = ()  # indices of the sequences with gradient-carrying tokens that were not kept

    def metrics(self) -> dict[str, float]:
        """The metrics stream's view: fractions and means (0 where nothing was counted)."""
        kept = max(self.kept_tokens, 1)
        return {
            "kept_fraction": self.kept_sequences / self.sequences if self.sequences else 0.0,
            "mirrorpop_dropped": float(len(self.dropped)),
            "mirrorpop_token_masked": float(self.token_masked),
            "kept_token_fraction": self.kept_tokens / self.tokens if self.tokens else 0.0,
            "deviation_mean": self.deviation_sum / self.sequences if self.sequences else 0.0,
            "deviation_max": self.deviation_max,
            "abs_log_rho_mean": self.abs_log_rho_sum / self.tokens if self.tokens else 0.0,
            "kept_abs_log_rho_mean": self.kept_abs_log_rho_sum / kept,
            "is_weight_mean": self.is_weight_sum / kept,
            "is_weight_max": self.is_weight_max if self.kept_tokens else 0.0,
            "is_weight_min": self.is_weight_min if self.kept_tokens else 0.0,
            "is_truncated_fraction": self.truncated / kept,
            "is_truncated": float(self.truncated),
        }


def filter_stats(
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    keep: torch.Tensor,
    kept: torch.Tensor,
    deviation: torch.Tensor,
    seq_index: torch.Tensor,
    *,
    is_cap: float,
) -> FilterStats:
    """MirrorPop's statistics for a whole batch, from `mirrorpop_mask`'s verdict (`keep` [S], `kept`
    [N]): sequences and tokens before and after filtering, the tokens the token bound masked, |log ρ|
    before and after, and the importance weights w = min(ρ, C) of the kept tokens."""
    mask = loss_mask.bool()
    kept = kept.bool()
    log_rho = prox_logprobs.detach().float() - behaviour_logprobs.float()
    has_tokens = torch.zeros_like(keep).index_fill_(0, seq_index[mask], True)
    w = torch.exp(log_rho[kept]).clamp(max=is_cap)
    return FilterStats(
        sequences=int(has_tokens.sum()),
        kept_sequences=int(keep.sum()),
        tokens=int(mask.sum()),
        kept_tokens=int(kept.sum()),
        token_masked=int((mask & keep[seq_index] & ~kept).sum()),
        abs_log_rho_sum=float(log_rho[mask].abs().sum()),
        kept_abs_log_rho_sum=float(log_rho[kept].abs().sum()),
        deviation_sum=float(deviation[has_tokens].sum()),
        deviation_max=float(deviation[has_tokens].max()) if bool(has_tokens.any()) else 0.0,
        is_weight_sum=float(w.sum()),
        is_weight_max=float(w.max()) if w.numel() else 0.0,
        is_weight_min=float(w.min()) if w.numel() else 0.0,
        truncated=int((torch.exp(log_rho[kept]) >= is_cap).sum()),
        dropped=tuple(int(i) for i in torch.nonzero(has_tokens & ~keep).flatten().tolist()),
    )


@dataclass
class ClipStats:
    """How often the clip acted, over the token-updates of a step; adds across micro-batches (`a + b`).

    A token is clipped where the clipped surrogate is the smaller one, so its ratio gets no gradient:
    above, r > 1 + ε_high with A > 0; below, r < 1 - ε_low with A < 0."""

    tokens: int = 0  # kept tokens, once per update they took part in
    clipped_low: int = 0
    clipped_high: int = 0

    def __add__(self, other: ClipStats) -> ClipStats:
        return ClipStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @classmethod
    def of(cls, counts: torch.Tensor) -> ClipStats:
        """From `policy_loss_on_device`'s counts [tokens, clipped_low, clipped_high] (a host read)."""
        return cls(*(round(c) for c in counts.tolist()))

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        return {
            "clip_fraction": (self.clipped_low + self.clipped_high) / n,
            "clip_low_fraction": self.clipped_low / n,
            "clip_high_fraction": self.clipped_high / n,
            "clipped": float(self.clipped_low + self.clipped_high),
        }


def policy_loss_on_device(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    token_advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    is_cap: float,
    normalizer: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled, off-policy-corrected PPO loss over the masked tokens, divided by `normalizer`.

    r = exp(log π_θ - log π_prox) carries the gradient; w = min(exp(log π_prox - log μ), C) corrects
    for the engine having sampled from μ, is truncated at C = `is_cap` and is detached. `mask` must
    already exclude MirrorPop-dropped sequences. Returns (scalar loss, this slice's clip counts): the
    counts stay on the loss's device, int64 [tokens, clipped_low, clipped_high] (`ClipStats.of` reads
    them), so a caller inside a forward/backward pass need not wait for the device (`policy_loss`
    reads them at once).
    """
    mask = mask.bool()
    prox = prox_logprobs.detach().float()
    ratio = torch.exp(logprobs.float() - prox)
    is_weight = torch.exp(prox - behaviour_logprobs.float()).clamp(max=is_cap)
    adv = token_advantages.float()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -is_weight * torch.minimum(unclipped, clipped)
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / normalizer

    with torch.no_grad():
        acted = mask & (clipped < unclipped)
        counts = torch.stack([mask.sum(), (acted & (adv < 0)).sum(), (acted & (adv > 0)).sum()])
    return loss, counts


def policy_loss(*tensors: torch.Tensor, **bounds: float) -> tuple[torch.Tensor, ClipStats]:
    """`policy_loss_on_device` (the same arguments) with its clip counts read: (scalar loss, this slice's
    ClipStats)."""
    loss, counts = policy_loss_on_device(*tensors, **bounds)
    return loss, ClipStats.of(counts)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Cross-entropy on the masked tokens: -Σ log π_θ(y_t) / normalizer (logprobs at T = 1)."""
    logprobs = logprobs.float()
    return -torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs)).sum() / normalizer


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, normalizer: float
) -> torch.Tensor:
    """The k3 estimator of KL(π_θ ‖ π_ref) on the masked tokens: Σ (e^x - x - 1) / normalizer with
    x = log π_ref - log π_θ; unbiased, always >= 0, and low-variance for small drifts."""
    x = ref_logprobs.detach().float() - logprobs.float()
    k3 = torch.exp(x) - x - 1.0
    return torch.where(mask.bool(), k3, torch.zeros_like(k3)).sum() / normalizer
