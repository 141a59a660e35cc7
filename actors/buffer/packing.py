"""Which tokens carry gradient, how stale they are, and how episodes pack into a `TrainBatch`.

One sequence per gradient-carrying turn: tokens = prompt_ids ++ response_ids; loss_mask is 1 on the
response tokens; behaviour_logprobs are the turn's logprobs on response tokens (0 on the prompt);
versions are the turn's per-token weight versions (-1 on the prompt); the sequence's advantage is its
turn's (actors/buffer/groups.py `credit`: its own with `algo.turn_credit=per_turn`, its episode's with
`episode`) and its `episode_ids` entry names its episode. `algo.train_turns = "all"` (the default)
makes every turn carry gradient; "first" only turn 1 (Kiln's option: repair turns are conditioned on
feedback the policy will not see at test time).
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


def pack_batch(
    episodes: Sequence[Episode], advantages: Sequence[Sequence[float]], version: int, train_turns: str
) -> TrainBatch:
    """Pack episodes into one TrainBatch for learner version `version`. `advantages[i]` holds one
    advantage per gradient-carrying turn of episode i, in turn order."""
    tokens, mask, logprobs, versions, seq_adv, seq_episode, lengths = [], [], [], [], [], [], []
    for ep, turn_advantages in zip(episodes, advantages, strict=True):
        turns = gradient_turns(ep, train_turns)
        if len(turn_advantages) != len(turns):
            raise ValueError(
                f"episode {ep.episode_id}: {len(turn_advantages)} advantages for {len(turns)} gradient-carrying turns"
            )
        for turn, adv in zip(turns, turn_advantages, strict=True):
            n_prompt, n_resp = len(turn.prompt_ids), len(turn.response_ids)
            tokens += [np.asarray(turn.prompt_ids, dtype=np.int64), np.asarray(turn.response_ids, dtype=np.int64)]
            mask += [np.zeros(n_prompt, dtype=bool), np.ones(n_resp, dtype=bool)]
            logprobs += [np.zeros(n_prompt, dtype=np.float32), np.asarray(turn.logprobs, dtype=np.float32)]
            versions += [np.full(n_prompt, -1, dtype=np.int64), np.asarray(turn.versions, dtype=np.int64)]
            seq_adv.append(adv)
            seq_episode.append(ep.episode_id)
            lengths.append(n_prompt + n_resp)

    def cat(parts, dtype):
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

    return TrainBatch(
        version=version,
        episode_ids=seq_episode,
        tokens=cat(tokens, np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        loss_mask=cat(mask, bool),
        behaviour_logprobs=cat(logprobs, np.float32),
        advantages=np.asarray(seq_adv, dtype=np.float32),
        versions=cat(versions, np.int64),
    )
