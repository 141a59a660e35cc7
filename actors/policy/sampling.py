"""Sampling with Kiln's logprob convention (docs/rollout.md), shared by every torch code path.

The reported behaviour logprob is log softmax(logits / T) of the sampled token. Top-k and top-p only
restrict which tokens may be drawn; the logprob is never renormalised over the kept set, so with the
training default top_p = 1, top_k = 0 it is exactly the learner's log π(y_t).

Both sides of the convention live here: `sample` is the engine's draw, `token_logprobs` the
learner's recompute of the same quantity. `sample` stays beside it, though only the torch engine
draws, so the one formula both numbers come from is written in one place.
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    filtered: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sampling. logits [B, V]; temperature, top_p [B] float; top_k [B] long (0 = off).
    `filtered`: whether any row uses top-p or top-k, if the caller knows it from the requests (None:
    read it from the tensors, a host sync on GPU). Returns (token ids [B], logprobs [B] float32)."""
    logp = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    probs = logp.exp()
    if filtered is None:
        filtered = bool(((top_p < 1) | (top_k > 0)).any())
    if filtered:
        probs = _filter(probs, top_p, top_k)
    # Exponential-race sampling (argmax of p / Exp(1)) equals multinomial and has no host sync.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    tokens = (probs / noise).argmax(dim=-1)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _filter(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p set (the sampling set only)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = (rank < k) & (mass_before < top_p[:, None])
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter(1, order, sorted_p * keep)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of `tokens`: logits [N, V] predict tokens [N]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(1, tokens[:, None])[:, 0]
