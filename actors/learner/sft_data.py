"""Sequence packing for supervised steps: token sequences (`actors.policy.chat_tokens`) into
`TrainBatch`es for `Trainer.sft_step`, the one path of `kiln sft` and the warm start.

A batch holds whole sequences, concatenated, up to `batch_tokens` tokens (a sequence longer than that
gets a batch of its own); the backend splits a batch into micro-batches between sequences, and each
sequence attends only to itself (position ids restart at 0). Packing is first-fit over the sequences
in the order given, so a caller that shuffles per epoch gets different batches per epoch and the same
batches for the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from actors.policy.chat_tokens import TokenSequence
from protocols import TrainBatch


def pack_sequences(sequences: Sequence[TokenSequence], batch_tokens: int) -> list[TrainBatch]:
    """First-fit packing of `sequences` into batches of at most `batch_tokens` tokens each."""
    bins: list[list[TokenSequence]] = []
    room: list[int] = []
    for seq in sequences:
        n = len(seq)
        for i, left in enumerate(room):
            if n <= left:
                bins[i].append(seq)
                room[i] -= n
                break
        else:
            bins.append([seq])
            room.append(batch_tokens - n)
    return [train_batch(b) for b in bins]


def train_batch(sequences: Sequence[TokenSequence], tag: str = "sft") -> TrainBatch:
    """Sequences as one packed TrainBatch: loss on the responses, no behaviour logprobs or advantages
    (a supervised step reads neither)."""
    tokens = np.fromiter((t for s in sequences for t in s.ids), dtype=np.int64)
    mask = np.fromiter((m for s in sequences for m in s.loss_mask), dtype=bool)
    lengths = [len(s) for s in sequences]
    n = len(tokens)
    return TrainBatch(
        version=0,
        episode_ids=[f"{tag}/{i}" for i in range(len(sequences))],
        tokens=tokens,
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.zeros(n, dtype=np.float32),
        advantages=np.zeros(len(sequences), dtype=np.float32),
        versions=np.full(n, -1, dtype=np.int64),
    )
