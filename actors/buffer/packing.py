"""Which tokens carry gradient, how stale they are, and how episodes pack into a `TrainBatch`.

One sequence per gradient-carrying turn: tokens = prompt_ids ++ response_ids; loss_mask is 1 on the
response tokens; behaviour_logprobs are the turn's logprobs on response tokens (0 on the prompt);
versions are the turn's per-token weight versions (-1 on the prompt); the sequence's advantage is
its episode's. `algo.train_turns = "first"` makes only turn 1 carry gradient (the paper's choice:
repair turns are conditioned on feedback the policy will not see at test time); "all" uses every turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from actors.buffer.formulas import sample_lag
from protocols import Episode, TrainBatch, Turn


def gradient_turns(ep: Episode, train_turns: str) -> list[Turn]:
    return ep.turns[:1] if train_turns == "first" else list(ep.turns)


def gradient_versions(ep: Episode, train_turns: str) -> np.ndarray:
    turns = gradient_turns(ep, train_turns)
    return np.concatenate([np.asarray(t.versions, dtype=np.int64) for t in turns])


def episode_lag(ep: Episode, learner_version: int, train_turns: str) -> int | None:
    """Staleness of a sample: learner version minus the oldest version among its gradient tokens."""
    return sample_lag(learner_version, gradient_versions(ep, train_turns))


def pack_batch(episodes: Sequence[Episode], advantages: Sequence[float], version: int, train_turns: str) -> TrainBatch:
    """Pack episodes (with one advantage each) into one TrainBatch for learner version `version`."""
    tokens, mask, logprobs, versions, seq_adv, lengths = [], [], [], [], [], []
    for ep, adv in zip(episodes, advantages, strict=True):
        for turn in gradient_turns(ep, train_turns):
            n_prompt, n_resp = len(turn.prompt_ids), len(turn.response_ids)
            tokens += [np.asarray(turn.prompt_ids, dtype=np.int64), np.asarray(turn.response_ids, dtype=np.int64)]
            mask += [np.zeros(n_prompt, dtype=bool), np.ones(n_resp, dtype=bool)]
            logprobs += [np.zeros(n_prompt, dtype=np.float32), np.asarray(turn.logprobs, dtype=np.float32)]
            versions += [np.full(n_prompt, -1, dtype=np.int64), np.asarray(turn.versions, dtype=np.int64)]
            seq_adv.append(adv)
            lengths.append(n_prompt + n_resp)

    def cat(parts, dtype):
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

    return TrainBatch(
        version=version,
        episode_ids=[ep.episode_id for ep in episodes],
        tokens=cat(tokens, np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        loss_mask=cat(mask, bool),
        behaviour_logprobs=cat(logprobs, np.float32),
        advantages=np.asarray(seq_adv, dtype=np.float32),
        versions=cat(versions, np.int64),
    )
