"""A `TrainBatch` as the learner's torch tensors, and its split into packed micro-batches.

The TrainBatch is token-aligned: entry t is token t (its loss mask, its behaviour logprob). A causal
LM is position-aligned: the logits at position t predict token t+1. `PackedBatch` holds everything
at the predicting position, so the losses see one aligned row per predicted token:
  targets[t]   = tokens[t+1]               (0 at a sequence's last position: it predicts nothing)
  grad_mask[t] = loss_mask[t+1] and t+1 is in the same sequence
  behaviour[t] = behaviour_logprobs[t+1]
  advantages[t] = the advantage of t's sequence
Position ids restart at 0 for each sequence, so a micro-batch of several sequences runs as ONE packed
row: transformers' mask builder reads restarting position ids without an attention mask as
packed sequences and gives every sequence its own causal block (sdpa on CPU, varlen with flash
attention). Micro-batches split between sequences, never inside one. A mini-batch (one optimizer
update) is a set of consecutive sequences, split again into micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocols import TrainBatch


class BatchError(ValueError):
    """A TrainBatch the learner cannot train on (says why); the learner keeps serving."""


@dataclass
class PackedBatch:
    """One TrainBatch on the training device, position-aligned (see the module docstring)."""

    tokens: torch.Tensor  # int64 [N], the model input
    position_ids: torch.Tensor  # int64 [N], 0 at each sequence start
    seq_index: torch.Tensor  # int64 [N], the sequence of each position
    cu_seqlens: np.ndarray  # int64 [S+1], host copy for splitting
    targets: torch.Tensor  # int64 [N]
    grad_mask: torch.Tensor  # bool [N]
    behaviour_logprobs: torch.Tensor  # float32 [N]
    advantages: torch.Tensor  # float32 [N]
    has_next: torch.Tensor  # bool [N]: position t predicts a token of its own sequence

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    def to_token_aligned(self, predicted: torch.Tensor) -> torch.Tensor:
        """Position-aligned per-token values [N] -> token-aligned (value of token t at t; 0 at each
        sequence's first token, which no position predicts)."""
        out = torch.zeros_like(predicted)
        out[1:] = torch.where(self.has_next[:-1], predicted[:-1], torch.zeros_like(predicted[:-1]))
        return out


@dataclass(frozen=True)
class MicroBatch:
    """Whole sequences [first_seq, end_seq) covering positions [start, stop) of the PackedBatch."""

    start: int
    stop: int
    first_seq: int
    end_seq: int

    @property
    def positions(self) -> slice:
        return slice(self.start, self.stop)


def pack(batch: TrainBatch, device: str | torch.device, *, vocab_size: int, max_seq_len: int) -> PackedBatch:
    """Validate `batch` and move it to `device` position-aligned. Raises BatchError on bad input."""
    try:
        batch.check()
    except ValueError as err:
        raise BatchError(f"malformed TrainBatch: {err}") from None
    tokens = np.asarray(batch.tokens, dtype=np.int64)
    cu = np.asarray(batch.cu_seqlens, dtype=np.int64)
    if len(cu) == 0:
        raise BatchError("malformed TrainBatch: cu_seqlens is empty (needs S+1 boundaries)")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise BatchError(f"token ids must lie in [0, {vocab_size}); got [{tokens.min()}, {tokens.max()}]")
    lengths = np.diff(cu)
    if lengths.size and lengths.max() > max_seq_len:
        raise BatchError(f"a sequence of {lengths.max()} tokens exceeds model.max_seq_len {max_seq_len}")
    if not np.all(np.isfinite(batch.behaviour_logprobs)) or not np.all(np.isfinite(batch.advantages)):
        raise BatchError("behaviour logprobs and advantages must be finite")

    n = tokens.size
    seq_index = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    position_ids = np.arange(n, dtype=np.int64) - np.repeat(cu[:-1], lengths)
    has_next = np.zeros(n, dtype=bool)
    if n:
        has_next[:-1] = seq_index[1:] == seq_index[:-1]

    def shifted(values: np.ndarray, fill) -> np.ndarray:
        out = np.full(n, fill, dtype=values.dtype)
        out[:-1] = values[1:]
        return np.where(has_next, out, np.asarray(fill, dtype=values.dtype))

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return PackedBatch(
        tokens=dev(tokens),
        position_ids=dev(position_ids),
        seq_index=dev(seq_index),
        cu_seqlens=cu,
        targets=dev(shifted(tokens, 0)),
        grad_mask=dev(shifted(np.asarray(batch.loss_mask, dtype=bool), False)),
        behaviour_logprobs=dev(shifted(np.asarray(batch.behaviour_logprobs, dtype=np.float32), 0.0)),
        advantages=dev(np.asarray(batch.advantages, dtype=np.float32)[seq_index]),
        has_next=dev(has_next),
    )


def micro_batches(cu_seqlens: np.ndarray, max_tokens: int, seqs: Sequence[int] | None = None) -> list[MicroBatch]:
    """Greedy split of whole sequences (every one, or the ascending indices `seqs`) into micro-batches
    of at most `max_tokens` tokens; a sequence longer than that is a micro-batch of its own. A
    micro-batch is one packed row, so it holds consecutive sequences only: a sequence missing from
    `seqs` ends the current one. Empty sequences ride along; no micro-batch is empty."""
    chosen = range(len(cu_seqlens) - 1) if seqs is None else [int(s) for s in seqs]
    out: list[MicroBatch] = []
    first = last = None  # the current run of consecutive chosen sequences is [first, last]
    for s in chosen:
        if first is not None and (s != last + 1 or int(cu_seqlens[s + 1]) - int(cu_seqlens[first]) > max_tokens):
            out.append(MicroBatch(int(cu_seqlens[first]), int(cu_seqlens[last + 1]), first, last + 1))
            first = None
        if first is None:
            first = s
        last = s
    if first is not None:
        out.append(MicroBatch(int(cu_seqlens[first]), int(cu_seqlens[last + 1]), first, last + 1))
    return [mb for mb in out if mb.stop > mb.start]


def mini_batches(seq_tokens: np.ndarray, count: int) -> list[np.ndarray]:
    """Split the sequences that carry tokens (`seq_tokens[s]` > 0, the tokens each one trains) into at
    most `count` mini-batches of consecutive sequences (in batch order) with about equal token counts:
    a sequence joins the part its middle token falls in. Fewer sequences than `count` give fewer
    mini-batches, never an empty one. Returns the ascending sequence indices of each mini-batch."""
    seqs = np.flatnonzero(np.asarray(seq_tokens) > 0)
    if seqs.size == 0:
        return []
    weights = np.asarray(seq_tokens, dtype=np.float64)[seqs]
    middles = np.cumsum(weights) - weights / 2
    part = np.minimum((middles * count / weights.sum()).astype(np.int64), count - 1)
    return [seqs[part == k] for k in range(count) if np.any(part == k)]
